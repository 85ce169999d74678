"""Online serving benchmark: ``python -m srt.bench_serving`` (SGLang's flags and result block).

Protocol. The workload (``--dataset-name``, fixed by ``--seed``) is built and measured with the
benchmark tokenizer; ``--warmup-requests`` requests run first (outputs capped at 16 tokens) and
are not counted; ``--flush-cache`` then empties the server's prefix cache. Requests arrive as a
Poisson process of rate ``--request-rate`` (``inf``: all at t=0), at most ``--max-concurrency``
in flight. Each is streamed, greedy, with ``ignore_eos`` (unless ``--disable-ignore-eos``). Times
come from ``time.perf_counter`` at chunk arrival on the client. The benchmark duration runs from
the first send to the last completion. Failed requests are counted, their first errors printed,
and they take no part in the latency and throughput figures.

Example::

    python -m srt.launch_server --port 30000 &
    python -m srt.bench_serving --backend srt --port 30000 --dataset-name random \\
        --num-prompts 64 --random-input-len 512 --random-output-len 256 \\
        --random-range-ratio 0.0625 --max-concurrency 8 --plot /tmp/c8.png

``--dataset-name image``: SGLang's image dataset, for chat and /generate backends
(srt/bench_serving_images.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import aiohttp
import numpy as np

from srt import bench_serving_images as images
from srt.benchmark.backends import AIOHTTP_TIMEOUT, BACKENDS, RequestInput
from srt.benchmark.datasets import DatasetRow, get_dataset
from srt.benchmark.metrics import (
    BenchmarkMetrics,
    RequestOutput,
    calculate_metrics,
    format_result_block,
)
from srt.benchmark.tokenizer import load_tokenizer

WARMUP_OUTPUT_LEN = 16
DETAIL_FIELDS = ("success", "error", "prompt_len", "output_len", "ttft", "latency", "itl")  # --output-details

_Send = Callable[[RequestInput], Awaitable[RequestOutput]]  # one request over the run's session


def poisson_arrival_times(rng: np.random.Generator, n: int, request_rate: float) -> list[float]:
    """Send offsets (s) of n requests: the first at 0, then exponential gaps of mean 1/rate.

    ``request_rate`` inf (or <= 0 is rejected) gives all zeros: every request at once."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / request_rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass(slots=True)
class BenchResult:
    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]
    start_time: float
    errors: list[str]


def first_errors(outputs: Sequence[RequestOutput], limit: int = 3) -> list[str]:
    """Up to ``limit`` distinct error messages, in request order."""
    seen: list[str] = []
    for o in outputs:
        if not o.success and o.error not in seen:
            seen.append(o.error)
            if len(seen) == limit:
                break
    return seen


async def _post_json(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    try:
        async with session.post(url) as resp:
            return resp.status, await resp.text()
    except aiohttp.ClientError as e:
        return -1, str(e)


async def resolve_model(session: aiohttp.ClientSession, base_url: str, model: str | None) -> str:
    """--model, else the first id of GET /v1/models, else "default"."""
    if model:
        return model
    try:
        async with session.get(base_url + "/v1/models") as resp:
            if resp.status == 200:
                data = (await resp.json(content_type=None)).get("data") or []
                if data:
                    return str(data[0]["id"])
    except (aiohttp.ClientError, ValueError, KeyError):
        pass
    return "default"


async def benchmark(
    rows: Sequence[DatasetRow],
    *,
    backend: str,
    base_url: str,
    model: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 1,
    ignore_eos: bool = True,
    stream: bool = True,
    warmup_requests: int = 1,
    flush_cache: bool = False,
    extra_body: dict | None = None,
    disable_tqdm: bool = True,
    tokenizer=None,
) -> BenchResult:
    """Run one benchmark of ``rows`` against ``base_url``; see the module docstring."""
    request_func, endpoint = BACKENDS[backend]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=connector) as session:
        model_id = await resolve_model(session, base_url, model)
        make_input = _input_factory(base_url.rstrip("/") + endpoint, model_id, ignore_eos, stream, extra_body)

        async def send(inp: RequestInput) -> RequestOutput:
            return await request_func(session, inp)

        await _warmup(send, make_input, rows, warmup_requests)
        if flush_cache:
            status, body = await _post_json(session, base_url.rstrip("/") + "/flush_cache")
            if status != 200:
                print(f"warning: POST /flush_cache answered {status}: {body[:200]}", file=sys.stderr)
        # a stream of its own: the dataset drew from default_rng(seed), and reusing those bits
        # would tie each request's arrival gap to its lengths
        arrivals = poisson_arrival_times(np.random.default_rng([seed, 1]), len(rows), request_rate)
        start, outputs = await _send_all(send, make_input, rows, arrivals, max_concurrency, disable_tqdm)
    return _bench_result(outputs, start, tokenizer)


