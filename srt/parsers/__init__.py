"""Text parsers for chat output: tool calls (``tool_calls``) and reasoning sections (``reasoning``).

Pure Python on decoded text, no torch: the OpenAI chat layer runs them on a request's output, whole
(``parse``) or as it streams (``stream()``). Each family has a name registry matching SGLang's
``--tool-call-parser`` / ``--reasoning-parser`` values.
"""
