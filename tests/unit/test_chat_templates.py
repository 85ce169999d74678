"""--chat-template: the built-in templates rendered by transformers' apply_chat_template (the way
/v1/chat/completions renders them), files, and the start-up errors."""

from __future__ import annotations

import json

import pytest

from srt.configs.chat_templates import BUILTIN_CHAT_TEMPLATES, load_chat_template
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "Thanks"},
]
FN = json.dumps(WEATHER["function"])
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
INTRO = (
    "You can call the functions below. To call one, reply with a JSON object "
    '{"name": <function name>, "arguments": <arguments object>} inside <tool_call></tool_call> tags, '
    "one block per call.\n<tools>\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    return load_tokenizer(tokenizer_source(ServerArgs()))


def render(tokenizer, name: str, messages, tools=None, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=load_chat_template(name),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def test_chatml_renders_every_turn_and_the_tools(tokenizer):
    assert render(tokenizer, "chatml", CONVERSATION, [WEATHER]) == (
        f"<|im_start|>system\nBe brief.\n\n{INTRO}{FN}\n</tools><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_call>\n{CALL}\n</tool_call><|im_end|>\n"
        "<|im_start|>tool\nsunny<|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = [{"role": "user", "content": "Hi"}]
    assert render(tokenizer, "chatml", plain) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert (
        render(tokenizer, "chatml", plain, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_qwen_has_a_default_system_prompt_and_tool_responses_as_user_turns(tokenizer):
    two_results = [
        *CONVERSATION[:4],
        {"role": "tool", "tool_call_id": "c2", "content": "22 C"},
        *CONVERSATION[4:],
    ]
    assert render(tokenizer, "qwen", two_results, [WEATHER]) == (
        f"<|im_start|>system\nBe brief.\n\n{INTRO}{FN}\n</tools><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_call>\n{CALL}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tokenizer, "qwen", [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_renders_every_turn_and_the_tools(tokenizer):
    bos = tokenizer.bos_token or ""
    intro = (
        "You can call the functions below. To call one, reply with only a JSON object "
        '{"name": <function name>, "parameters": <arguments object>}; separate several calls with "; ".\n\n'
    )
    two_calls = dict(CONVERSATION[2], tool_calls=CONVERSATION[2]["tool_calls"] * 2)
    messages = [*CONVERSATION[:2], two_calls, *CONVERSATION[3:]]
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert render(tokenizer, "llama-3", messages, [WEATHER]) == (
        f"{bos}<|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\n{intro}{FN}\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n{call}; {call}<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is sunny.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nThanks<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render(tokenizer, "llama-3-instruct", [{"role": "user", "content": "Hi"}]) == (
        f"{bos}<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_builtin_outputs_parse_with_their_tool_call_parsers():
    """What each template asks the model to write is what the matching --tool-call-parser reads."""
    from srt.parsers.tool_calls import create_tool_call_parser

    for parser, text in (
        ("hermes", f"<tool_call>\n{CALL}\n</tool_call>"),
        ("qwen", f"<tool_call>\n{CALL}\n</tool_call>"),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}; ' + CALL),
    ):
        _, calls = create_tool_call_parser(parser).parse(text)
        assert [c.name for c in calls] == ["get_weather"] * (2 if parser == "llama3" else 1)
        assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_a_template_file_is_read(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert ServerArgs(device="cpu", chat_template=str(path)).resolve().chat_template == str(path)


def test_start_up_errors(tmp_path):
    with pytest.raises(ConfigError, match="neither an existing Jinja file nor a built-in") as e:
        load_chat_template("no-such-template")
    assert all(name in str(e.value) for name in BUILTIN_CHAT_TEMPLATES)
    with pytest.raises(ConfigError, match="cannot read"):
        load_chat_template(str(tmp_path))  # a directory
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        load_chat_template(str(bad))
