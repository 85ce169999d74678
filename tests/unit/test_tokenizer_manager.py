"""TokenizerManager logic without child processes: validation, n > 1, admission control,
batched tokenization, streaming merge, aborts, engine death. Outputs are injected as BatchStrOut."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time

import pytest

from srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FinishReason,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    ProfileReq,
    ProfileReqOutput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
    scheduler_input_decoder,
)
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.managers.tokenizer.tokenizer_manager import DEADLINE_GRACE_S, TokenizerManager, scheduler_load
from srt.server_args import PortArgs, ServerArgs
from srt.utils.errors import ContextLengthError, EngineDeadError, QueueFullError, RequestError


class CharTokenizer:
    """One token per character (id = code point % 200); counts its batch calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, texts, add_special_tokens=True):
        self.calls += 1
        return {"input_ids": [[ord(c) % 200 for c in t] for t in texts]}

    def __len__(self) -> int:
        return 200

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


class CaptureSocket:
    def __init__(self) -> None:
        self.sent = []

    def send(self, raw: bytes) -> None:
        self.sent.append(scheduler_input_decoder.decode(raw))

    def close(self, linger: int = 0) -> None:
        pass


@pytest.fixture
def make_tm():
    made = []

    def make(tokenizer=CharTokenizer, **kw) -> TokenizerManager:
        args = ServerArgs(**kw)
        info = {
            "context_len": 100,
            "max_req_input_len": 99,
            "max_total_num_tokens": 1000,
            "max_running_requests": 8,
        }
        tm = TokenizerManager(args, PortArgs.init_new(), info, tokenizer() if tokenizer else None)
        tm.ipc.send_sock.close(linger=0)
        tm.ipc.send_sock = CaptureSocket()
        made.append(tm)
        return tm

    yield make
    for tm in made:
        tm.ipc.close_sockets()
        shutil.rmtree(tm.port_args.ipc_dir, ignore_errors=True)


def run(coro):
    return asyncio.run(coro)


def out(rid: str, text: str, ids: list[int], reason=None, completion: int = 1) -> BatchStrOut:
    return BatchStrOut(
        rids=[rid],
        output_strs=[text],
        output_ids=[ids],
        finished_reasons=[reason],
        prompt_tokens=[3],
        completion_tokens=[completion],
        cached_tokens=[0],
    )


def test_context_length_error_gives_the_numbers(make_tm):
    tm = make_tm()

    async def go():
        await tm.start()
        with pytest.raises(ContextLengthError) as e:
            await tm.prepare(GenerateReqInput(text="x" * 10, sampling_params={"max_new_tokens": 95}))
        # without an explicit max_new_tokens the default (128) is capped to what the context leaves
        prep = await tm.prepare(GenerateReqInput(text="x" * 90))
        return e.value, prep.reqs[0][0].sampling_params.max_new_tokens

    err, capped = run(go())
    assert "100" in err.message and "105" in err.message and "10 in the prompt" in err.message
    assert "95" in err.message and err.status_code == 400
    assert capped == 10


def test_validation_happens_before_anything_is_sent(make_tm):
    tm = make_tm()

    async def go():
        await tm.start()
        with pytest.raises(RequestError):
            await tm.prepare(GenerateReqInput(text=["ok", "fine"], sampling_params=[{}, {"top_p": 7}]))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await tm.prepare(GenerateReqInput(input_ids=[1, 500]))
        with pytest.raises(RequestError, match="empty"):
            await tm.prepare(GenerateReqInput(text=""))

    run(go())
    assert tm.ipc.send_sock.sent == []


def test_top_logprobs_beyond_the_server_bound_are_400(make_tm):
    """--max-top-logprobs-num (default 20) bounds each prompt's top_logprobs_num; the error names
    the flag and the route's own field, and nothing reaches the scheduler."""

    async def go(tm, obj):
        await tm.start()
        return await tm.prepare(obj)

    tm = make_tm()
    prep = run(go(tm, GenerateReqInput(text="ab", top_logprobs_num=20)))
    assert prep.reqs[0][0].top_logprobs_num == 20
    with pytest.raises(RequestError, match=r"<= 20 .*--max-top-logprobs-num.*got 21") as e:
        run(go(make_tm(), GenerateReqInput(text=["ab", "cd"], top_logprobs_num=[0, 21])))
    assert e.value.param == "top_logprobs_num" and e.value.status_code == 400
    tm = make_tm(max_top_logprobs_num=0)
    assert run(go(tm, GenerateReqInput(text="ab", return_logprob=True))).reqs[0][0].return_logprob
    chat = GenerateReqInput(text="ab", top_logprobs_num=1).serve_as(
        param_names={"top_logprobs_num": "top_logprobs"}
    )
    with pytest.raises(RequestError, match="top_logprobs must be <= 0") as e:
        run(go(tm, chat))
    assert e.value.param == "top_logprobs"
    assert tm.ipc.send_sock.sent == []