def _input_factory(
    api_url: str, model_id: str, ignore_eos: bool, stream: bool, extra_body: dict | None
) -> Callable[..., RequestInput]:
    """``make_input(row, output_len=None)``: the request of ``row`` (its own output length by default)."""

    def make_input(row: DatasetRow, output_len: int | None = None) -> RequestInput:
        inp = RequestInput(
            prompt=row.prompt,
            prompt_len=row.prompt_len,
            output_len=output_len if output_len is not None else row.output_len,
            api_url=api_url,
            model=model_id,
            prompt_ids=row.prompt_ids,
            ignore_eos=ignore_eos,
            stream=stream,
            extra_body=dict(extra_body or {}),
        )
        if isinstance(row, images.ImageRow):  # images in the body, as api_url's endpoint takes them
            inp.prompt = images.add_images(inp.extra_body, row, api_url)
        return inp

    return make_input


def _unshared(row: DatasetRow, i: int) -> DatasetRow:
    """``row`` with a different first token (token ids), first image or a prefix (text): no shared prefix."""
    if isinstance(row, images.ImageRow):
        return images.unshared_image_row(row, i)
    if row.prompt_ids:
        first = row.prompt_ids[0]
        ids = [first + 1 if first < max(row.prompt_ids) or first == 0 else first - 1, *row.prompt_ids[1:]]
        return dataclasses.replace(row, prompt_ids=ids)
    return dataclasses.replace(row, prompt=f"Warm-up {i}. {row.prompt}")


async def _warmup(
    send: _Send, make_input: Callable[..., RequestInput], rows: Sequence[DatasetRow], n: int
) -> None:
    """``n`` uncounted requests (outputs capped at WARMUP_OUTPUT_LEN); any failure aborts the run.
    Each is a measured prompt with its first token changed: the same shape of work, but nothing a
    prefix cache could serve to the measured request later (a warm-up on the measured prompt itself
    made one of them a cache hit, on every server alike)."""
    if n <= 0 or not rows:
        return
    warm = [
        make_input(_unshared(rows[i % len(rows)], i), min(WARMUP_OUTPUT_LEN, rows[i % len(rows)].output_len))
        for i in range(n)
    ]
    results = await asyncio.gather(*(send(w) for w in warm))
    bad = [r for r in results if not r.success]
    if bad:
        raise RuntimeError(f"warmup failed ({len(bad)}/{len(results)}): {bad[0].error}")


async def _send_all(
    send: _Send,
    make_input: Callable[..., RequestInput],
    rows: Sequence[DatasetRow],
    arrivals: Sequence[float],
    max_concurrency: int | None,
    disable_tqdm: bool,
) -> tuple[float, list[RequestOutput]]:
    """Send row i at ``start + arrivals[i]``, at most ``max_concurrency`` in flight; ``(start, outputs)``."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = None
    if not disable_tqdm:
        from tqdm.asyncio import tqdm

        pbar = tqdm(total=len(rows))

    async def one(row: DatasetRow, offset: float, t0: float) -> RequestOutput:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if semaphore is None:
            out = await send(make_input(row))
        else:
            async with semaphore:
                out = await send(make_input(row))
        if pbar is not None:
            pbar.update(1)
        return out

    start = time.perf_counter()
    outputs = list(await asyncio.gather(*(one(r, a, start) for r, a in zip(rows, arrivals))))
    if pbar is not None:
        pbar.close()
    return start, outputs


def _bench_result(outputs: list[RequestOutput], start: float, tokenizer) -> BenchResult:
    """Metrics over the first send .. last completion; with a tokenizer, output lengths are counted by
    re-tokenizing the text (and fill in a successful request's missing count)."""
    first_send = min((o.send_time for o in outputs), default=start)
    last_end = max((o.end_time for o in outputs), default=start)
    duration = max(last_end - first_send, 1e-9)
    retok = None
    if tokenizer is not None:
        retok = [len(tokenizer.encode(o.generated_text, add_special_tokens=False)) for o in outputs]
        for o, n in zip(outputs, retok):
            if o.success and o.output_len == 0:
                o.output_len = n
    metrics = calculate_metrics(outputs, duration, retok)
    return BenchResult(metrics, outputs, first_send, first_errors(outputs))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m srt.bench_serving", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--backend", default="srt", choices=sorted(BACKENDS), help="API to benchmark.")
    a("--base-url", default=None, help="Server URL (overrides --host/--port), e.g. http://127.0.0.1:30000.")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--model", default=None, help="Model name for OpenAI APIs (default: first of GET /v1/models).")
    a(
        "--tokenizer",
        default=None,
        help="Tokenizer dir, hub name or .gguf file (default: the default model's).",
    )
    a(
        "--dataset-name",
        default="random",
        choices=["random", "random-ids", "sharegpt", "generated-shared-prefix", "jsonl", "image"],
    )
    a(
        "--dataset-path",
        default=None,
        help="Local ShareGPT JSON (sharegpt; optional text source for random); for jsonl a file of "
        '{"prompt": ..., "output_len": ...} lines, taken in order.',
    )
    a("--num-prompts", type=int, default=1000)
    a("--sharegpt-output-len", type=int, default=None, help="Fixed output length for sharegpt rows.")
    a("--sharegpt-context-len", type=int, default=None, help="Drop sharegpt rows longer than this.")
    a("--random-input-len", type=int, default=1024, help="Longest prompt (random, random-ids, image).")
    a("--random-output-len", type=int, default=1024, help="Longest output (random, random-ids, image).")
    a(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths are uniform in [max(1, int(L * ratio)), L].",
    )
    images.add_image_args(a)
    a("--gsp-num-groups", type=int, default=64)
    a("--gsp-prompts-per-group", type=int, default=16)
    a("--gsp-system-prompt-len", type=int, default=2048)
    a("--gsp-question-len", type=int, default=128)
    a("--gsp-output-len", type=int, default=256)
    a("--request-rate", type=float, default=math.inf, help="Poisson arrival rate (req/s); inf: all at once.")
    a("--max-concurrency", type=int, default=None, help="At most this many requests in flight.")
    a("--seed", type=int, default=1)
    a("--disable-ignore-eos", action="store_true", help="Let requests stop at EOS.")
    a("--disable-stream", action="store_true", help="Non-streamed requests (TTFT = E2E).")
    a("--apply-chat-template", action="store_true", help="Wrap prompts in the tokenizer's chat template.")
    a("--extra-request-body", default=None, help="JSON object merged into every request body.")
    a("--warmup-requests", type=int, default=1)
    a("--flush-cache", action="store_true", help="POST /flush_cache after the warmup.")
    a("--output-file", default=None, help="Append one JSON line with the run's settings and metrics.")
    a("--output-details", action="store_true", help="Include per-request figures in the JSON line.")
    a("--disable-tqdm", action="store_true")
    a("--plot", default=None, metavar="FILE.png", help="Save CDFs of TTFT/ITL/E2E and throughput over time.")
    return p


