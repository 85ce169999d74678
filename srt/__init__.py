"""srt: an SGLang-style LLM serving engine."""