def test_a_text_too_long_for_any_tokenization_is_refused_untokenized(make_tm):
    """The default tokenizer's tokens cover at most 81 characters, so with a 100-token context a
    text of more than 8,100 characters (but those it may drop) cannot fit: a ContextLengthError
    before the tokenizer runs, for /generate and /tokenize alike."""
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source
    from srt.utils.token_cover import token_cover

    tokenizer = load_tokenizer(tokenizer_source(ServerArgs()))
    most = 100 * token_cover(tokenizer).chars
    tm = make_tm(tokenizer=lambda: tokenizer)

    async def go():
        await tm.start()
        for call in (
            lambda text: tm.prepare(GenerateReqInput(text=["ok", text])),
            lambda text: tm.inputs.tokenize([text], add_special_tokens=False),
        ):
            with pytest.raises(ContextLengthError, match=f"{most + 1} characters, so at least 101 tokens"):
                await call("#" * (most + 1))
        assert tm.inputs._batcher.num_calls == 0
        # characters the tokenizer drops do not count: this one is tokenized, and fits
        prep = await tm.prepare(GenerateReqInput(text="\x06" * (most + 1) + "ok"))
        assert tm.inputs._batcher.num_calls == 1
        return prep.reqs[0][0].input_ids

    assert run(go()) == tokenizer("\x06ok")["input_ids"]


def test_n_copies_share_a_prefill_and_get_distinct_seeds(make_tm):
    tm = make_tm()

    async def go():
        await tm.start()
        return await tm.prepare(GenerateReqInput(text="abc", rid="q", sampling_params={"n": 3, "seed": 10}))

    prep = run(go())
    assert [r.rid for r, _ in prep.reqs] == ["q-0", "q-1", "q-2"]
    assert [r.sampling_params.seed for r, _ in prep.reqs] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 for r, _ in prep.reqs)
    assert [w.sampling_params.max_new_tokens for w in prep.warmups] == [0]
    no_radix = make_tm(disable_radix_cache=True)

    async def go2():
        await no_radix.start()
        return await no_radix.prepare(GenerateReqInput(text="abc", sampling_params={"n": 2}))

    assert run(go2()).warmups == []


def test_requests_arriving_together_are_tokenized_in_one_call(make_tm):
    tm = make_tm()

    async def go():
        await tm.start()
        preps = await asyncio.gather(*[tm.prepare(GenerateReqInput(text=f"prompt {i}")) for i in range(6)])
        return preps

    preps = run(go())
    assert tm.tokenizer.calls == 1
    assert [p.reqs[0][0].input_ids for p in preps] == [
        [ord(c) % 200 for c in f"prompt {i}"] for i in range(6)
    ]


