"""Loading the Hugging Face tokenizer the serving processes share.

The tokenizer manager loads it once from ``--tokenizer-path`` / ``--model-path`` (a directory or a
.gguf file; parsing a GGUF takes seconds), saves it as ``tokenizer.json`` in the launch's private
ipc directory (`save_decode_copy`), and the detokenizer loads that copy (`load_decode_tokenizer`).
Where the tokenizer's decoding is its ``tokenizers`` backend's own (every fast tokenizer whose class
does not override it), the detokenizer decodes on that backend alone, without importing
transformers: about 1 CPU-second and 17 MiB of resident memory less in each launch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from typing import Any, Protocol

from srt.utils.cpu_memory import release_free_memory
from srt.utils.errors import ConfigError
from srt.utils.model_path import resolve_model_path
from srt.utils.torch_free import transformers_without_torch

# what a model folder holds when it carries its tokenizer (one is enough)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "tiktoken.model",
)


class TokenizerPaths(Protocol):
    """The two ``ServerArgs`` fields that say where the tokenizer is (ServerArgs satisfies it)."""

    @property
    def tokenizer_path(self) -> str | None: ...

    @property
    def model_path(self) -> str | None: ...


def tokenizer_source(server_args: TokenizerPaths) -> str:
    """The path the tokenizer comes from: --tokenizer-path, else the (resolved) model path."""
    if server_args.tokenizer_path:
        return os.path.abspath(os.path.expanduser(server_args.tokenizer_path))
    return resolve_model_path(server_args.model_path)


def _cache_dir(gguf_path: str) -> str | None:
    """Where the converted tokenizer of ``gguf_path`` is cached (keyed by path, size and mtime)."""
    try:
        st = os.stat(gguf_path)
    except OSError:
        return None
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[
        :24
    ]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "srt", "tokenizers", key)


def _load_gguf_tokenizer(path: str):
    """Parsing a GGUF for its tokenizer takes seconds; the converted tokenizer is cached on disk
    (``$XDG_CACHE_HOME/srt/tokenizers``) and later launches load the cached copy."""
    from transformers import AutoTokenizer

    cache = _cache_dir(path)
    if cache is not None and os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception:  # noqa: BLE001 - a corrupt cache entry: rebuild it
            shutil.rmtree(cache, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    if cache is not None:
        tmp = f"{cache}.tmp-{os.getpid()}"
        try:
            tok.save_pretrained(tmp)
            os.replace(tmp, cache)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _gguf_in_dir(path: str) -> str | None:
    """The GGUF file of directory ``path`` whose tokenizer `load_tokenizer` converts: the first one,
    when the directory has no ``tokenizer.json`` / ``tokenizer_config.json`` of its own."""
    if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    return ggufs[0] if ggufs else None


def tokenizer_needs_torch(path: str, trust_remote_code: bool = False) -> bool:
    """Whether loading ``path``'s tokenizer may need torch: the repository's own code may import it,
    and transformers converts a GGUF's tokenizer with its torch-based GGUF reader (a GGUF whose
    converted copy is cached, a directory with tokenizer files and no GGUF need none)."""
    if trust_remote_code:
        return True
    if path.endswith(".gguf"):
        cache = _cache_dir(path)
        return cache is None or not os.path.isfile(os.path.join(cache, "tokenizer.json"))
    if os.path.isdir(path):
        return _gguf_in_dir(path) is not None
    return True  # a hub id or a path that does not exist: leave it to transformers


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """A transformers tokenizer from a directory or a ``.gguf`` file (or a directory holding one).
    Local files only (nothing is downloaded); ``trust_remote_code`` (--trust-remote-code) lets a
    tokenizer class defined by the model repository's own code load. The loading's temporaries
    go back to the OS: without that, 28 MiB of them stay resident in each process that loads the
    default tokenizer (the HTTP process, the detokenizer, the scheduler's grammar backend)."""
    tokenizer = _load_tokenizer(path, trust_remote_code)
    release_free_memory()
    return tokenizer


def _load_tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return _load_gguf_tokenizer(path)
    kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    if os.path.isdir(path):
        gguf = _gguf_in_dir(path)
        if gguf is not None:
            return AutoTokenizer.from_pretrained(path, gguf_file=gguf, **kwargs)
        if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
            raise ConfigError(
                f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}, no .gguf): "
                "pass --tokenizer-path, or --skip-tokenizer-init and send input_ids"
            )
    return AutoTokenizer.from_pretrained(path, **kwargs)


def load_tokenizer_without_torch(path: str, trust_remote_code: bool = False):
    """`load_tokenizer`, with torch hidden from transformers when the tokenizer needs none
    (srt/utils/torch_free.py): for the processes of srt's own that only tokenize or decode."""
    hide = not tokenizer_needs_torch(path, trust_remote_code)
    with transformers_without_torch() if hide else contextlib.nullcontext():
        return load_tokenizer(path, trust_remote_code)


def special_token_ids(tokenizer) -> set[int]:
    """Ids that ``skip_special_tokens=True`` removes (added tokens flagged special + named specials)."""
    ids = {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None)
    return ids


DECODE_FILE = "srt_decode.json"  # beside a saved copy: its decoding is the backend's, and its special ids


def _decodes_on_backend(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` (with ``clean_up_tokenization_spaces=False``) and
    ``convert_ids_to_tokens`` of one id are exactly its ``tokenizers`` backend's ``decode`` and
    ``id_to_token``: a fast tokenizer whose class overrides none of the three methods."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and cls.convert_ids_to_tokens is TokenizersBackend.convert_ids_to_tokens
    )


def save_decode_copy(tokenizer: Any, path: str) -> None:
    """Save ``tokenizer`` in ``path`` for the detokenizer (`load_decode_tokenizer`), with
    ``DECODE_FILE`` when its decoding is its backend's own (`_decodes_on_backend`)."""
    tokenizer.save_pretrained(path)
    if _decodes_on_backend(tokenizer) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        with open(os.path.join(path, DECODE_FILE), "w") as f:
            json.dump({"special_ids": sorted(special_token_ids(tokenizer))}, f)


class BackendDecoder:
    """The decoding half of a fast tokenizer, on its ``tokenizers`` backend alone: what the
    detokenizer calls, with transformers' results (``save_decode_copy`` checked the class)."""

    def __init__(self, backend: Any, special_ids: list[int]) -> None:
        self.backend = backend
        self.all_special_ids = special_ids

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("BackendDecoder decodes without clean_up_tokenization_spaces only")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


def load_decode_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The detokenizer's tokenizer from ``path``: a `BackendDecoder` over a copy that
    ``save_decode_copy`` marked, else transformers' tokenizer (`load_tokenizer_without_torch`)."""
    try:
        with open(os.path.join(path, DECODE_FILE)) as f:
            special_ids = [int(i) for i in json.load(f)["special_ids"]]
        from tokenizers import Tokenizer

        return BackendDecoder(Tokenizer.from_file(os.path.join(path, "tokenizer.json")), special_ids)
    except Exception:  # noqa: BLE001 - no marked copy, or one that does not load: transformers's turn
        return load_tokenizer_without_torch(path, trust_remote_code)
