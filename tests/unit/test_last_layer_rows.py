"""A prefill's last layer takes only the rows the step reads past its attention.

``LogitsProcessor.rows_read`` names the rows an EXTEND / MIXED step reads (each sequence's
last); the decoder then writes every row's K and V and runs every row's attention in its last
layer, but takes only those rows through ``o_proj`` and the MLP. Tiny random models of each
decoder family (Llama, Qwen2, Qwen3, Gemma 2 / 3, a MoE) over the real pools and the
torch-native backend: the logits equal those of the whole rows' hidden states, the last MLP
sees one row per sequence, and every row goes through where the step reads more (prompt
logprobs, pooling) or where LoRA adapters run (their row layout covers every row).
"""

from __future__ import annotations

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.layers.forward_batch import ForwardMode
from srt.model_loader import get_model
from tests.helpers.pool_runner import PoolRunner
from tests.helpers.tiny_gemma import save_tiny_gemma
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.tiny_moe import save_tiny_moe
from tests.helpers.tolerance import assert_reordered_close, reduction_len

KINDS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2_moe")


def _save(kind: str, path) -> str:
    if kind.startswith("gemma"):
        return save_tiny_gemma(kind, path, seed=5)
    if kind.endswith("_moe"):
        return save_tiny_moe(kind, path, seed=5)
    return save_tiny_model(kind, path, seed=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: get_model(ModelConfig(_save(kind, tmp_path_factory.mktemp(kind)))) for kind in KINDS}


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _last_mlp_rows(model) -> list[int]:
    """The row counts the last layer's MLP is called with, appended as it runs."""
    seen: list[int] = []
    model.model.layers[-1].mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("kind", KINDS)
@torch.inference_mode()
def test_logits_of_the_kept_rows_equal_the_whole_rows(models, kind):
    model = models[kind]
    vocab = model.config.vocab_size
    steps = PoolRunner(model, model.config)
    seen = _last_mlp_rows(model)
    a, b, c = _prompt(30, 1, vocab), _prompt(1, 2, vocab), _prompt(12, 3, vocab)
    k = reduction_len(model.config)
    # a whole-prompt EXTEND of three; a prefixed extend (chunked prefill) beside a new prompt;
    # a MIXED step: an extending sequence, then two decoding ones
    plan = [
        (ForwardMode.EXTEND, [(0, a[:20], 0), (1, b, 0), (2, c[:7], 0)], {}),
        (ForwardMode.EXTEND, [(0, a[20:29], 20), (3, c, 0)], {}),
        (ForwardMode.MIXED, [(2, c[7:], 7), (0, a[29:], 29), (1, [5], 1)], {"num_extend_seqs": 1}),
    ]
    for mode, seqs, kw in plan:
        fb = steps.batch(mode, seqs, **kw)
        seen.clear()
        got = model(fb.input_ids, fb.positions, fb).next_token_logits
        assert seen == [len(seqs)], f"{mode.name}: the last MLP ran {seen} rows, not one per sequence"
        # the same step with every row through (its KV writes are the same values again)
        hidden = model.model(fb.input_ids, fb.positions, fb)
        assert hidden.shape[0] == fb.input_ids.shape[0] > len(seqs)
        ref = model.logits_processor(hidden, model.lm_head, fb).next_token_logits
        assert ref.std() > 0.1
        assert_reordered_close(got, ref, k, what=f"{kind} {mode.name} logits")


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@torch.inference_mode()
def test_every_row_goes_through_where_the_step_reads_more(models, kind):
    model = models[kind]
    steps = PoolRunner(model, model.config)
    seen = _last_mlp_rows(model)
    seqs = [(0, _prompt(9, 4, model.config.vocab_size), 0), (1, _prompt(5, 5, model.config.vocab_size), 0)]

    fb = steps.batch(ForwardMode.EXTEND, seqs, return_logprob=True, extend_logprob_start_lens_cpu=[0, 3])
    out = model(fb.input_ids, fb.positions, fb)
    assert seen == [14] and len(out.input_token_logprobs[0]) == 9

    seen.clear()
    fb = steps.batch(ForwardMode.EXTEND, seqs, pool_methods=["mean", "last"])
    assert model.logits_processor.rows_read(fb) is None
    model(fb.input_ids, fb.positions, fb)
    assert seen == [14]

    seen.clear()
    fb = steps.batch(ForwardMode.EXTEND, seqs)
    fb.lora = object()  # adapters running: their per-row layout covers all 14 rows
    model(fb.input_ids, fb.positions, fb)
    assert seen == [14]

    seen.clear()
    fb = steps.batch(ForwardMode.EXTEND, seqs)
    assert model.logits_processor.rows_read(fb).tolist() == [8, 13]
    model(fb.input_ids, fb.positions, fb)
    assert seen == [2]


def test_rows_read_is_none_where_nothing_would_be_saved(models):
    lp = models["llama"].logits_processor
    steps = PoolRunner(models["llama"], models["llama"].config)
    assert lp.rows_read(steps.batch(ForwardMode.DECODE, [(0, [3], 4), (1, [4], 6)])) is None
    assert lp.rows_read(steps.batch(ForwardMode.EXTEND, [(0, [3], 0), (1, [4], 0)])) is None
    assert lp.rows_read(steps.batch(ForwardMode.EXTEND, [(0, [3, 4, 5], 0)])).tolist() == [2]