@pytest.mark.parametrize("incremental", [True, False])
def test_stream_merges_pending_outputs_and_non_stream_returns_the_whole(make_tm, incremental):
    """Chunks hold the new output (--incremental-streaming-output) or all of it so far (the
    default, SGLang's); outputs arriving before the consumer runs are merged either way."""
    tm = make_tm(incremental_streaming_output=incremental)

    async def go():
        await tm.start()
        prep = await tm.prepare(GenerateReqInput(text="abc", rid="s", stream=True))
        agen = tm.run(prep)
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_str_out(out("s", "He", [5]))
        tm._handle_batch_str_out(out("s", "llo", [6], completion=2))  # before the consumer runs: merged
        c1 = await first
        tm._handle_batch_str_out(out("s", "!", [7], FinishReason.of_length(3), completion=3))
        c2 = await agen.__anext__()
        with pytest.raises(StopAsyncIteration):
            await agen.__anext__()
        prep2 = await tm.prepare(GenerateReqInput(text="abc", rid="n"))
        agen2 = tm.run(prep2)
        fut = asyncio.ensure_future(agen2.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_str_out(out("n", "a", [1]))
        tm._handle_batch_str_out(out("n", "b", [2], FinishReason.of_stop("c"), completion=2))
        return c1, c2, await fut

    c1, c2, final = run(go())
    assert (c1["text"], c1["output_ids"], c1["meta_info"]["completion_tokens"]) == ("Hello", [5, 6], 2)
    assert (c2["text"], c2["output_ids"], c2["meta_info"]["finish_reason"]) == (
        "!" if incremental else "Hello!",
        [7] if incremental else [5, 6, 7],
        {"type": "length", "length": 3},
    )
    assert final["text"] == "ab" and final["output_ids"] == [1, 2]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": "c"}
    assert tm.rid_to_state == {}


def lp_out(rid: str, ids: list[int], completion: int, reason=None, prompt: bool = False) -> BatchStrOut:
    """``out`` with each token's logprob -id/10 and top 2 [(id, -id/10), (1, -9.0)] (and the
    prompt's with ``prompt``)."""
    o = out(rid, "x" * len(ids), ids, reason, completion)
    o.output_token_logprobs = [[-i / 10 for i in ids]]
    o.output_top_logprobs = [[[(i, -i / 10), (1, -9.0)] for i in ids]]
    if prompt:
        o.input_token_logprobs = [[None, -0.5, -0.6]]
        o.input_top_logprobs = [[None, [(2, -0.5)], [(3, -0.6)]]]
    return o


@pytest.mark.parametrize("incremental", [True, False])
def test_streamed_logprobs_and_what_the_state_keeps_of_them(make_tm, incremental):
    """An incremental stream's chunks carry the logprobs of their new tokens (the prompt's in the
    first chunk), and the request's state forgets them once sent; a stream of the whole output
    so far carries and keeps them all."""
    tm = make_tm(incremental_streaming_output=incremental)

    async def go():
        await tm.start()
        obj = GenerateReqInput(text="abc", rid="s", stream=True, top_logprobs_num=2, logprob_start_len=0)
        agen = tm.run(await tm.prepare(obj))
        chunks, kept = [], []
        steps = [
            ([5, 6], 2, None, True),
            ([7], 3, None, False),
            ([8, 9], 5, FinishReason.of_length(5), False),
        ]
        for ids, n, reason, prompt in steps:
            fut = asyncio.ensure_future(agen.__anext__())
            await asyncio.sleep(0)
            tm._handle_batch_str_out(lp_out("s", ids, n, reason, prompt))
            chunks.append(await fut)
            st = tm.rid_to_state.get("s")
            kept.append(None if st is None else (len(st.out_logprobs), len(st.out_top), len(st.in_logprobs)))
        return chunks, kept

    chunks, kept = run(go())
    metas = [c["meta_info"] for c in chunks]
    if incremental:
        assert [[t for _, t, _ in m["output_token_logprobs"]] for m in metas] == [[5, 6], [7], [8, 9]]
        assert metas[1]["output_top_logprobs"] == [[(-0.7, 7, None), (-9.0, 1, None)]]
        assert "input_token_logprobs" in metas[0] and all("input_token_logprobs" not in m for m in metas[1:])
        assert kept[:2] == [(0, 0, 0), (0, 0, 0)]
    else:
        assert [t for _, t, _ in metas[2]["output_token_logprobs"]] == [5, 6, 7, 8, 9]
        assert all(len(m["input_token_logprobs"]) == 3 for m in metas)
        assert kept[:2] == [(2, 2, 3), (3, 3, 3)]
    assert metas[2]["output_token_logprobs"][-1] == (-0.9, 9, None)


def test_priority_needs_the_flag_and_reaches_the_scheduler_message(make_tm):
    async def go(tm, **kw):
        await tm.start()
        return await tm.prepare(GenerateReqInput(text=["ab", "cd"], **kw))

    with pytest.raises(RequestError, match="--enable-priority-scheduling") as e:
        run(go(make_tm(), priority=3))
    assert e.value.param == "priority" and e.value.status_code == 400
    assert [r.priority for r, _ in run(go(make_tm())).reqs] == [0, 0]
    prep = run(go(make_tm(enable_priority_scheduling=True), priority=[5, -2], sampling_params={"n": 2}))
    assert [r.priority for r, _ in prep.reqs] == [5, 5, -2, -2]
    assert sorted(w.priority for w in prep.warmups) == [-2, 5]  # the shared prefill goes with them
    with pytest.raises(RequestError, match="priority"):
        run(go(make_tm(enable_priority_scheduling=True), priority=[1]))  # one per prompt


def test_leaving_a_stream_early_aborts_the_request(make_tm):
    tm = make_tm()

    async def go():
        await tm.start()
        prep = await tm.prepare(GenerateReqInput(text="abc", rid="gone", stream=True))
        agen = tm.run(prep)
        fut = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_str_out(out("gone", "x", [1]))
        await fut
        await agen.aclose()  # the client went away

    run(go())
    sent = tm.ipc.send_sock.sent
    assert isinstance(sent[0], TokenizedGenerateReqInput)
    assert isinstance(sent[-1], AbortReq) and sent[-1].rid == "gone"
    assert tm.rid_to_state == {}


def test_queue_limit_raises_429_with_retry_after(make_tm):
    tm = make_tm(max_queued_requests=2)

    async def go():
        await tm.start()
        waiting = [tm.run(await tm.prepare(GenerateReqInput(text="abc", rid=f"w{i}"))) for i in range(2)]
        tasks = [asyncio.ensure_future(a.__anext__()) for a in waiting]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError) as e:
            await tm.prepare(GenerateReqInput(text="abc"))
        assert e.value.status_code == 429 and e.value.retry_after >= 1
        tm._handle_batch_str_out(out("w0", "x", [1], FinishReason.of_length(1)))  # frees a slot
        await tasks[0]
        await tm.prepare(GenerateReqInput(text="abc"))
        tasks[1].cancel()

    run(go())


