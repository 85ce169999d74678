"""Pooling math (srt/layers/pooler.py), its chunked accumulation, the checkpoint's pooling config,
normalisation / base64 and the embedding request checks."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from srt.configs.pooling_config import is_embedding_checkpoint, read_pooling_config
from srt.entrypoints.openai.protocol_embedding import ScoreRequest, check_embedding_input
from srt.entrypoints.openai.serving_embedding import to_base64
from srt.layers import pooler
from srt.managers.tokenizer.pooled_run import normalize_embedding
from srt.utils.errors import RequestError


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_chunked_pooling_equals_whole(method):
    """Pooling a prompt in chunks (combine per chunk, finish at the end) equals pooling it whole."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(23, 8, generator=gen)
    want = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[method]
    whole = pooler.pool_segments(h, [method], [23], [0])[0]
    assert torch.allclose(torch.tensor(pooler.finish(method, whole, 23)), want, atol=1e-6)
    acc = None
    for start, end in [(0, 5), (5, 16), (16, 23)]:
        acc = pooler.combine(
            method, acc, pooler.pool_segments(h[start:end], [method], [end - start], [start])[0]
        )
    assert torch.allclose(torch.tensor(pooler.finish(method, acc, 23)), want, atol=1e-5)


def test_pool_segments_batch_rows():
    h = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # seq 0: rows 0-2, seq 1: 3, seq 2: 4-5
    out = pooler.pool_segments(h, ["mean", "", "last"], [3, 1, 2], [0, 0, 4])
    assert out[0].tolist() == [6.0, 9.0]  # "mean": the partial sum (divided by finish)
    assert out[1] is None and out[2].tolist() == [10.0, 11.0]
    assert pooler.pool_segments(h, ["cls"], [6], [3]) == [None]  # not the chunk holding position 0
    with pytest.raises(ValueError):
        pooler.pool_segments(h, ["max"], [6], [0])


def test_label_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    out = pooler.label_logprobs(logits, [[2, 0], []])
    ref = torch.log_softmax(logits[0], dim=-1)
    assert out[1] == [] and out[0] == pytest.approx([ref[2].item(), ref[0].item()])


def test_pooling_config(tmp_path):
    assert read_pooling_config(str(tmp_path)).method == "last" and not is_embedding_checkpoint(str(tmp_path))
    assert not is_embedding_checkpoint(None) and not is_embedding_checkpoint(str(tmp_path / "x.gguf"))
    modules = [{"idx": 1, "name": "1", "path": "pool", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert is_embedding_checkpoint(str(tmp_path)) and read_pooling_config(str(tmp_path)).method == "cls"
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert read_pooling_config(str(tmp_path)).method == "last"


def test_normalize_and_base64():
    assert normalize_embedding([3.0, 4.0, 12.0], True, 2) == pytest.approx([0.6, 0.8])
    assert normalize_embedding([3.0, 4.0], False) == [3.0, 4.0]
    assert normalize_embedding([0.0, 0.0]) == [0.0, 0.0]
    raw = base64.b64decode(to_base64([1.5, -2.25]))
    assert struct.unpack("<2f", raw) == (1.5, -2.25)


@pytest.mark.parametrize("bad", ["", [], [""], [[]], [[1], []]])
def test_empty_inputs_rejected(bad):
    with pytest.raises(RequestError):
        check_embedding_input(bad)


def test_score_request_names():
    q, items = ScoreRequest(text_1="q", text_2="a").query_and_items()
    assert (q, items) == ("q", ["a"])
    with pytest.raises(RequestError):
        ScoreRequest(query="q").query_and_items()
    with pytest.raises(RequestError):
        ScoreRequest(query=[1, 2], items=["a"]).query_and_items()
