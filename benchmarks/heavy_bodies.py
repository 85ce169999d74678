"""Heavy request bodies against one server: what each costs the HTTP process, and that the server
answers it with a short 4xx and goes on serving.

    python benchmarks/heavy_bodies.py                  # on a server it starts (the default model)
    python benchmarks/heavy_bodies.py --url http://h:p --server-pid PID

Each case sends one body built to be expensive rather than large: a body past
--max-request-body-bytes (with a Content-Length and chunked), lists of half a million bad items on
each route family, more sequences than --max-sequences-per-request, 200,000 embedding inputs, a
51 MiB prompt of 8,000,000 token ids, and a batch of 60,000 prompts whose client gives up after 10 s. For each
it prints the status, the seconds to the answer, the HTTP process's CPU seconds and its peak RSS
(VmHWM, which only grows: the case that raised it is the costly one), the response's size, and the
seconds a one-token request then takes. It exits 1 when a case gets another status than expected,
a response over 64 KiB, or the server stops answering.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests
from common import cpu_model, format_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.server import ServerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
MAX_ANSWER = 64 << 10


@dataclass
class Case:
    name: str
    path: str
    body: Callable[[], bytes]
    expect: int
    chunked: bool = False
    give_up_s: float | None = None  # the client closes the connection after this many seconds


def _j(obj: object) -> Callable[[], bytes]:
    return lambda: json.dumps(obj).encode()


def _past_the_bound() -> bytes:
    return b'{"model": "m", "prompt": "' + b"a" * (70 << 20) + b'"}'


def _token_ids() -> bytes:
    rnd = random.Random(0)
    return json.dumps({"input_ids": [rnd.randrange(100, 49000) for _ in range(8_000_000)]}).encode()


def cases() -> list[Case]:
    n, ids = 500_000, [1] * 500_000
    return [
        Case("70 MiB body, Content-Length", "/v1/completions", _past_the_bound, 413),
        Case("70 MiB body, chunked", "/v1/completions", _past_the_bound, 413, chunked=True),
        Case("prompt: 500k token ids, then a string", "/v1/completions", _j({"model": MODEL, "prompt": [*ids, "a"]}), 400),
        Case("messages: 500k empty objects", "/v1/chat/completions", _j({"model": MODEL, "messages": [{}] * n}), 400),
        Case("logit_bias: 500k bad values", "/v1/completions", _j({"model": MODEL, "prompt": "x", "logit_bias": {str(i): "a" for i in range(n)}}), 400),
        Case("tokens: 500k strings", "/detokenize", _j({"tokens": ["a"] * n}), 400),
        Case("input: 500k token ids, then a string", "/v1/embeddings", _j({"model": MODEL, "input": [*ids, "a"]}), 400),
        Case("20,000 prompts x n=128", "/generate", _j({"text": ["hi"] * 20_000, "sampling_params": {"n": 128, "max_new_tokens": 1}}), 400),
        Case("200,000 prompts", "/v1/completions", _j({"model": MODEL, "prompt": ["hi"] * 200_000, "max_tokens": 1}), 400),
        Case("500,000 prompts to tokenize", "/tokenize", _j({"prompt": ["hi"] * n}), 400),
        Case("200,000 embedding inputs", "/v1/embeddings", _j({"model": MODEL, "input": ["hi"] * 200_000}), 400),
        Case("8M token ids (51 MiB)", "/generate", _token_ids, 400),
        Case("60,000 prompts, client gone at 10 s", "/generate", _j({"input_ids": [[1, 2]] * 60_000, "sampling_params": {"max_new_tokens": 1}}), 0, give_up_s=10.0),
    ]  # fmt: skip


def _proc(pid: int) -> tuple[float, int]:
    """(CPU seconds, VmHWM MiB) of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    status = Path(f"/proc/{pid}/status").read_text()
    return (int(fields[11]) + int(fields[12])) / 100, int(status.split("VmHWM:")[1].split()[0]) >> 10


def _send(url: str, case: Case) -> tuple[int, int]:
    """(status, response bytes); status 0 when the client gave up as the case says."""
    body = case.body()
    data = (body[i : i + (1 << 16)] for i in range(0, len(body), 1 << 16)) if case.chunked else body
    try:
        r = requests.post(
            url + case.path,
            data=data,
            headers={"Content-Type": "application/json"},
            timeout=case.give_up_s or 600,
        )
    except requests.Timeout:
        if case.give_up_s is not None:
            return 0, 0
        raise
    return r.status_code, len(r.content)


def _one_token_s(url: str) -> float:
    t = time.monotonic()
    r = requests.post(
        url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}, timeout=600
    )
    r.raise_for_status()
    return time.monotonic() - t


def run(url: str, pid: int) -> int:
    rows, bad = [], []
    for case in cases():
        cpu0, _ = _proc(pid)
        t = time.monotonic()
        try:
            status, size = _send(url, case)
        except requests.RequestException as e:
            status, size = -1, 0
            bad.append(f"{case.name}: {type(e).__name__}")
        took = time.monotonic() - t
        cpu1, peak = _proc(pid)
        next_s = _one_token_s(url)
        rows.append(
            [case.name, case.path, status, f"{took:.2f}", f"{cpu1 - cpu0:.2f}", peak, size, f"{next_s:.2f}"]
        )
        if status != case.expect or size > MAX_ANSWER:
            bad.append(f"{case.name}: status {status} (expected {case.expect}), {size} bytes")
    header = [
        "case",
        "route",
        "status",
        "answer s",
        "HTTP CPU s",
        "HTTP peak MiB",
        "answer bytes",
        "next request s",
    ]
    print(f"CPU: {cpu_model()}")
    print(format_table(header, rows))
    for b in bad:
        print("FAILED", b)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the HTTP process's pid")
    p.add_argument("--server-arg", action="append", default=[], help="an argument of the server it starts")
    args = p.parse_args(argv)
    if args.url:
        if args.server_pid is None:
            p.error("--url needs --server-pid (the HTTP process, whose CPU and memory are read)")
        return run(args.url.rstrip("/"), args.server_pid)
    server = ServerProcess(["--log-level", "warning", *args.server_arg])
    server.start()
    try:
        return run(server.base_url, server.proc.pid)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