def test_engine_death_fails_in_flight_and_new_requests(make_tm):
    tm = make_tm()

    async def go():
        await tm.start()
        agen = tm.run(await tm.prepare(GenerateReqInput(text="abc")))
        fut = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        tm.on_child_death("scheduler", -9)
        with pytest.raises(EngineDeadError, match="scheduler process died"):
            await fut
        with pytest.raises(EngineDeadError):
            await tm.prepare(GenerateReqInput(text="abc"))

    run(go())
    assert not tm.is_healthy


def test_importing_engine_does_not_import_torch():
    code = "import sys, srt; from srt import Engine; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tokenize_and_detokenize(make_tm):
    tm = make_tm()

    async def go():
        await tm.start()
        return await tm.tokenize(["hi", "abc"])

    assert run(go()) == [[ord("h"), ord("i")], [97, 98, 99]]
    assert tm.detokenize([104, 0, 105]) == "hi"
    assert tm.detokenize([104, 0, 105], skip_special_tokens=False) == "h\x00i"
    for bad in (200, -1):
        with pytest.raises(RequestError, match="outside the vocabulary") as e:
            tm.detokenize([104, bad])
        assert e.value.param == "tokens" and e.value.status_code == 400
    assert tm.ipc.send_sock.sent == []


def test_tokenize_without_a_tokenizer_is_a_400(make_tm):
    tm = make_tm(tokenizer=None, skip_tokenizer_init=True)

    async def go():
        await tm.start()
        with pytest.raises(RequestError, match="skip-tokenizer-init"):
            await tm.tokenize(["hi"])

    run(go())
    with pytest.raises(RequestError, match="skip-tokenizer-init"):
        tm.detokenize([1, 2])


