"""Processes that only tokenize load transformers without torch (srt/utils/torch_free.py), and
`tokenizer_needs_torch` says when they cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from srt.server_args import ServerArgs
from srt.utils.hf_tokenizer import _cache_dir, load_tokenizer, tokenizer_needs_torch, tokenizer_source

TEXTS = ["Hello world, <|im_start|> x", "  spaces\tand\nlines ", "ünïcödé 🙂 1234567"]


def _probe(tokenizer_dir: str, hide: bool) -> dict:
    code = (
        "import json, sys, contextlib\n"
        "from srt.utils.torch_free import transformers_without_torch\n"
        "from srt.utils.hf_tokenizer import load_tokenizer\n"
        f"ctx = transformers_without_torch() if {hide} else contextlib.nullcontext()\n"
        "with ctx:\n"
        f"    t = load_tokenizer({tokenizer_dir!r})\n"
        f"ids = [t.encode(s) for s in {TEXTS!r}]\n"
        "out = {'torch': 'torch' in sys.modules, 'cls': type(t).__name__, 'ids': ids,\n"
        "       'text': [t.decode(i, skip_special_tokens=True) for i in ids],\n"
        "       'chat': t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,\n"
        "                                     add_generation_prompt=True)}\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr
    assert "PyTorch was not found" not in proc.stderr  # transformers' advice stays quiet
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_tokenizer_loaded_without_torch_is_the_same_tokenizer(tmp_path):
    saved = tmp_path / "tok"
    load_tokenizer(tokenizer_source(ServerArgs())).save_pretrained(saved)  # as the launcher saves it
    hidden, plain = _probe(str(saved), True), _probe(str(saved), False)
    assert hidden["torch"] is False and plain["torch"] is True
    assert {k: v for k, v in hidden.items() if k != "torch"} == {
        k: v for k, v in plain.items() if k != "torch"
    }


def test_the_cached_conversion_is_transformers_gguf_tokenizer():
    """srt (and the tests' references) load the GGUF's tokenizer from its cached conversion: it
    must be the tokenizer transformers builds from the file itself."""
    from transformers import AutoTokenizer

    gguf = tokenizer_source(ServerArgs())
    cached = load_tokenizer(gguf)
    assert os.path.isfile(os.path.join(_cache_dir(gguf), "tokenizer.json"))
    parsed = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    assert type(cached) is type(parsed) and len(cached) == len(parsed)
    assert cached.all_special_ids == parsed.all_special_ids and cached.chat_template == parsed.chat_template
    for text in TEXTS:
        ids = parsed.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids, skip_special_tokens=True) == parsed.decode(ids, skip_special_tokens=True)
    every = list(range(len(parsed)))
    assert cached.convert_ids_to_tokens(every) == parsed.convert_ids_to_tokens(every)


def test_tokenizer_needs_torch(tmp_path):
    gguf = tokenizer_source(ServerArgs())
    assert gguf.endswith(".gguf")
    load_tokenizer(gguf)  # converts once and caches the converted copy
    assert os.path.isfile(os.path.join(_cache_dir(gguf), "tokenizer.json"))
    assert tokenizer_needs_torch(gguf) is False
    assert tokenizer_needs_torch(gguf, trust_remote_code=True) is True  # the repository's code may
    fresh = tmp_path / "copy.gguf"  # not converted yet: transformers' GGUF reader needs torch
    os.symlink(gguf, fresh)
    assert tokenizer_needs_torch(str(fresh)) is True
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer_config.json").write_text(json.dumps({}))
    assert tokenizer_needs_torch(str(hf)) is False
    only_gguf = tmp_path / "only_gguf"
    only_gguf.mkdir()
    os.symlink(gguf, only_gguf / "m.gguf")
    assert tokenizer_needs_torch(str(only_gguf)) is True
    assert tokenizer_needs_torch("some-org/some-model") is True
