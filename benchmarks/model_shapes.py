"""Big model shapes without downloads, for srt and its peers alike.

Each shape is a JSON file in ``benchmarks/shapes/`` (``--list`` shows them):

    kind "hf"    a Hugging Face ``config`` (float32, or bfloat16 as the Hub ships checkpoints:
                 ``torch_dtype``); ``materialize`` writes a folder with that
                 config.json and the default model's tokenizer, which srt (``--load-format
                 dummy``) and vLLM (``--load-format dummy``) both serve with random weights
    kind "gguf"  a Llama decoder (``gguf``: hidden, intermediate, layers, heads, kv_heads, ctx,
                 rope_theta, qtype_scheme such as Q4_K_M or Q8_0), or with experts,
                 experts_used, moe_intermediate and head_dim a Qwen3-MoE decoder (GGUF
                 architecture qwen3moe, experts as 3-D tensors); ``materialize`` writes a GGUF
                 of random blocks in that mix with the default model's tokenizer copied in
                 (``tests/helpers/gguf_models.write_llama_gguf``), which srt and llama.cpp's
                 server both load

and a ``workload`` scaled to what a 2-core machine serves in minutes: the longest prompt and
output in tokens and the range ratio (lengths uniform from that fraction of the longest up to
it, as ``srt.bench_serving --random-range-ratio`` draws them). The tokenizer is the default model's (49,152 tokens): the prompts are random
token ids below it, valid for every shape, and an hf shape's bos / eos ids are set to that
tokenizer's. Random weights give meaningless text, so benchmarks use ``ignore_eos`` and fixed
output lengths.

Materialized shapes are cached under ``~/.cache/srt/shapes/`` (``$XDG_CACHE_HOME`` honoured),
keyed by the shape's JSON and the default model's file, and reused.

The least work of one token, for bounds: ``weight_bytes_per_token`` (every decoder matrix, norm
and the LM head read once: in the checkpoint's dtype for hf shapes, the stored blocks for gguf ones; of a MoE's
experts only the ``experts_used`` a token is routed to) and ``flops_per_token`` (2 x the
decoder's and LM head's matrix elements a decoded token uses; attention left out); for a whole run
``matmul_flops`` (the LM head only for generated tokens).

    python -m benchmarks.model_shapes --list
    python -m benchmarks.model_shapes NAME          # materialize, print the path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `benchmarks` and `tests` importable
    sys.path.insert(0, str(REPO))

SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
FORMAT_VERSION = 1  # bump when what materialize writes changes
GGUF_KEYS = ("hidden", "intermediate", "layers", "heads", "kv_heads")
# optional keys of a gguf spec: a Qwen3-MoE decoder (experts as 3-D tensors; head_dim of its own)
GGUF_MOE_KEYS = ("head_dim", "experts", "experts_used", "moe_intermediate")


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    description: str
    kind: str  # "hf" or "gguf"
    input_len: int  # the longest prompt (srt.bench_serving --random-input-len)
    output_len: int  # the longest output (--random-output-len)
    range_ratio: float  # the shortest of each is this fraction of the longest
    config: dict | None = None  # kind hf
    gguf: dict | None = None  # kind gguf


def names() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def load(name: str) -> Shape:
    """The shape ``name``; ``KeyError`` naming the known shapes when there is none."""
    path = SHAPES_DIR / f"{name}.json"
    if not path.is_file():
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(names())}")
    raw = json.loads(path.read_text())
    kind = raw["kind"]
    if kind not in ("hf", "gguf"):
        raise ValueError(f"{path}: kind must be hf or gguf, got {kind!r}")
    work = raw["workload"]
    return Shape(
        name=name,
        description=raw.get("description", ""),
        kind=kind,
        input_len=int(work["input_len"]),
        output_len=int(work["output_len"]),
        range_ratio=float(work["range_ratio"]),
        config=raw.get("config"),
        gguf=raw.get("gguf"),
    )


# ---------------------------------------------------------------- materialize
def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "srt" / "shapes"


def _default_gguf() -> str:
    from benchmarks.common import default_model_dir_and_file

    model_dir, gguf_name = default_model_dir_and_file()
    return os.path.join(model_dir, gguf_name)


def _key(shape: Shape, tokenizer_gguf: str) -> str:
    """What the written files depend on: the config or GGUF spec, and the tokenizer's file."""
    st = os.stat(tokenizer_gguf)
    spec = json.dumps(shape.config if shape.kind == "hf" else shape.gguf, sort_keys=True)
    raw = f"v{FORMAT_VERSION}:{spec}:{os.path.abspath(tokenizer_gguf)}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def materialize(shape: Shape, root: Path | None = None) -> str:
    """The folder (hf) or .gguf file (gguf) of ``shape``, written on first use."""
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tokenizer_gguf = _default_gguf()
    key = _key(shape, tokenizer_gguf)
    if shape.kind == "hf":
        out = root / f"{shape.name}-{key}"
        if not (out / "config.json").is_file():
            _write_hf(shape, tokenizer_gguf, out)
        return str(out)
    out = root / f"{shape.name}-{key}.gguf"
    if not out.is_file():
        _write_gguf(shape, tokenizer_gguf, out)
    return str(out)


