"""Margins of the suite's float32 tolerances (tests/helpers/tolerance.py), measured on this CPU.

1. Runs the model-level comparisons (srt against transformers, batches against sequences alone,
   TP=2 against TP=1 where listed) under every ``SRT_CPU_ISA`` this CPU runs, logging every
   ``assert_reordered_close`` (``SRT_TOLERANCE_LOG``), and prints the largest error of each test in
   units of ``EPS32 * max|ref| * sqrt(k)``: the tolerance ``REORDER_C`` should be at least 10x the
   largest.
2. Breaks one fp16 block scale of the default model's GGUF (a copy; transformers reads the
   original) and prints how far the logits then move, as a multiple of the tolerance: a real
   defect should give at least 100x.

    python benchmarks/tolerance_margins.py [--isas avx512,avx2,scalar] [--skip-runs]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

MODEL_TESTS = [
    "tests/unit/test_models_forward.py",
    "tests/unit/test_models_gemma.py",
    "tests/unit/test_models_moe.py",
    "tests/unit/test_models_phi3.py",
    "tests/unit/test_moe.py",
    "tests/unit/test_layers.py",
    "tests/unit/test_rope_scaling.py",
]
BROKEN = "broken scale"  # the ``what`` of test_a_broken_dequantization_scale_fails_the_logit_tolerance
# (tensor, block, factor): one block's scale multiplied (Q4_1 layers, the Q8_0 tied embedding)
MUTATIONS = [
    ("blk.0.ffn_down.weight", 0, 2.0),
    ("blk.10.attn_q.weight", 100, 2.0),
    ("blk.29.ffn_down.weight", 5, 2.0),
    ("blk.0.attn_v.weight", 0, 1.1),
    ("blk.15.ffn_up.weight", 777, 1.1),
    ("token_embd.weight", 9690 * 18, 2.0),  # a row of a token in the prompt
]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def run_isa(isa: str, log: str) -> str:
    env = dict(os.environ, SRT_CPU_ISA=isa, SRT_TOLERANCE_LOG=log)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODEL_TESTS]
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    return res.stdout.strip().splitlines()[-1] if res.stdout.strip() else f"rc {res.returncode}"


def summarize(log: str, c: float) -> float:
    """Prints each test's largest error in units and returns the largest overall; a comparison
    made at another constant (logprobs: 2 * C, since a logprob carries twice the logits' error)
    is scaled to C's."""
    rows = [json.loads(line) for line in open(log)]
    rows = [r for r in rows if r["what"] != BROKEN]  # the mutation test's comparison must fail
    for r in rows:
        r["units"] *= c / r["c"]
    by_test = collections.defaultdict(list)
    for r in rows:
        by_test[r["test"].split("[")[0]].append(r)
    print(f"\n{'test':<92} {'n':>4} {'max units':>9}  ISA")
    for test, rs in sorted(by_test.items()):
        worst = max(rs, key=lambda r: r["units"])
        print(f"{test:<92} {len(rs):>4} {worst['units']:>9.3f}  {worst['isa'] or 'native'}")
    return max(r["units"] for r in rows)


def mutations() -> None:
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForCausalLM

    from srt.configs.model_config import ModelConfig, resolve_model_path
    from srt.model_loader import get_model
    from tests.helpers.gguf_models import break_one_scale
    from tests.helpers.tiny_models import extend_batch
    from tests.helpers.tolerance import REORDER_C, reduction_len, unit

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = resolve_model_path(None)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]
    ids += torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(4)).tolist()

    def logits(model) -> torch.Tensor:
        fb = extend_batch([ids])
        return F.linear(model.model(fb.input_ids, fb.positions, fb), model.lm_head.weight).float()

    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
        u = unit(ref, reduction_len(hf.config))
        tol = REORDER_C * u
        print(f"\nbroken scales, default model (tolerance {tol:.3g} = {REORDER_C:g} units of {u:.3g})")
        print(f"{'tensor':<26} {'block':>7} {'factor':>6} {'max |err|':>10} {'x tolerance':>12}")
        err = float((logits(get_model(ModelConfig(path))) - ref).abs().max())
        print(f"{'(none)':<26} {'':>7} {'':>6} {err:>10.3g} {err / tol:>12.3f}")
        with tempfile.TemporaryDirectory() as tmp:
            broken = os.path.join(tmp, "broken.gguf")
            for tensor, block, factor in MUTATIONS:
                break_one_scale(path, broken, tensor, block, factor)
                err = float((logits(get_model(ModelConfig(broken))) - ref).abs().max())
                print(f"{tensor:<26} {block:>7} {factor:>6g} {err:>10.3g} {err / tol:>12.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isas", default="", help="comma-separated (default: every ISA this CPU runs)")
    ap.add_argument("--skip-runs", action="store_true", help="only the broken-scale table")
    args = ap.parse_args()

    from tests.helpers.isa import available_isas
    from tests.helpers.tolerance import REORDER_C

    print(f"CPU: {cpu_name()}")
    if not args.skip_runs:
        isas = args.isas.split(",") if args.isas else list(reversed(available_isas())) or [""]
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "tolerance.jsonl")
            for isa in isas:
                print(f"SRT_CPU_ISA={isa}: {run_isa(isa, log)}", flush=True)
            worst = summarize(log, REORDER_C)
        print(f"\nlargest error: {worst:.3f} units; REORDER_C = {REORDER_C:g}: {REORDER_C / worst:.1f}x it")
    mutations()


if __name__ == "__main__":
    main()
