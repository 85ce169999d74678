"""A prompt that needs more tokens than the context holds is refused before it is tokenized
(`token_cover`, `InputProcessor`). The bound must never refuse a text that would fit: no token
may cover more of a text than `TokenCover` says, for the default model's tokenizer (a byte-level
vocabulary missing some bytes, which it drops), byte-level and byte-fallback tokenizers; those
that may drop or merge text without bound (WordPiece's one [UNK] per word, a stripping normalizer
or added token) get no bound."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from srt.server_args import ServerArgs
from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source
from srt.utils.token_cover import _chars_of_bytes, token_cover
from tests.unit.test_decode_tokenizer import CORPUS, _byte_level, _hf_dir, _metaspace, _wordpiece

PIECES = [
    "#",
    " ",
    "\n",
    "\n  ",
    "a",
    "é",
    "e\u0301",
    "\u1100\u1161\u11a8",
    "🙂",
    "日本",
    "ﬁ",
    "\x06",
    "\x00",
]
PIECES += ["\U00050000", "<s>", "<|im_start|>"]


def _texts(seed: int) -> list[str]:
    """Runs of one piece (the longest tokens are runs: '####...', newline + spaces) and mixes."""
    rng = random.Random(seed)
    out = [p * rng.randint(1, 300) for p in PIECES]
    out += ["".join(rng.choice(PIECES) * rng.randint(1, 40) for _ in range(20)) for _ in range(30)]
    return out + ["".join(rng.sample(CORPUS, 3))]


def _full_byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS + ["#" * 64, "\n" + " " * 32], trainer)
    return tok


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizers")
    built = {
        "full_byte_level": _full_byte_level,
        "partial_byte_level": _byte_level,
        "byte_fallback": _metaspace,
    }
    out = {"default": load_tokenizer(tokenizer_source(ServerArgs()))}
    return out | {name: load_tokenizer(_hf_dir(root, build(), name)) for name, build in built.items()}


@pytest.mark.parametrize("seed", range(2))
def test_no_text_has_fewer_tokens_than_the_bound_says(tokenizers, seed):
    for name, tok in tokenizers.items():
        cover = token_cover(tok)
        assert cover is not None and cover.chars >= max(map(len, tok.get_vocab())), name
        assert (cover.dropped is None) == (name != "default" and name != "partial_byte_level"), name
        for text in _texts(seed):
            n = len(tok(text, add_special_tokens=False)["input_ids"])
            assert cover.min_tokens(text) <= n, (name, text[:40], len(text), n, cover)


def test_tokenizers_that_may_drop_or_merge_text_without_bound_get_none(tmp_path):
    assert token_cover(load_tokenizer(_hf_dir(tmp_path, _wordpiece(), "wordpiece"))) is None
    tok = load_tokenizer(tokenizer_source(ServerArgs()))
    plain = token_cover(tok)
    tok.backend_tokenizer.normalizer = normalizers.NFC()  # merges up to three characters into one
    assert token_cover(tok).chars == 4 * plain.chars
    tok.backend_tokenizer.normalizer = normalizers.Strip()
    assert token_cover(tok) is None
    tok = load_tokenizer(tokenizer_source(ServerArgs()))
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()]
    )
    assert token_cover(tok) is None
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation("removed"), pre_tokenizers.ByteLevel()]
    )
    assert token_cover(tok) is None
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation("isolated"), pre_tokenizers.ByteLevel()]
    )
    assert token_cover(tok) == plain


@pytest.mark.parametrize("missing", [{0x06}, {0x06, 0x1D, 0xF1, 0xF2}, {0xC3}, {0xE6}, {0x9F}, {0xC0, 0xFF}])
def test_the_dropped_characters_are_those_whose_utf8_holds_a_missing_byte(missing):
    """Exactly those, but for a missing continuation byte: then every non-ASCII character (a
    superset, which only makes the bound lower)."""
    pattern = _chars_of_bytes(missing)
    continuation = any(0x80 <= b < 0xC0 for b in missing)
    rng = random.Random(0)
    points = [*range(0x300), *rng.sample(range(0x110000), 30000), 0xFFFF, 0x10000, 0x40000, 0x10FFFF]
    for cp in points:
        if 0xD800 <= cp <= 0xDFFF:
            continue  # surrogates have no UTF-8 form
        c = chr(cp)
        expected = any(b in missing for b in c.encode()) or (continuation and cp >= 0x80)
        assert (pattern is not None and pattern.fullmatch(c) is not None) == expected, (hex(cp), missing)