def _write_hf(shape: Shape, tokenizer_gguf: str, out: Path) -> None:
    from srt.benchmark.tokenizer import load_tokenizer

    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{shape.name}-"))
    try:
        tok = load_tokenizer(tokenizer_gguf)
        tok.save_pretrained(str(tmp))
        config = dict(shape.config or {})
        config["bos_token_id"], config["eos_token_id"] = tok.bos_token_id, tok.eos_token_id
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_gguf(shape: Shape, tokenizer_gguf: str, out: Path) -> None:
    from tests.helpers.gguf_models import write_llama_gguf

    spec = dict(shape.gguf or {})
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        write_llama_gguf(
            tmp, **spec, tokenizer_from=tokenizer_gguf, fast_random=True, seed=0, name=shape.name
        )
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- least work per token
def _hf_matrices(cfg: dict) -> tuple[int, int]:
    """(elements of the decoder's matrices, elements of the LM head)."""
    h, inter, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter
    return n * per_layer, cfg["vocab_size"] * h


def _gguf_plan(shape: Shape) -> list:
    """The shape's GGUF tensors (``tensor_plan``)."""
    from tests.helpers.gguf_models import gguf_vocab_size, tensor_plan

    spec = shape.gguf or {}
    dims = {k: spec[k] for k in GGUF_KEYS} | {k: spec[k] for k in GGUF_MOE_KEYS if k in spec}
    vocab = gguf_vocab_size(_default_gguf())
    return tensor_plan(**dims, vocab=vocab, qtype_scheme=spec.get("qtype_scheme", "Q4_K_M"))


def _active_share(p, shape: Shape) -> float:
    """The share of tensor ``p`` one token uses: the active experts' of a 3-D expert tensor."""
    return (shape.gguf or {}).get("experts_used", 0) / p.shape[0] if len(p.shape) == 3 else 1.0


def checkpoint_dtype(shape: Shape) -> str:
    """The dtype an hf shape's checkpoint declares (``torch_dtype``): float32 or bfloat16; gguf shapes
    have blocks, "gguf"."""
    if shape.kind != "hf":
        return "gguf"
    return (shape.config or {}).get("torch_dtype", "float32")


def weight_bytes_per_token(shape: Shape) -> int:
    if shape.kind == "hf":
        cfg = shape.config or {}
        dec, head = _hf_matrices(cfg)
        norms = (2 * cfg["num_hidden_layers"] + 1) * cfg["hidden_size"]
        return (2 if checkpoint_dtype(shape) in ("bfloat16", "float16") else 4) * (dec + head + norms)
    from tests.helpers.gguf_models import decode_read_bytes

    return decode_read_bytes(_gguf_plan(shape), (shape.gguf or {}).get("experts_used", 0))


def matrix_elements(shape: Shape) -> tuple[float, float]:
    """(the decoder's matrix elements one token uses, the LM head's): of a MoE's expert tensors
    only the ``experts_used`` experts' share."""
    if shape.kind == "hf":
        dec, head = _hf_matrices(shape.config or {})
        return float(dec), float(head)
    from tests.helpers.gguf_models import decode_read_tensors

    read = [p for p in decode_read_tensors(_gguf_plan(shape)) if len(p.shape) > 1]
    head = sum(math.prod(p.shape) for p in read if p.name == "output.weight")
    dec = sum(math.prod(p.shape) * _active_share(p, shape) for p in read if p.name != "output.weight")
    return float(dec), float(head)


def flops_per_token(shape: Shape) -> float:
    """FLOPs of one decoded token's matmuls: 2 x the decoder's and the LM head's matrix elements."""
    dec, head = matrix_elements(shape)
    return 2.0 * (dec + head)


def matmul_flops(shape: Shape, input_tokens: int, output_tokens: int) -> float:
    """The least matmul FLOPs of serving ``input_tokens`` of prompts and ``output_tokens`` of
    outputs: every token passes the decoder, the LM head runs once per generated token (a prompt
    token's logits are never needed, but its last one's give the first output token)."""
    dec, head = matrix_elements(shape)
    return 2.0 * (dec * (input_tokens + output_tokens) + head * output_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?", help="the shape to materialize")
    ap.add_argument("--list", action="store_true", help="list the shapes")
    ap.add_argument("--root", default=None, help=f"where to write (default {cache_root()})")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        for n in names():
            s = load(n)
            gb = weight_bytes_per_token(s) / 1e9
            print(f"{n:22s} {s.kind:5s} {gb:6.2f} GB read per token  {s.description}")
        return 0
    try:
        shape = load(args.name)
    except KeyError as e:
        ap.error(str(e))
    print(materialize(shape, Path(args.root) if args.root else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
