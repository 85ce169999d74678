"""--stream-interval and --enable-priority-scheduling on the real scheduler with the KV-checking
fake model (tests/helpers/scheduler_fakes.py): how often a streaming request's tokens are sent,
what text the detokenizer makes of them, and the order in which prioritized requests run."""

from __future__ import annotations

import pytest

from srt.managers.detokenizer.detokenizer_manager import DetokenizerManager
from srt.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.managers.scheduler.schedule_policy import MAX_MATCHED_QUEUE
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.helpers.scheduler_fakes import KVEchoRunner, reference_generate


def make_scheduler(max_running: int = 8, **kw) -> Scheduler:
    args = ServerArgs(
        device="cpu", enable_debug_checks=True, max_running_requests=max_running, **kw
    ).resolve()
    return Scheduler(args, KVEchoRunner(max_total_tokens=2048, page_size=1, max_running_requests=max_running))


def gen(rid: str, prompt: list[int], max_new: int, stream: bool = True, priority: int = 0):
    return TokenizedGenerateReqInput(
        rid=rid,
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True),
        stream=stream,
        priority=priority,
    )


def prompt(seed: int, n: int = 12) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 997 for i in range(n)]


def per_rid(outs: list[BatchTokenIDOut]) -> dict[str, list[list[int]]]:
    """rid -> the token groups sent for it, one per output it appeared in."""
    got: dict[str, list[list[int]]] = {}
    for o in outs:
        for rid, ids in zip(o.rids, o.output_ids):
            got.setdefault(rid, []).append(list(ids))
    return got


@pytest.mark.parametrize("interval", [1, 4, 5])
def test_stream_interval_groups_a_streams_tokens(interval):
    s = make_scheduler(stream_interval=interval)
    s.handle_message(gen("streamed", prompt(1), 16))
    s.handle_message(gen("plain", prompt(2), 16, stream=False))
    groups = per_rid(s.run_until_idle())
    want = reference_generate(prompt(1), 16)
    assert [t for g in groups["streamed"] for t in g] == want
    # the first token at once, then groups of `interval`, the rest with the finish
    assert groups["streamed"][0] == want[:1]
    assert all(len(g) == interval for g in groups["streamed"][1:-1])
    assert len(groups["streamed"]) == 1 + -(-15 // interval)
    # a non-streaming request still sends every step (its stop strings are looked for)
    assert [len(g) for g in groups["plain"]] == [1] * 16


def test_stream_interval_keeps_the_text(tmp_path):
    """The detokenized text of a stream sent 4 tokens at a time equals the one sent token by token."""
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    tokenizer = load_tokenizer(tokenizer_source(ServerArgs()))
    texts, counts = {}, {}
    for interval in (1, 4):
        s = make_scheduler(stream_interval=interval)
        s.handle_message(gen("r", prompt(3), 24))
        detok = DetokenizerManager(tokenizer)
        pieces = []
        for out in s.run_until_idle():
            str_out, _ = detok.handle_batch_token_id_out(out)
            if str_out is not None:
                pieces.append(str_out.output_strs[0])
        texts[interval], counts[interval] = "".join(pieces), len(pieces)
    assert texts[4] == texts[1] and texts[1]
    assert counts[1] == 24 and counts[4] == 1 + -(-23 // 4)  # about len / 4


def test_priority_scheduling_orders_the_waiting_queue():
    """With --enable-priority-scheduling, of the requests waiting together the highest priority
    runs first (ties by arrival); a running request is not preempted."""
    s = make_scheduler(max_running=1, enable_priority_scheduling=True)
    assert s.policy.policy == "priority"
    s.handle_message(gen("first", prompt(0), 4))
    s.step()  # "first" is running
    for i, (rid, pri) in enumerate((("low", -1), ("mid-a", 2), ("high", 7), ("mid-b", 2), ("zero", 0))):
        s.handle_message(gen(rid, prompt(10 + i), 4, priority=pri))
    order: list[str] = []
    for out in s.run_until_idle():
        for rid, reason in zip(out.rids, out.finished_reasons):
            if reason is not None:
                order.append(rid)
    assert order == ["first", "high", "mid-a", "mid-b", "zero", "low"]


def test_without_the_flag_priority_is_ignored_and_the_shortest_prompt_goes_first():
    """The default order (spf): fewest prompt tokens first, then arrival; a priority is not read."""
    s = make_scheduler(max_running=1)
    assert s.policy.policy == "spf"
    s.handle_message(gen("a", prompt(1), 2, priority=0))
    s.handle_message(gen("b", prompt(2), 2, priority=9))
    s.handle_message(gen("c", prompt(3, n=4), 2, priority=0))
    order = [rid for o in s.run_until_idle() for rid, r in zip(o.rids, o.finished_reasons) if r is not None]
    assert order == ["c", "a", "b"]


def test_grammar_backend_none_serves_without_a_grammar_part():
    """--grammar-backend none: no grammar part (its creation used to fail on the missing manager),
    requests run as usual."""
    s = make_scheduler(grammar_backend="none")
    assert s.grammars is None
    s.handle_message(gen("r", prompt(3), 8))
    assert [t for g in per_rid(s.run_until_idle())["r"] for t in g] == reference_generate(prompt(3), 8)


@pytest.mark.parametrize("policy", ["spf", "priority"])
def test_a_queue_too_long_to_sort_is_read_in_policy_order(policy):
    """Past MAX_MATCHED_QUEUE waiting, admission reads the head of the indexed queue
    (waiting_queue.py) instead of sorting it: the shortest prompts (spf) or the highest priorities
    (ties by arrival) still run first, and every request is served exactly."""
    n = MAX_MATCHED_QUEUE + 72
    s = make_scheduler(max_running=4, enable_priority_scheduling=policy == "priority")
    lens = [4 + (i * 37) % 61 for i in range(n)]
    prios = [(i * 13) % 7 for i in range(n)]
    for i in range(n):
        s.handle_message(gen(f"r{i}", prompt(i, lens[i]), 2, priority=prios[i]))
    assert len(s.waiting_queue) == n
    order, tokens = [], per_rid([])
    for out in s.run_until_idle():
        for rid, ids, reason in zip(out.rids, out.output_ids, out.finished_reasons):
            tokens.setdefault(rid, []).append(list(ids))
            if reason is not None:
                order.append(int(rid[1:]))
    assert sorted(order) == list(range(n))
    for i in range(n):
        assert [t for g in tokens[f"r{i}"] for t in g] == reference_generate(prompt(i, lens[i]), 2)
    if policy == "priority":  # no aging: the whole order is fixed at arrival
        assert order == sorted(range(n), key=lambda i: (-prios[i], i))
    else:  # the first admission step takes the 4 fewest tokens (ties by arrival)
        assert sorted(order[:4]) == sorted(range(n), key=lambda i: (lens[i], i))[:4]
