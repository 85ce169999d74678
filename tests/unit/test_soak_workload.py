"""benchmarks/soak_workload.py: the soak's mix is seeded and complete, and its outcome checks
accept the well-formed responses and catch the malformed ones (lost [DONE], data after it, a
choice finished twice or never, an error outside OpenAI's shape)."""

from __future__ import annotations

import json

from benchmarks.soak_workload import (
    ACTIONS,
    ROUTES,
    classify_plain,
    classify_stream,
    make_scenarios,
    request_of,
)


def sse(*events) -> bytes:
    out = b""
    for e in events:
        out += b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
    return out


def chat_chunk(index: int, finish: str | None, text: str = "x") -> dict:
    return {"choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}]}


def gen_chunk(index: int, finish: str | None) -> dict:
    return {
        "index": index,
        "text": "x",
        "meta_info": {"finish_reason": None if finish is None else {"type": finish}},
    }


def test_scenarios_are_seeded_and_cover_the_mix():
    a, b = make_scenarios(2000, seed=3), make_scenarios(2000, seed=3)
    assert [request_of(s) for s in a] == [request_of(s) for s in b]
    assert {s.route for s in a} == set(ROUTES) and {s.action for s in a} == set(ACTIONS)
    assert {s.n for s in a} == {1, 2} and {s.stream for s in a} == {True, False}
    assert any(s.stop for s in a) and all(1 <= s.max_tokens <= 8 for s in a)
    assert len({s.system for s in a}) >= 3 and len({s.rid for s in a}) == 2000
    expiring = [s.timeout_s for s in a if s.action == "deadline_expire"]
    assert expiring and max(expiring) <= 0.2
    assert not any(s.action.startswith("deadline") for s in make_scenarios(500, 3, deadlines=False))
    path, body = request_of(next(s for s in a if s.route == "chat" and s.timeout_s))
    assert path == "/v1/chat/completions" and body["timeout"] > 0 and body["messages"][0]["role"] == "system"


def test_plain_responses():
    ok = {"choices": [{"index": 0, "finish_reason": "length", "text": "x"}]}
    assert classify_plain("completions", 1, 200, json.dumps(ok).encode()).kind == "complete"
    two = [{"text": "a", "meta_info": {"finish_reason": {"type": "stop"}}}] * 2
    assert classify_plain("generate", 2, 200, json.dumps(two).encode()).violation is None
    timeout = {"error": {"message": "timed out", "type": "timeout", "code": "request_timeout"}}
    got = classify_plain("chat", 1, 408, json.dumps(timeout).encode())
    assert (got.kind, got.violation) == ("timeout", None)
    assert classify_plain("chat", 1, 503, b'{"detail": "x"}').violation  # not OpenAI's shape
    assert classify_plain("chat", 1, 200, b"<html>").violation
    assert classify_plain("completions", 2, 200, json.dumps(ok).encode()).violation  # one of two
    unfinished = {"choices": [{"index": 0, "finish_reason": None}]}
    assert classify_plain("completions", 1, 200, json.dumps(unfinished).encode()).violation


def test_streams():
    good = sse(
        chat_chunk(0, None), chat_chunk(1, None), chat_chunk(1, "stop"), chat_chunk(0, "length"), b"[DONE]"
    )
    assert classify_stream("chat", 2, 200, good, complete=True).kind == "complete"
    timed_out = sse(gen_chunk(0, None), gen_chunk(0, "timeout"), b"[DONE]")
    assert classify_stream("generate", 1, 200, timed_out, complete=True).kind == "timeout"
    error = sse(
        chat_chunk(0, None),
        {"error": {"message": "dead", "type": "server_error", "code": "engine_dead"}},
        b"[DONE]",
    )
    got = classify_stream("chat", 1, 200, error, complete=True)
    assert got.kind == "stream_error_engine_dead" and got.violation is None
    # an intended disconnect is an outcome of its own, whatever was read so far
    assert classify_stream("chat", 1, 200, sse(chat_chunk(0, None)), complete=False).kind == "disconnected"
    bad = {
        "no [DONE]": sse(chat_chunk(0, "stop")),
        "data after [DONE]": sse(chat_chunk(0, "stop"), b"[DONE]", chat_chunk(0, None)),
        "finished twice": sse(chat_chunk(0, "stop"), chat_chunk(0, "stop"), b"[DONE]"),
        "never finished": sse(chat_chunk(0, None), b"[DONE]"),
        "one of two": sse(chat_chunk(0, "stop"), b"[DONE]"),
        "not json": b"data: {oops\n\ndata: [DONE]\n\n",
        "error not last": sse(
            {"error": {"message": "m", "type": "t", "code": None}}, chat_chunk(0, "stop"), b"[DONE]"
        ),
    }
    for name, raw in bad.items():
        n = 2 if name == "one of two" else 1
        assert classify_stream("chat", n, 200, raw, complete=True).violation, name
