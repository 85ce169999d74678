"""The disk cache of references computed from files a test writes (tests/helpers/ref_cache.py): an
entry is keyed by the files' bytes, not their path, reads back what was stored without computing
it again, and moves with the key, the computing code and the library versions."""

from __future__ import annotations

import json
import types

import pytest
import torch

from tests.helpers import hf_reference, ref_cache
from tests.helpers.tiny_models import save_tiny_model


def _write(folder, files: dict[str, bytes]):
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def test_folder_digest_follows_the_bytes_and_names_not_the_path(tmp_path):
    files = {"config.json": b'{"a": 1}', "sub/model.safetensors": b"\x00\x01weights"}
    one = ref_cache.folder_digest(_write(tmp_path / "one", files))
    assert ref_cache.folder_digest(_write(tmp_path / "elsewhere" / "two", files)) == one
    changed = {**files, "sub/model.safetensors": b"\x00\x02weights"}
    assert ref_cache.folder_digest(_write(tmp_path / "changed", changed)) != one
    renamed = {"config.json": files["config.json"], "sub/other.safetensors": files["sub/model.safetensors"]}
    assert ref_cache.folder_digest(_write(tmp_path / "renamed", renamed)) != one
    extra = {**files, "README.md": b""}
    assert ref_cache.folder_digest(_write(tmp_path / "extra", extra)) != one


def _module(name: str, source: str) -> types.ModuleType:
    """A module whose source ``inspect.getsource`` reads back (a file on disk)."""
    module = types.ModuleType(name)
    module.__file__ = source
    return module


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_reference, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache"


def test_an_entry_reads_back_without_computing_and_moves_with_key_and_code(tmp_path, cache_dir):
    code_a = tmp_path / "code_a.py"
    code_a.write_text("def f(): return 1\n")
    mod = _module("code_a", str(code_a))
    calls = []

    def compute(value):
        def run():
            calls.append(value)
            return {"tokens": [1, 2, value], "n": (3, 4)}

        return run

    first = ref_cache.cached_json("kind", ["k", 1], compute(5), [mod])
    assert first == {"tokens": [1, 2, 5], "n": [3, 4]}, "the value as a later read gives it"
    assert ref_cache.cached_json("kind", ["k", 1], compute(6), [mod]) == first
    assert calls == [5], "the second call is served from the disk"
    assert ref_cache.cached_json("kind", ["k", 2], compute(7), [mod])["tokens"][-1] == 7
    assert ref_cache.cached_json("other-kind", ["k", 1], compute(8), [mod])["tokens"][-1] == 8
    code_a.write_text("def f(): return 22\n")  # the computing code changed: a new entry
    assert ref_cache.cached_json("kind", ["k", 1], compute(9), [mod])["tokens"][-1] == 9
    assert calls == [5, 7, 8, 9]
    stored = sorted(cache_dir.glob("refs/*.json"))
    assert len(stored) == 4 and all(json.loads(p.read_text()) for p in stored)


def test_a_failed_computation_stores_nothing(tmp_path, cache_dir):
    def fails():
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        ref_cache.cached_json("kind", ["x"], fails, [])
    assert not list(cache_dir.glob("refs/*"))
    assert ref_cache.cached_json("kind", ["x"], lambda: [1], []) == [1]


def test_folder_key_moves_with_the_bytes_the_load_and_the_versions(tmp_path, monkeypatch):
    folder = _write(tmp_path / "m", {"model.safetensors": b"abc"})
    key = ref_cache.folder_key(folder, "float32")
    assert ref_cache.folder_key(folder, "float32") == key
    assert ref_cache.folder_key(folder, "bfloat16") != key
    monkeypatch.setattr(ref_cache, "_package_versions", lambda: "transformers=0;torch=0;peft=0")
    assert ref_cache.folder_key(folder, "float32") != key


def test_a_saved_tiny_model_is_loaded_once_for_two_copies_of_its_folder(tmp_path, cache_dir, monkeypatch):
    """The seeded builder writes the same bytes twice: the second folder's references come from the
    cache (the model is not loaded), equal to transformers' own greedy run."""
    import transformers

    one = save_tiny_model("llama", tmp_path / "one", seed=0)
    two = save_tiny_model("llama", tmp_path / "two", seed=0)
    assert ref_cache.folder_digest(one) == ref_cache.folder_digest(two)
    prompts = hf_reference.make_prompts([3, 17], seed=4, vocab_size=320)
    loads = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def counted(*args, **kw):
        loads.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", counted)
    first = ref_cache.hf_folder_references(one, prompts, 5)
    assert ref_cache.hf_folder_references(two, prompts, 5) == first
    assert loads == [str(one)]
    model = real(str(one), dtype=torch.float32).eval()
    assert first == [hf_reference.hf_greedy_reference(model, p, 5) for p in prompts]
    other = save_tiny_model("llama", tmp_path / "other", seed=1)
    ref_cache.hf_folder_references(other, prompts, 5)
    assert loads == [str(one), str(other)], "other bytes, another entry"
