"""A prefill with its last layer on the rows the step reads, against the same prefill with every
row through that layer, alternated in one process.

``LogitsProcessor.rows_read`` names the rows an EXTEND step reads (each sequence's last); the
decoder's last layer takes only those past its attention (``LlamaModel.forward``'s
``keep_rows``). For the "every row" side ``rows_read`` is patched to return None, which is what
a step reading prompt logprobs gets. Same runner, weights and KV slots for both sides.

Protocol: bench_forward.py's flags and runner (``--model-path DIR --load-format dummy`` for a
shape, ``--prefill-len N``); one warm-up of each side, then ``--rounds`` rounds, each timing both
sides (best of ``--repeats``) in alternating order. Prints the logits' largest difference and
each round's ms, then the median of the rounds' ratios (every row / kept rows); with a model of
L layers whose step is mostly linear layers, about 1 + 1/L is what the skipped work allows.

    python benchmarks/bench_prefill_rows.py --model-path <dir> --load-format dummy --prefill-len 512
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_forward import build_runner, parse_args  # noqa: E402
from srt.layers.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from srt.layers.logits_processor import LogitsProcessor  # noqa: E402


def _take(argv: list[str], flag: str, default: int) -> tuple[int, list[str]]:
    """``flag N`` out of ``argv`` (bench_forward's parser does not know it)."""
    if flag not in argv:
        return default, argv
    i = argv.index(flag)
    return int(argv[i + 1]), argv[:i] + argv[i + 2 :]


def main(argv: list[str]) -> None:
    rounds, argv = _take(argv, "--rounds", 6)
    args = parse_args(argv)
    runner, _ = build_runner(args, [1])
    n = args.prefill_len
    rows = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [n], [-1])
    runner.req_to_token_pool.req_to_token[rows[0], :n] = loc
    ids = [(13 * i + 5) % runner.model_config.vocab_size for i in range(n)]
    kept_rows = LogitsProcessor.rows_read

    def run(keep: bool) -> tuple[float, torch.Tensor]:
        LogitsProcessor.rows_read = kept_rows if keep else (lambda self, fb: None)
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0], [n], loc, runner.device)
        t = time.perf_counter()
        out = runner.forward(fb)
        return (time.perf_counter() - t) * 1e3, out.next_token_logits

    with torch.inference_mode():
        kept, every = run(True)[1], run(False)[1]
        diff = (kept - every).abs().max().item()
        same = bool((kept.argmax(-1) == every.argmax(-1)).all())
        print(
            f"logits: max |difference| {diff:.3g} (max |logit| {every.abs().max().item():.3g}), argmax equal: {same}"
        )
        ratios = []
        for r in range(rounds):
            ms = {}
            for keep in (True, False) if r % 2 == 0 else (False, True):
                ms[keep] = min(run(keep)[0] for _ in range(max(1, args.repeats // 2)))
            ratios.append(ms[False] / ms[True])
            print(
                f"round {r}: kept rows {ms[True]:.1f} ms, every row {ms[False]:.1f} ms, ratio {ratios[-1]:.3f}"
            )
    layers = runner.model_config.hf_config.num_hidden_layers
    print(
        f"prefill {n}: every row / kept rows, median of {rounds} rounds: {statistics.median(ratios):.3f} "
        f"(1 + 1/layers = {1 + 1 / layers:.3f})"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
