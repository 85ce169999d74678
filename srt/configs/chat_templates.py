"""``--chat-template``: a Jinja file, or one of the built-in templates below, used by
/v1/chat/completions instead of the tokenizer's own template.

    name        prompt format                                          tool calls (--tool-call-parser)
    chatml      <|im_start|>{role}\\n{content}<|im_end|>\\n              <tool_call>{json}</tool_call> (hermes)
    qwen        chatml; a default system prompt; tool results as a     <tool_call>{json}</tool_call> (qwen)
                user turn of <tool_response> blocks
    llama-3     <|start_header_id|>{role}<|end_header_id|>\\n\\n ...     bare JSON objects, "; " between (llama3)
                <|eot_id|>; tool results as the ipython role
    (llama-3-instruct is SGLang's name for llama-3)

The templates are srt's own, written for transformers' ``apply_chat_template`` (its Jinja
environment: ``trim_blocks``, ``lstrip_blocks``, a ``tojson`` filter, ``bos_token``). Each renders
system, user, assistant (with or without ``tool_calls``) and tool turns, the ``tools`` it is given
(a system block listing the functions and how to call them) and, with ``add_generation_prompt``,
the opening of the assistant turn. `load_chat_template` is called at start-up
(``ServerArgs.resolve``), so an unknown name, an unreadable file or a Jinja syntax error is a
`ConfigError` before any process starts.
"""

from __future__ import annotations

import os

from srt.utils.errors import ConfigError

_TOOLS_INTRO_JSON = (
    "You can call the functions below. To call one, reply with a JSON object "
    '{"name": <function name>, "arguments": <arguments object>} inside <tool_call></tool_call> '
    "tags, one block per call.\\n<tools>\\n"
)
# every function of ``tools`` (OpenAI's {"type": "function", "function": {...}} or a bare function)
_TOOL_LINES = (
    "{%- for tool in tools %}"
    "{{- ((tool.function if tool.function is defined else tool) | tojson) + '\\n' }}"
    "{%- endfor %}"
)


def _chatml(default_system: str | None, tool_results_as_user: bool) -> str:
    """A ChatML template; ``default_system``: the system prompt when the messages have none;
    ``tool_results_as_user``: tool turns become one user turn of <tool_response> blocks (else the
    ``tool`` role)."""
    system = "messages[0].content or ''"
    default = f"'{default_system}'" if default_system else "''"
    if tool_results_as_user:
        tool_turn = (
            "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
            "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
            "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        )
    else:
        tool_turn = "{{- '<|im_start|>tool\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    return (
        "{%- set has_system = messages and messages[0].role == 'system' %}"
        f"{{%- set system = ({system}) if has_system else {default} %}}"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
        f"{{{{- '{_TOOLS_INTRO_JSON}' }}}}{_TOOL_LINES}"
        "{{- '</tools><|im_end|>\\n' }}"
        "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if loop.first and has_system %}"
        "{%- elif message.role == 'tool' %}"
        + tool_turn
        + "{%- elif message.role == 'assistant' and message.tool_calls %}"
        "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
        "{%- for call in message.tool_calls %}"
        "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)"
        " + '\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


_LLAMA3_TOOLS_INTRO = (
    "You can call the functions below. To call one, reply with only a JSON object "
    '{"name": <function name>, "parameters": <arguments object>}; separate several calls with "; ".\\n\\n'
)

_LLAMA3 = (
    "{{- bos_token if bos_token is defined else '' }}"
    "{%- set has_system = messages and messages[0].role == 'system' %}"
    "{%- set system = (messages[0].content or '') if has_system else '' %}"
    "{%- if system or tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}"
    "{%- if tools %}"
    "{%- if system %}{{- '\\n\\n' }}{%- endif %}"
    f"{{{{- '{_LLAMA3_TOOLS_INTRO}' }}}}{_TOOL_LINES}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and has_system %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (message.content or '') + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- {'name': call.function.name, 'parameters': call.function.arguments} | tojson }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content or '') + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": _chatml(None, tool_results_as_user=False),
    "qwen": _chatml("You are a helpful assistant.", tool_results_as_user=True),
    "llama-3": _LLAMA3,
    "llama-3-instruct": _LLAMA3,
}


def load_chat_template(name_or_path: str) -> str:
    """The Jinja source of ``--chat-template``: an existing file's content, else the built-in
    template of that name. `ConfigError` for an unknown name, an unreadable file, or a template
    that does not compile."""
    path = os.path.expanduser(name_or_path)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {name_or_path!r}: cannot read the file ({e}).") from e
    elif name_or_path in BUILTIN_CHAT_TEMPLATES:
        source = BUILTIN_CHAT_TEMPLATES[name_or_path]
    else:
        raise ConfigError(
            f"--chat-template {name_or_path!r} is neither an existing Jinja file nor a built-in template "
            f"({', '.join(BUILTIN_CHAT_TEMPLATES)})."
        )
    _check_syntax(name_or_path, source)
    return source


def _check_syntax(name: str, source: str) -> None:
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    try:
        env.parse(source)
    except TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template {name!r} is not a valid Jinja template: {e}") from e