def _json_line(args: argparse.Namespace, res: BenchResult, rows: Sequence[DatasetRow]) -> dict:
    rec: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **{k: v for k, v in vars(args).items() if k not in ("output_file",)},
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        **res.metrics.to_dict(),
        "errors": res.errors,
    }
    if (summary := images.image_summary(rows)) is not None:
        rec["images"] = summary
    if args.output_details:
        rec["details"] = [{k: getattr(o, k) for k in DETAIL_FIELDS} for o in res.outputs]
    return rec


def load_rows(args: argparse.Namespace, tokenizer) -> list[DatasetRow]:
    """The workload of the parsed flags; with --apply-chat-template, text prompts wrapped in the
    tokenizer's chat template (image rows render it themselves). Prints its size."""
    load = images.image_workload if args.dataset_name == "image" else get_dataset  # (args, tokenizer, rng)
    rows: list[DatasetRow] = load(args, tokenizer, np.random.default_rng(args.seed))
    for r in rows if args.apply_chat_template else []:
        if not isinstance(r, images.ImageRow):
            r.prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": r.prompt}], tokenize=False, add_generation_prompt=True
            )
            r.prompt_len = len(tokenizer.encode(r.prompt, add_special_tokens=False))
            r.prompt_ids = None
    print(
        f"#Requests: {len(rows)}  #Input tokens: {sum(r.prompt_len for r in rows)}  "
        f"#Output tokens: {sum(r.output_len for r in rows)}" + images.count_line(rows, args.image_content)
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    extra = json.loads(args.extra_request_body) if args.extra_request_body else None
    tokenizer = load_tokenizer(args.tokenizer)
    rows = load_rows(args, tokenizer)
    res = asyncio.run(
        benchmark(
            rows,
            backend=args.backend,
            base_url=base_url,
            model=args.model,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            ignore_eos=not args.disable_ignore_eos,
            stream=not args.disable_stream,
            warmup_requests=args.warmup_requests,
            flush_cache=args.flush_cache,
            extra_body=extra,
            disable_tqdm=args.disable_tqdm,
            tokenizer=tokenizer,
        )
    )
    block = format_result_block(res.metrics, args.backend, args.request_rate, args.max_concurrency)
    print(images.add_image_section(block, rows, args.image_content))
    if res.errors:
        print(f"{res.metrics.failed} request(s) failed; first errors:")
        for e in res.errors:
            print(f"  - {e}")
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(_json_line(args, res, rows)) + "\n")
    if args.plot:
        from srt.benchmark.plot import plot_results

        conc = args.max_concurrency if args.max_concurrency is not None else "unbounded"
        title = (
            f"{args.backend} {args.dataset_name}: {len(rows)} requests, concurrency {conc}, "
            f"rate {args.request_rate}, {res.metrics.output_throughput:.1f} output tok/s"
        )
        plot_results(res.outputs, res.start_time, res.metrics.duration_s, args.plot, title)
        print(f"plot saved to {args.plot}")
    return 0 if res.metrics.completed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
