"""srt's GGUF header reader (srt/configs/gguf_header.py): string arrays (a vocabulary, its merges),
read in one loop, equal the same header read one string at a time; string arrays of any bytes
(not UTF-8, empty, long) read as the ``gguf`` package reads them, the tensor table too; a cut
header is refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from srt.configs import gguf_header
from srt.configs.gguf_header import parse_gguf
from srt.utils.model_path import resolve_model_path


def _theirs(path: str, skip: tuple[str, ...] = ()) -> dict:
    reader = gguf.GGUFReader(path)
    return {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith(("GGUF.", *skip))}


class _OneByOne(gguf_header._HeaderReader):
    """The simple reference: each string of an array read on its own."""

    def strings(self, count: int) -> list[str]:
        return [self.string() for _ in range(count)]


def test_the_default_models_header_reads_as_one_string_at_a_time(monkeypatch):
    path = resolve_model_path(None)
    ours = parse_gguf(path)
    monkeypatch.setattr(gguf_header, "_HeaderReader", _OneByOne)
    reference = parse_gguf(path)
    assert ours.metadata == reference.metadata and ours.tensors == reference.tensors
    assert (
        len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
        and len(ours.metadata["tokenizer.ggml.merges"]) > 40000
    )


def test_string_arrays_of_any_bytes_read_as_the_package_reads_them(tmp_path):
    path = str(tmp_path / "strings.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    words = ["", "a", "é", "日本語", "x" * 5000, "tab\tnew\nline", "🙂"]
    writer.add_array("test.words", words)
    writer.add_array("test.raw", [b"ok", b"\xff\xfe not utf-8", b"", b"\xc3"])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_string("test.one", "single")
    writer.add_tensor("w", np.zeros((2, 3), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    meta = parse_gguf(path).metadata
    assert meta["test.words"] == words
    assert meta["test.raw"] == [
        b.decode("utf-8", errors="replace") for b in (b"ok", b"\xff\xfe not utf-8", b"", b"\xc3")
    ]
    assert meta["test.ints"] == [1, 2, 3] and meta["test.one"] == "single"
    theirs = _theirs(path, skip=("test.raw",))  # the package's reader refuses bytes that are not UTF-8
    assert meta["test.words"] == theirs["test.words"]
    reader = gguf.GGUFReader(path)
    assert [(t.name, t.offset, t.nbytes) for t in parse_gguf(path).tensors] == [
        (t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors
    ]


@pytest.mark.parametrize("cut", [40, 200])
def test_a_truncated_header_is_refused(tmp_path, cut):
    src = resolve_model_path(None)
    path = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(cut))
    with pytest.raises(Exception) as e:  # noqa: PT011 - struct.error or GGUFError, never a hang
        parse_gguf(str(path))
    assert e.type.__name__ in {"error", "GGUFError", "ValueError", "IndexError"}