def test_scheduler_load_is_sglangs_shape():
    state = {
        "num_running_reqs": 3,
        "num_queued_reqs": 2,
        "max_total_num_tokens": 1000,
        "available_size": 600,
        "evictable_size": 150,
    }
    assert scheduler_load(state) == {"num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 250, "dp_rank": 0}


def test_control_requests_get_their_replies_in_order(make_tm):
    tm = make_tm()
    state = {
        "num_running_reqs": 1,
        "num_queued_reqs": 0,
        "max_total_num_tokens": 1000,
        "available_size": 990,
        "evictable_size": 0,
    }

    async def go():
        await tm.start()
        load = asyncio.ensure_future(tm.get_load())
        start = asyncio.ensure_future(tm.profile(ProfileReq(action="start", num_steps=3)))
        update1 = asyncio.ensure_future(tm.update_weights_from_disk("/ckpt/a"))
        update2 = asyncio.ensure_future(tm.update_weights_from_disk("/ckpt/b", "gguf"))
        await asyncio.sleep(0)
        sent = list(tm.ipc.send_sock.sent)
        # one weight update at a time: the second is sent once the first was answered
        assert [type(m) for m in sent] == [GetInternalStateReq, ProfileReq, UpdateWeightsFromDiskReq]
        tm.ipc._dispatch(GetInternalStateReqOutput(state=state))
        tm.ipc._dispatch(ProfileReqOutput(success=True, message="ok", trace_path="/t/x.json.gz"))
        tm.ipc._dispatch(UpdateWeightsFromDiskReqOutput(success=True, message="a done"))
        first = await update1
        await asyncio.sleep(0)
        assert tm.ipc.send_sock.sent[-1] == UpdateWeightsFromDiskReq(model_path="/ckpt/b", load_format="gguf")
        tm.ipc._dispatch(UpdateWeightsFromDiskReqOutput(success=False, message="b failed"))
        return await load, await start, first, await update2

    load, start, first, second = run(go())
    assert load == [{"num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 10, "dp_rank": 0}]
    assert start.trace_path == "/t/x.json.gz"
    assert first.message == "a done" and not second.success and second.message == "b failed"


def test_deadline_travels_and_the_backstop_timer_times_the_request_out(make_tm):
    """The scheduler (here: nobody) never reports: the tokenizer manager finishes the request with
    the timeout reason shortly after its deadline and tells the scheduler to drop it."""
    tm = make_tm()

    async def go():
        await tm.start()
        t0 = time.time()
        outs = [o async for o in tm.generate(GenerateReqInput(text="abc", rid="d", timeout=0.2))]
        return t0, time.time(), outs

    t0, t1, outs = run(go())
    (sent, abort) = tm.ipc.send_sock.sent
    assert isinstance(sent, TokenizedGenerateReqInput) and t0 <= sent.arrival_time
    assert sent.deadline == pytest.approx(sent.arrival_time + 0.2)
    assert isinstance(abort, AbortReq) and abort.rid == "d" and abort.status_code == 408
    assert 0.2 <= t1 - t0 < 0.2 + DEADLINE_GRACE_S + 2.0
    (o,) = outs
    assert o["meta_info"]["finish_reason"] == {
        "type": "timeout",
        "message": "request timed out after 0.2 s",
        "status_code": 408,
    }
    assert 'reason="timeout"' in tm.metrics.render(None).decode()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "5"])
def test_bad_timeouts_are_400(make_tm, bad):
    tm = make_tm()

    async def go():
        await tm.start()
        with pytest.raises(RequestError) as e:
            await tm.prepare(GenerateReqInput(text="abc", timeout=bad))
        return e.value

    assert run(go()).param == "timeout"


def test_phase_timings_reach_meta_info_and_abort_all_labels_shutdown(make_tm):
    tm = make_tm()

    async def go():
        await tm.start()
        agen = tm.generate(GenerateReqInput(text="abc", rid="t", stream=True))
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.05)
        o = out("t", "x", [5])
        o.queue_times, o.prefill_times = [0.01], [0.02]
        tm._handle_batch_str_out(o)
        c1 = await first
        done = out("t", "y", [6], FinishReason.of_length(2), completion=2)
        done.decode_times = [0.03]
        tm._handle_batch_str_out(done)
        c2 = await agen.__anext__()
        # a second request, aborted by the drain
        agen2 = tm.generate(GenerateReqInput(text="abc", rid="u"))
        pending = asyncio.ensure_future(agen2.__anext__())
        await asyncio.sleep(0.05)
        assert tm.num_in_flight == 1
        assert tm.abort_all("the server shut down", 503, "shutdown", retry_after=3) == 1
        return c1["meta_info"], c2["meta_info"], (await pending)["meta_info"]

    m1, m2, m3 = run(go())
    assert (m1["queue_time"], m1["prefill_time"], m1["decode_time"]) == (0.01, 0.02, None)
    assert (m2["queue_time"], m2["prefill_time"], m2["decode_time"]) == (0.01, 0.02, 0.03)
    assert 0 < m1["ttft"] == m2["ttft"] <= m2["e2e_latency"]
    assert m3["finish_reason"] == {
        "type": "abort",
        "message": "the server shut down",
        "status_code": 503,
        "retry_after": 3,
    }
    assert m3["ttft"] is None and m3["queue_time"] is None
    assert tm.ipc.send_sock.sent[-1] == AbortReq(rid="u", message="the server shut down", status_code=503)
    assert 'reason="shutdown"' in tm.metrics.render(None).decode()
