"""Soak test: many hostile requests against one server, then check nothing leaked.

    python benchmarks/soak.py                      # 10,000 requests on a server it starts
    python benchmarks/soak.py --quick              # ~300 requests (CI: tests/integration/test_soak.py)
    python benchmarks/soak.py --url http://h:p     # against a running server
    python benchmarks/soak.py --duration 600       # stop sending after 600 s (or the count)

Protocol (seeded, --seed): start the server (default model; --max-total-tokens and
--max-running-requests small enough that requests queue), touch every KV slot once with long
unique prompts (so RSS measures leaks, not the pool's first writes) and flush the cache; then
send the requests of `soak_workload.make_scenarios` (a mix of routes, streaming, n>1, stop
strings, shared system prompts, client disconnects, /abort_request, deadlines) as a Poisson
stream at --request-rate with at most --max-concurrency in flight, both above the server's
capacity. The server tree's RSS is sampled after the first 10% of the requests and at the end.

Checks (a violation exits 1): every request ended with exactly one well-formed outcome (no
hang past --request-timeout; see soak_workload for "well-formed"); deadline_ok requests did not
time out; once idle the KV pool and the radix cache are back to idle (available + evictable ==
total, protected (locked) size 0, every request row free; after /flush_cache every slot free);
RSS grew at most --max-rss-growth; /health is 200. A summary table goes to stdout
(--result-json also writes the figures). Deadlines need the server's ``timeout`` request field:
a server that rejects it (400) or ignores it is reported and the deadline actions are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soak_workload import Outcome, Scenario, classify_plain, classify_stream, make_scenarios, request_of  # noqa: E402

from tests.helpers.server import ServerProcess  # noqa: E402

# the scheduler counters of speculative decoding, reported when the server speculated
_SPEC_KEYS = ("num_verify_steps", "num_draft_tokens", "num_verify_tokens", "spec_accept_length")


@dataclass
class Run:
    """What the load phase collected."""

    outcomes: dict[int, Outcome] = field(default_factory=dict)
    rss_samples: list[tuple[str, dict[int, int]]] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0
    sent: int = 0


async def _read_stream(resp: aiohttp.ClientResponse, s: Scenario) -> tuple[bytes, bool]:
    """The stream's bytes; with the disconnect action, stop after the first event (False)."""
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        buf.extend(chunk)
        if s.action == "disconnect" and b"\n\n" in buf:
            resp.close()  # the client goes away mid-stream
            return bytes(buf), False
    return bytes(buf), True


async def _one(session: aiohttp.ClientSession, url: str, s: Scenario, timeout_s: float) -> Outcome:
    path, body = request_of(s)

    async def call() -> Outcome:
        async with session.post(url + path, json=body) as resp:
            if s.stream and resp.status == 200:
                raw, complete = await _read_stream(resp, s)
                return classify_stream(s.route, s.n, resp.status, raw, complete)
            return classify_plain(s.route, s.n, resp.status, await resp.read())

    async def abort_later() -> None:
        await asyncio.sleep(s.delay_s)
        async with session.post(url + "/abort_request", json={"rid": s.rid}) as r:
            await r.read()

    aborter = asyncio.create_task(abort_later()) if s.action == "abort" else None
    try:
        if s.action == "disconnect" and not s.stream:
            try:  # closing mid-non-stream: cancel the request after the delay
                return await asyncio.wait_for(call(), s.delay_s)
            except asyncio.TimeoutError:
                return Outcome("disconnected")
        return await asyncio.wait_for(call(), timeout_s)
    except asyncio.TimeoutError:
        return Outcome("lost", f"no outcome within {timeout_s:.0f} s (a hang)")
    except aiohttp.ClientError as e:
        return Outcome("lost", f"connection failed: {e!r}")
    finally:
        if aborter is not None:
            await aborter


