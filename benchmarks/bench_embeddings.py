"""Embedding throughput: srt's ``Engine.encode`` against transformers' forward, same inputs.

Protocol (default model unless ``--model-path``; float32 on CPU; fixed seed):
  * inputs: ``--batch`` (64) token-id prompts of lengths drawn uniformly from
    ``[--min-len, --max-len]`` (32..512);
  * srt: ``Engine(is_embedding=True)`` (last-token pooling unless the checkpoint says
    otherwise), one ``encode`` of the whole batch per repeat after one warm-up, the radix cache
    flushed before each repeat (no prefix reuse between repeats);
  * transformers: the base model (``AutoModel`` / the causal LM's ``.model``) in float32 under
    ``torch.inference_mode``, the fairer of two ways: padded batches of ``--hf-batch`` (right
    padding, attention mask, the last real token pooled) or one sequence at a time (no
    padding); one warm-up, then the repeats;
  * figure: prompt tokens per second (sum of the prompt lengths / wall time), the best repeat
    of each; the ratio srt / transformers. Both run in this machine's threads one after the
    other (srt's scheduler process holds the engine; the main process waits).

    python benchmarks/bench_embeddings.py [--batch 64] [--min-len 32] [--max-len 512]
        [--repeats 3] [--quantization none|gguf] [--model-path DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_inputs(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def load_hf(model_path: str | None):
    """The transformers base model (float32, eval) and its vocabulary size."""
    from transformers import AutoModelForCausalLM

    if model_path is None:
        from tests.helpers.hf_reference import load_default_hf_model

        lm = load_default_hf_model()
    else:
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return lm.model, lm.config.vocab_size


@torch.inference_mode()
def hf_padded(model, prompts: list[list[int]], batch: int) -> list[torch.Tensor]:
    out = []
    for b0 in range(0, len(prompts), batch):
        chunk = prompts[b0 : b0 + batch]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        mask = torch.zeros(len(chunk), width, dtype=torch.int64)
        for i, p in enumerate(chunk):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out += [hidden[i, len(p) - 1] for i, p in enumerate(chunk)]
    return out


@torch.inference_mode()
def hf_single(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [model(input_ids=torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]


def best_time(fn, repeats: int) -> tuple[float, object]:
    result = fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run(args: argparse.Namespace) -> dict:
    from srt import Engine

    hf, vocab = load_hf(args.model_path)
    prompts = make_inputs(args.batch, args.min_len, args.max_len, vocab)
    tokens = sum(len(p) for p in prompts)
    t_pad, ref = best_time(lambda: hf_padded(hf, prompts, args.hf_batch), args.repeats)
    t_one, _ = best_time(lambda: hf_single(hf, prompts), args.repeats)
    llm = Engine(
        args.model_path,
        is_embedding=True,
        quantization=args.quantization,
        max_total_tokens=max(16384, 2 * tokens),
        log_level="warning",
    )
    try:

        def srt_once():
            llm.flush_cache()
            return llm.encode(input_ids=prompts, normalize=False)

        t_srt, outs = best_time(srt_once, args.repeats)
    finally:
        llm.shutdown()
    diff = max((torch.tensor(o["embedding"]) - r).abs().max().item() for o, r in zip(outs, ref))
    t_hf = min(t_pad, t_one)
    return {
        "tokens": tokens,
        "batch": args.batch,
        "srt_tok_s": tokens / t_srt,
        "hf_padded_tok_s": tokens / t_pad,
        "hf_single_tok_s": tokens / t_one,
        "hf_best": "padded" if t_pad <= t_one else "single",
        "ratio": t_hf / t_srt,
        "max_abs_diff": diff,
        "quantization": args.quantization,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--hf-batch", type=int, default=16, help="transformers' padded batch size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", default="none", choices=["none", "gguf", "auto"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    r = run(args)
    if args.json:
        print(json.dumps(r))
        return
    print(
        f"{r['batch']} prompts, {r['tokens']} tokens, {r['threads']} threads, srt quantization {r['quantization']}"
    )
    print(f"srt (Engine.encode)        {r['srt_tok_s']:10.0f} tok/s")
    print(f"transformers padded        {r['hf_padded_tok_s']:10.0f} tok/s")
    print(f"transformers per sequence  {r['hf_single_tok_s']:10.0f} tok/s")
    print(
        f"ratio srt / transformers ({r['hf_best']}): {r['ratio']:.2f}x   max |diff| {r['max_abs_diff']:.2e}"
    )


if __name__ == "__main__":
    main()
