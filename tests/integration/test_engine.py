"""The offline Engine (``from srt import Engine``) with the default model on CPU.

One Engine for the module; the last test shuts it down and checks that no child is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import psutil
import pytest

from srt import Engine
from srt.utils.errors import EngineDeadError, LaunchError, RequestError, RequestTimeoutError
from tests.helpers.server import wait_gone

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return tmp_path_factory.mktemp("engine") / "steps.jsonl"


@pytest.fixture(scope="module")
def engine(trace):
    llm = Engine(max_total_tokens=16384, log_level="warning", step_trace_path=str(trace))
    yield llm
    llm.shutdown()


def test_generate_single(engine):
    out = engine.generate("The capital of France is", GREEDY)
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The capital of France is"))
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0 and meta["id"]
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])


def test_step_trace_of_a_request(engine, trace):
    """--step-trace-path through the real scheduler process: a request's prefill, then one decode
    step per further token, each a JSON line with its work."""
    before = len(trace.read_text().splitlines())
    ids = engine.tokenizer.encode("The step trace of one request")
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "ignore_eos": True})
    lines = [json.loads(x) for x in trace.read_text().splitlines()[before:]]
    cached = out["meta_info"]["cached_tokens"]
    assert [x["mode"] for x in lines] == ["extend"] + ["decode"] * 7
    assert lines[0]["tokens"] == len(ids) - cached and lines[0]["kv"] == len(ids)
    assert [x["kv"] for x in lines[1:]] == list(range(len(ids) + 1, len(ids) + 8))
    assert all(0 < x["forward_s"] <= x["step_s"] for x in lines)


def test_generate_batch_matches_single(engine):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Hello, my name is"]
    outs = engine.generate(prompts, GREEDY)
    assert isinstance(outs, list) and len(outs) == 3
    for p, o in zip(prompts, outs):
        assert o["text"] == engine.generate(p, GREEDY)["text"]
    by_ids = engine.generate(input_ids=[engine.tokenizer.encode(p) for p in prompts], sampling_params=GREEDY)
    assert [o["text"] for o in by_ids] == [o["text"] for o in outs]


def test_generate_stream(engine):
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}  # long enough not to merge
    full = engine.generate("Once upon a time", params)
    chunks = list(engine.generate("Once upon a time", params, stream=True))
    assert len(chunks) > 1
    # SGLang's Engine: each chunk holds the output so far (--incremental-streaming-output: deltas)
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert all(len(c["output_ids"]) == c["meta_info"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_logprobs(engine):
    out = engine.generate(
        "Hello", {"max_new_tokens": 4, "temperature": 0}, return_logprob=True, top_logprobs_num=2
    )
    lps = out["meta_info"]["output_token_logprobs"]
    tops = out["meta_info"]["output_top_logprobs"]
    assert [tid for _, tid, _ in lps] == out["output_ids"]
    for (lp, tid, _), top in zip(lps, tops):
        assert lp <= 0 and len(top) == 2 and top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-4)


def test_text_in_logprobs(engine):
    """return_text_in_logprobs (SGLang's): each entry's third slot is its token decoded alone,
    for the output, its top lists and the prompt, streamed or not; without it the slot is None."""
    from srt.server_args import ServerArgs
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    tok = load_tokenizer(tokenizer_source(ServerArgs()))
    kw = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    out = engine.generate("Hello there", GREEDY, return_text_in_logprobs=True, **kw)
    meta = out["meta_info"]
    entries = [*meta["output_token_logprobs"], *meta["input_token_logprobs"]]
    entries += [e for top in meta["output_top_logprobs"] + meta["input_top_logprobs"] if top for e in top]
    assert len(entries) > 3 * 8
    assert all(text == tok.decode([tid]) for _, tid, text in entries)
    *_, last = engine.generate("Hello there", GREEDY, return_text_in_logprobs=True, stream=True, **kw)
    assert last["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
    plain = engine.generate("Hello there", GREEDY, **kw)["meta_info"]
    assert all(
        text is None for _, _, text in plain["output_token_logprobs"] + plain["input_token_logprobs"][1:]
    )


def test_n_and_seed(engine):
    params = {"max_new_tokens": 8, "temperature": 1.0, "n": 2, "seed": 11, "ignore_eos": True}
    a = engine.generate("Tell me a joke.", params)
    b = engine.generate("Tell me a joke.", params)
    assert [o["text"] for o in a] == [o["text"] for o in b]
    assert a[0]["text"] != a[1]["text"]


def test_async_generate_32_concurrent(engine):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(32)]
    params = {**GREEDY, "ignore_eos": True}

    async def main():
        return await asyncio.gather(*[engine.async_generate(p, params) for p in prompts])

    outs = asyncio.run(main())
    assert len(outs) == 32 and all(o["meta_info"]["completion_tokens"] == 8 for o in outs)
    for i in (0, 17, 31):  # spot-check against one-at-a-time generation
        assert outs[i]["output_ids"] == engine.generate(prompts[i], params)["output_ids"]


def test_async_stream(engine):
    async def main():
        chunks = []
        async for c in await engine.async_generate("Once upon a time", GREEDY, stream=True):
            chunks.append(c)
        return chunks

    chunks = asyncio.run(main())
    assert chunks[-1]["text"] == engine.generate("Once upon a time", GREEDY)["text"]


def test_early_stream_close_aborts(engine):
    it = engine.generate("Count to a million:", {"max_new_tokens": 2000, "ignore_eos": True}, stream=True)
    next(it)
    it.close()
    running = engine.get_server_info()["internal_states"][0]["num_running_reqs"]
    for _ in range(50):
        if running == 0:
            break
        running = engine.get_server_info()["internal_states"][0]["num_running_reqs"]
    assert running == 0


def test_bad_sampling_params_raise_typed_error(engine):
    with pytest.raises(RequestError) as e:
        engine.generate("x", {"temperature": -1, "top_p": 2.0})
    assert isinstance(e.value, ValueError) and "temperature" in str(e.value) and "top_p" in str(e.value)
    with pytest.raises(RequestError, match="context length"):
        engine.generate("x", {"max_new_tokens": 10**6})


def test_priority_needs_the_flag(engine):
    with pytest.raises(RequestError, match="--enable-priority-scheduling") as e:
        engine.generate("x", GREEDY, priority=1)
    assert e.value.param == "priority"


def test_timeout_raises_typed_error_and_ends_a_stream(engine):
    long = {"max_new_tokens": 4000, "ignore_eos": True}
    with pytest.raises(RequestTimeoutError, match="timed out after 0.3 s") as e:
        engine.generate("Count:", long, timeout=0.3)
    assert e.value.status_code == 408
    chunks = list(engine.generate("Count:", long, stream=True, timeout=0.3))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "timeout"
    with pytest.raises(RequestError, match="timeout"):
        engine.generate("x", GREEDY, timeout=0)
    assert engine.get_server_info()["internal_states"][0]["num_running_reqs"] == 0


def test_meta_info_has_phase_timings(engine):
    meta = engine.generate("The capital of France is", GREEDY)["meta_info"]
    assert 0 <= meta["queue_time"] and 0 < meta["prefill_time"] and 0 <= meta["decode_time"]
    assert 0 < meta["ttft"] <= meta["e2e_latency"]


def test_server_info_flush_and_abort(engine):
    info = engine.get_server_info()
    assert info["max_total_num_tokens"] == 16384 and "internal_states" in info
    assert engine.flush_cache()["success"] is True
    assert engine.abort_request("no-such-rid") == 0


def test_launch_failure_raises_and_leaves_nothing(engine):
    from srt.utils.hf_tokenizer import tokenizer_source

    before = {p.pid for p in _session_descendants()}
    with pytest.raises(LaunchError) as e:
        Engine(
            model_path="/nonexistent/model",
            tokenizer_path=tokenizer_source(engine.server_args),
            log_level="error",
        )
    assert e.value.process_name == "scheduler" and "/nonexistent/model" in str(e.value)
    extra = [p for p in _session_descendants() if p.pid not in before]
    assert wait_gone(extra, 5.0) == []


def _session_descendants() -> list[psutil.Process]:
    """This process's descendants in its own session: an Engine's children, not the suite's early
    runs (tests/helpers/early_runs.py), which start in sessions of their own at any moment."""
    sid = os.getsid(0)
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except ProcessLookupError:
            pass
    return out


def test_the_detokenizer_does_not_load_torch(engine):
    """Decoding needs no torch: the detokenizer keeps transformers from importing it (about 190
    MiB of resident memory); the scheduler does load it."""

    def maps_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch_cpu" in f.read()

    pids = engine.child_pids
    assert not maps_torch(pids["detokenizer"])
    assert maps_torch(next(pid for name, pid in pids.items() if name != "detokenizer"))
    out = engine.generate("Hi", {"max_new_tokens": 4, "temperature": 0})
    assert out["text"] and out["meta_info"]["completion_tokens"] == 4


def test_shutdown_leaves_no_child(engine):
    """Runs last: shuts the module's engine down."""
    pids = engine.child_pids
    procs = [psutil.Process(pid) for pid in pids.values() if pid is not None]
    assert len(procs) == 2
    out: list = []
    t = threading.Thread(
        target=lambda: out.append(engine.generate("Hi", {"max_new_tokens": 40, "ignore_eos": True}))
    )
    t.start()
    while not engine.tokenizer_manager.num_in_flight and t.is_alive():
        time.sleep(0.01)
    engine.shutdown(graceful_timeout=60)  # the request in flight completes first
    t.join(timeout=10)
    assert out and out[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert wait_gone(procs, 5.0) == []
    assert [p for p in psutil.Process().children(recursive=True) if p.pid in pids.values()] == []
    with pytest.raises(EngineDeadError):
        engine.generate("x", GREEDY)
