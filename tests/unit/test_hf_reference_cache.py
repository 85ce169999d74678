"""The transformers reference cache (tests/helpers/hf_reference.py): an entry reads back bit for
bit without loading the model, and its key moves with what the reference's bits depend on (the
cache is shared between runs and checkouts, so a missing key field would hand one process another
process's numbers)."""

from __future__ import annotations

from tests.helpers import hf_reference
from tests.helpers.threads import with_threads
from tests.helpers.tiny_models import build_tiny_hf_model


def test_cached_reference_reads_back_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_reference, "CACHE_DIR", tmp_path)
    model = build_tiny_hf_model("llama", seed=0)
    loads = []

    def load():
        loads.append(1)
        return model

    prompts = hf_reference.make_prompts([3, 17], seed=4, vocab_size=320)
    first = hf_reference.hf_greedy_references("tiny-llama-0", prompts, 6, load)
    again = hf_reference.hf_greedy_references("tiny-llama-0", [tuple(p) for p in prompts], 6, load)
    assert len(loads) == 1, "the second call is served from the cache"
    assert again == first  # floats compared exactly: the JSON keeps every bit of a float32 value
    assert first == [hf_reference.hf_greedy_reference(model, p, 6) for p in prompts]


def test_key_moves_with_length_threads_and_model():
    prompt = [5, 6, 7]
    path = hf_reference._cache_path
    assert path("m", prompt, 8) == path("m", tuple(prompt), 8)
    assert path("m", prompt, 8) != path("m", prompt, 9)
    assert path("m", prompt, 8) != path("other", prompt, 8)
    one, two = with_threads(lambda: path("m", prompt, 8), (1, 2))
    assert one != two