def tree_rss(pid: int | None) -> dict[int, int]:
    """RSS in bytes of ``pid`` and of each of its descendants, by pid (empty when unknown)."""
    if pid is None:
        return {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


async def run_load(url: str, scenarios: list[Scenario], args: argparse.Namespace, pid: int | None) -> Run:
    """Poisson arrivals at ``args.request_rate``, at most ``args.max_concurrency`` in flight."""
    run = Run()
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency)
    warm_mark = max(1, len(scenarios) // 10)
    connector = aiohttp.TCPConnector(limit=2 * args.max_concurrency + 8)  # + the abort calls
    deadline = None if args.duration is None else time.monotonic() + args.duration

    async def task(s: Scenario) -> None:
        try:
            run.outcomes[s.idx] = await _one(session, url, s, args.request_timeout)
        finally:
            sem.release()
        done = len(run.outcomes)
        if done % warm_mark == 0 and done < len(scenarios):  # after 10%, 20%, ...
            run.rss_samples.append(("after 10%" if done == warm_mark else f"after {done}", tree_rss(pid)))

    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        run.started = time.monotonic()
        tasks = []
        for s in scenarios:
            if deadline is not None and time.monotonic() > deadline:
                break
            await asyncio.sleep(rng.expovariate(args.request_rate) if args.request_rate > 0 else 0)
            await sem.acquire()
            tasks.append(asyncio.create_task(task(s)))
        run.sent = len(tasks)
        await asyncio.gather(*tasks)
        run.finished = time.monotonic()
    return run


# ------------------------------------------------------------------ before and after the load
def _get(url: str, path: str, timeout: float = 60) -> Any:
    import requests

    r = requests.get(url + path, timeout=timeout)
    r.raise_for_status()
    return r.json() if r.content else None


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 300) -> Any:
    import requests

    return requests.post(url + path, json=body, timeout=timeout)


def scheduler_state(url: str) -> dict[str, Any]:
    return _get(url, "/get_server_info")["internal_states"][0]


