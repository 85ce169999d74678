"""The detokenizer decodes a fast tokenizer on its ``tokenizers`` backend alone
(srt/utils/hf_tokenizer.py: `save_decode_copy`, `load_decode_tokenizer`): the same text as
transformers' tokenizer for any ids, special tokens skipped, kept, or spaced, without importing
transformers; any tokenizer whose class decodes otherwise keeps transformers'."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from srt.managers.detokenizer.detokenizer_manager import DetokenizerManager
from srt.server_args import ServerArgs
from srt.utils.hf_tokenizer import (
    DECODE_FILE,
    BackendDecoder,
    load_decode_tokenizer,
    load_tokenizer,
    save_decode_copy,
    special_token_ids,
    tokenizer_source,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, tabs\tand\nnew lines; ünïcödé 🙂 and 日本語 text.",
    "def f(x):\n    return x ** 2  # code, with symbols <>{}[]",
] * 20
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS[:2]))
    return tok


def _metaspace() -> Tokenizer:  # sentencepiece-style: "▁" for spaces, byte fallback
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS[:2]])
    )
    return tok


def _wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]"])
    )
    return tok


def _hf_dir(tmp_path, backend: Tokenizer, name: str) -> str:
    """A model folder holding ``backend`` as transformers saves it, two chat specials added."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIALS[0], eos_token=SPECIALS[1])
    hf.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    hf.add_tokens(["<not_special>"])  # an added token that is not special: decoded as text always
    path = str(tmp_path / name)
    hf.save_pretrained(path)
    return path


def _copies(tmp_path, source: str):
    """As a launch does it: transformers' tokenizer from ``source`` (the tokenizer manager's), its
    saved copy, and what the detokenizer loads from the copy."""
    tok = load_tokenizer(source)
    copy = str(tmp_path / "copy")
    save_decode_copy(tok, copy)
    return tok, copy, load_decode_tokenizer(copy)


def _random_ids(rng: random.Random, vocab: int, specials: list[int]) -> list[int]:
    return [
        rng.choice(specials) if rng.random() < 0.15 else rng.randrange(vocab)
        for _ in range(rng.randint(0, 10))
    ]


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "wordpiece", "default_model"])
def test_backend_decoding_equals_transformers(tmp_path, kind):
    if kind == "default_model":
        source = tokenizer_source(ServerArgs())
    else:
        source = _hf_dir(
            tmp_path,
            {"byte_level": _byte_level, "metaspace": _metaspace, "wordpiece": _wordpiece}[kind](),
            kind,
        )
    tok, copy, dec = _copies(tmp_path, source)
    assert isinstance(dec, BackendDecoder) and os.path.isfile(os.path.join(copy, DECODE_FILE))
    specials = sorted(special_token_ids(tok))
    assert sorted(special_token_ids(dec)) == specials and len(specials) >= 4
    ref, fast = DetokenizerManager(tok), DetokenizerManager(dec)
    rng = random.Random(0)
    for _ in range(400):
        ids = _random_ids(rng, len(tok), specials)
        for skip in (False, True):
            for spaces in (False, True):
                assert fast.decode(ids, skip, spaces) == ref.decode(ids, skip, spaces), (ids, skip, spaces)
    for i in range(len(tok)):
        assert dec.convert_ids_to_tokens(i) == tok.convert_ids_to_tokens(i)


def test_a_class_that_decodes_otherwise_keeps_transformers_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kw):
            return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kw).upper()

    tok = Shouting(tokenizer_object=_byte_level(), bos_token=SPECIALS[0], eos_token=SPECIALS[1])
    copy = str(tmp_path / "copy")
    save_decode_copy(tok, copy)
    assert not os.path.exists(os.path.join(copy, DECODE_FILE))
    assert not isinstance(load_decode_tokenizer(copy), BackendDecoder)


def test_an_unreadable_mark_falls_back_to_transformers(tmp_path):
    _, copy, _ = _copies(tmp_path, _hf_dir(tmp_path, _byte_level(), "bl"))
    with open(os.path.join(copy, DECODE_FILE), "w") as f:
        f.write("{not json")
    dec = load_decode_tokenizer(copy)
    assert not isinstance(dec, BackendDecoder) and dec.decode([5, 6]) == load_tokenizer(copy).decode([5, 6])
    with open(os.path.join(copy, DECODE_FILE), "w") as f:
        json.dump({"special": [0]}, f)  # not the field it reads
    assert not isinstance(load_decode_tokenizer(copy), BackendDecoder)


def test_the_detokenizer_process_decodes_without_importing_transformers(tmp_path):
    _, copy, _ = _copies(tmp_path, tokenizer_source(ServerArgs()))
    code = (
        "import sys\n"
        "from srt.managers.detokenizer.detokenizer_manager import DetokenizerManager\n"
        "from srt.utils.hf_tokenizer import load_decode_tokenizer\n"
        f"m = DetokenizerManager(load_decode_tokenizer({copy!r}))\n"
        "print(m.decode([19556, 905], True, True), 'transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    text, transformers_imported, torch_imported = out.stdout.strip().rsplit(" ", 2)
    assert text == load_tokenizer(copy).decode([19556, 905], skip_special_tokens=True)
    assert (transformers_imported, torch_imported) == ("False", "False")