def warm_up(url: str, seed: int) -> int:
    """Touch every KV slot once (long unique prompts, one token each, kept by the cache), then
    flush. The prompts are one prefill chunk long, so the largest extend batch (the activation
    peak the allocator keeps) is reached too. Returns the pool size."""
    info = _get(url, "/get_server_info")
    state = info["internal_states"][0]
    total, context = int(state["max_total_num_tokens"]), int(state["context_len"])
    chunk_size = int(info.get("chunked_prefill_size") or -1)
    chunk = min(chunk_size if chunk_size > 0 else 2048, context - 16, total - 16)
    rng = random.Random(seed + 2)
    written = 0
    while written < total:
        ids = [rng.randrange(1000, 20000) for _ in range(chunk)]
        r = _post(url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
        r.raise_for_status()
        written += chunk
    _post(url, "/flush_cache", {}).raise_for_status()
    return total


def probe_deadlines(url: str) -> str:
    """'supported' (a tiny timeout gives 408), 'rejected' (400: the server lacks the field) or
    'ignored' (200)."""
    body = {"text": "Count to one hundred:", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    r = _post(url, "/generate", {**body, "timeout": 0.001})
    if r.status_code == 408:
        return "supported"
    return "rejected" if r.status_code == 400 else f"ignored (status {r.status_code})"


def wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    state = scheduler_state(url)
    while (state["num_running_reqs"] or state["num_queued_reqs"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        state = scheduler_state(url)
    return state


def check_idle(url: str) -> tuple[dict[str, Any], list[str]]:
    """The pool, locks and request rows back to idle (and after a flush, every slot free)."""
    problems: list[str] = []
    s = wait_idle(url)
    total = s["max_total_num_tokens"]
    if s["num_running_reqs"] or s["num_queued_reqs"]:
        problems.append(f"not idle: {s['num_running_reqs']} running, {s['num_queued_reqs']} queued")
    if s["available_size"] + s["evictable_size"] != total:
        problems.append(f"KV: available {s['available_size']} + evictable {s['evictable_size']} != {total}")
    if s["protected_size"] != 0:
        problems.append(f"radix cache: {s['protected_size']} tokens still locked")
    if "free_req_rows" in s and s["free_req_rows"] != s["req_rows"]:
        problems.append(f"request rows: {s['free_req_rows']} free of {s['req_rows']}")
    flushed = _post(url, "/flush_cache", {})
    after = scheduler_state(url)
    if flushed.status_code != 200 or after["available_size"] != total:
        problems.append(
            f"after flush: status {flushed.status_code}, {after['available_size']} of {total} free"
        )
    try:
        import requests

        health = requests.get(url + "/health", timeout=30).status_code
    except Exception as e:  # noqa: BLE001 - reported as a violation
        health = repr(e)
    if health != 200:
        problems.append(f"/health: {health}")
    return s, problems


# ------------------------------------------------------------------ report
def evaluate(run: Run, scenarios: list[Scenario]) -> tuple[list[str], Counter, Counter]:
    """Violations, outcome kinds, and (action, kind) pairs."""
    sent = scenarios[: run.sent]
    violations = []
    kinds: Counter = Counter()
    by_action: Counter = Counter()
    for s in sent:
        o = run.outcomes.get(s.idx)
        if o is None:
            violations.append(f"#{s.idx} ({s.route}, {s.action}): no outcome")
            continue
        kinds[o.kind] += 1
        by_action[(s.action, o.kind)] += 1
        if o.violation is not None:
            violations.append(f"#{s.idx} ({s.route}, stream={s.stream}, n={s.n}, {s.action}): {o.violation}")
        elif s.action == "deadline_ok" and o.kind == "timeout":
            violations.append(f"#{s.idx}: timed out with a 120 s deadline")
        elif s.action == "normal" and o.kind in ("disconnected", "aborted", "timeout"):
            violations.append(f"#{s.idx} ({s.route}, normal): unexpected outcome {o.kind}")
    if len(run.outcomes) != run.sent:
        violations.append(f"{len(run.outcomes)} outcomes for {run.sent} requests")
    return violations, kinds, by_action


def print_table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    print("=" * (width + 24))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("=" * (width + 24))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--quick", action="store_true", help="300 requests (CI)")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="of the server it starts")
    p.add_argument("--max-running-requests", type=int, default=32, help="of the server it starts")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the server it starts")
    p.add_argument("--request-rate", type=float, default=100.0, help="offered requests/s (0: all at once)")
    p.add_argument("--max-concurrency", type=int, default=96)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request is lost")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = 300
    return args


def soak(args: argparse.Namespace, url: str, pid: int | None) -> int:
    pool = warm_up(url, args.seed)
    deadlines = probe_deadlines(url)
    scenarios = make_scenarios(args.num_requests, args.seed, deadlines=deadlines == "supported")
    run = asyncio.run(run_load(url, scenarios, args, pid))
    state, idle_problems = check_idle(url)
    run.rss_samples.append(("end", tree_rss(pid)))
    violations, kinds, by_action = evaluate(run, scenarios)
    violations += idle_problems
    by_proc = dict(run.rss_samples)
    rss = {k: sum(v.values()) for k, v in by_proc.items()}
    growth = None
    if rss.get("after 10%") and rss.get("end"):
        growth = rss["end"] / rss["after 10%"] - 1
        if growth > args.max_rss_growth:
            violations.append(f"RSS grew {growth:.1%} after warm-up (limit {args.max_rss_growth:.0%})")
    duration = run.finished - run.started
    actions = Counter(s.action for s in scenarios[: run.sent])
    rows: list[tuple[str, Any]] = [
        ("requests", run.sent),
        ("duration (s)", round(duration, 1)),
        ("requests/s", round(run.sent / duration, 2) if duration else None),
        ("deadlines", deadlines),
        ("KV pool (tokens)", pool),
        ("actions", dict(sorted(actions.items()))),
        ("outcomes", dict(sorted(kinds.items()))),
        *((f"  {a}", {k: v for (a2, k), v in sorted(by_action.items()) if a2 == a}) for a in sorted(actions)),
        ("generated tokens (server)", state.get("num_generated_tokens")),
        ("server aborts counted", state.get("num_aborted")),
        ("cache hit rate", round(state.get("cache_hit_rate", 0.0), 3)),
        *(
            [("speculative (server)", {k: state.get(k) for k in _SPEC_KEYS})]
            if state.get("num_verify_steps")
            else []
        ),
        ("RSS after 10% (MiB)", round(rss.get("after 10%", 0) / 2**20, 1)),
        ("RSS at end (MiB)", round(rss.get("end", 0) / 2**20, 1)),
        ("RSS growth", None if growth is None else f"{growth:+.2%}"),
        ("RSS trajectory (MiB)", [round(v / 2**20) for v in rss.values()]),
        (
            "RSS by pid (MiB)",
            {k: [round(x / 2**20, 1) for x in by_proc.get(k, {}).values()] for k in ("after 10%", "end")},
        ),
        ("idle check", "ok" if not idle_problems else "; ".join(idle_problems)),
        ("violations", len(violations)),
    ]
    print_table(rows)
    for v in violations[:20]:
        print("VIOLATION", v)
    if args.result_json:
        result = {k.strip(): v for k, v in rows}
        result["violation_list"] = violations
        Path(args.result_json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        return soak(args, args.url.rstrip("/"), args.server_pid)
    server_args = [
        "--max-total-tokens", str(args.max_total_tokens),
        "--max-running-requests", str(args.max_running_requests),
        "--log-level", "warning",
        *args.server_arg,
    ]  # fmt: skip
    server = ServerProcess(server_args)
    server.start()
    try:
        code = soak(args, server.base_url, server.proc.pid)
    finally:
        exit_code = server.stop()
        if exit_code not in (0, None):
            print(f"server exited with code {exit_code}:\n{server.log_tail(40)}")
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
