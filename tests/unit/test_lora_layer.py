"""srt/lora/layer.py: ``LoRABatch.build`` (rows grouped per adapter slot) and ``LinearLoRA`` (the
batched low-rank update) against a plain per-row reference; ``Linear.forward`` with ``.lora`` set."""

from __future__ import annotations

import pytest
import torch

from srt.layers.linear import Linear
from srt.lora.adapter import LinearLoRAWeights
from srt.lora.layer import LinearLoRA, LoRABatch, LoRAState


def rows_of(group_rows) -> list[int]:
    if isinstance(group_rows, slice):
        return list(range(group_rows.start, group_rows.stop))
    assert group_rows.dtype == torch.int64
    return group_rows.tolist()


def expected_rows(slots: list[int], lens: list[int]) -> dict[int, list[int]]:
    """Slot -> the batch rows of its sequences (the reference grouping)."""
    out: dict[int, list[int]] = {}
    start = 0
    for s, n in zip(slots, lens):
        if s >= 0:
            out.setdefault(s, []).extend(range(start, start + n))
        start += n
    return {s: r for s, r in out.items() if r}


# ---------------------------------------------------------------- LoRABatch.build
def test_build_none_without_adapter_rows():
    assert LoRABatch.build([-1, -1], [3, 5], "cpu") is None
    assert LoRABatch.build([], [], "cpu") is None
    # an adapter sequence with no rows this step runs nothing
    assert LoRABatch.build([-1, 2], [4, 0], "cpu") is None


def test_build_merges_adjacent_runs_into_one_slice():
    batch = LoRABatch.build([1, 1, 1, -1, 0], [2, 3, 1, 4, 2], "cpu")
    assert batch is not None and batch.num_rows == 12
    groups = dict(batch.groups)
    assert set(groups) == {0, 1}  # the base rows (slot -1) have no group
    assert groups[1] == slice(0, 6)
    assert groups[0] == slice(10, 12)


def test_build_scattered_rows_give_an_index_tensor():
    slots, lens = [0, -1, 0, 1, 0, 1], [2, 3, 1, 2, 3, 1]
    batch = LoRABatch.build(slots, lens, "cpu")
    assert batch is not None and batch.num_rows == sum(lens)
    groups = dict(batch.groups)
    assert all(isinstance(groups[s], torch.Tensor) for s in (0, 1))
    assert {s: rows_of(r) for s, r in groups.items()} == expected_rows(slots, lens)


@pytest.mark.parametrize("seed", range(5))
def test_build_random_layouts_match_the_reference(seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = 12
    slots = (torch.randint(-1, 3, (n,), generator=gen)).tolist()
    lens = torch.randint(0, 4, (n,), generator=gen).tolist()
    batch = LoRABatch.build(slots, lens, "cpu")
    want = expected_rows(slots, lens)
    if not want:
        assert batch is None
        return
    assert batch.num_rows == sum(lens)
    got = {s: rows_of(r) for s, r in batch.groups}
    assert got == want
    assert len(batch.groups) == len(want)  # one group per slot


# ---------------------------------------------------------------- LinearLoRA
IN, OUT = 6, 5


def random_weights(rank: int, seed: int) -> LinearLoRAWeights:
    gen = torch.Generator().manual_seed(seed)
    return LinearLoRAWeights(torch.randn(rank, IN, generator=gen), torch.randn(OUT, rank, generator=gen))


def reference(x: torch.Tensor, out: torch.Tensor, row_slots: list[int], slots: dict) -> torch.Tensor:
    """Row by row: out[i] + x[i] @ A.T @ B.T of the row's slot (unchanged without one)."""
    ref = out.clone()
    for i, s in enumerate(row_slots):
        w = slots.get(s)
        if w is not None:
            ref[i] += (x[i] @ w.A.t()) @ w.B.t()
    return ref


def per_row_slots(slots: list[int], lens: list[int]) -> list[int]:
    return [s for s, n in zip(slots, lens) for _ in range(n)]


@pytest.mark.parametrize(
    "slots,lens",
    [
        ([0, 0, 1], [3, 2, 4]),  # contiguous groups: slices
        ([0, 1, 0, -1, 1, 2], [2, 1, 3, 2, 2, 1]),  # scattered groups: index_add
        ([-1, 2, -1], [3, 4, 1]),  # one run between base rows
    ],
)
def test_linear_lora_matches_per_row_reference(slots, lens):
    state = LoRAState()
    lora = LinearLoRA(state)
    lora.slots = {0: random_weights(4, 0), 1: random_weights(2, 1), 2: random_weights(3, 2)}
    state.batch = LoRABatch.build(slots, lens, "cpu")
    n = sum(lens)
    x, out = torch.randn(n, IN), torch.randn(n, OUT)
    want = reference(x, out, per_row_slots(slots, lens), lora.slots)
    got = lora(x, out.clone())
    torch.testing.assert_close(got, want)
    base_rows = [i for i, s in enumerate(per_row_slots(slots, lens)) if s < 0]
    assert torch.equal(got[base_rows], out[base_rows])


def test_linear_lora_updates_out_in_place():
    state = LoRAState()
    lora = LinearLoRA(state)
    lora.slots = {0: random_weights(4, 0), 1: random_weights(4, 1)}
    for slots, lens in (([0, 0], [2, 3]), ([0, 1, 0], [2, 1, 2])):
        state.batch = LoRABatch.build(slots, lens, "cpu")
        x, out = torch.randn(5, IN), torch.randn(5, OUT)
        want = reference(x, out, per_row_slots(slots, lens), lora.slots)
        lora(x, out)
        torch.testing.assert_close(out, want)


def test_slots_the_layer_lacks_leave_their_rows_unchanged():
    state = LoRAState()
    lora = LinearLoRA(state)
    lora.slots = {1: random_weights(3, 5)}  # slot 0 and 2 have no update in this layer
    slots, lens = [0, 1, 2, 1], [2, 2, 2, 1]
    state.batch = LoRABatch.build(slots, lens, "cpu")
    x, out = torch.randn(7, IN), torch.randn(7, OUT)
    got = lora(x, out.clone())
    rows = per_row_slots(slots, lens)
    untouched = [i for i, s in enumerate(rows) if s != 1]
    assert torch.equal(got[untouched], out[untouched])
    torch.testing.assert_close(got, reference(x, out, rows, lora.slots))
    assert not torch.equal(got, out)


def test_no_batch_or_no_slots_returns_out_as_is():
    state = LoRAState()
    lora = LinearLoRA(state)
    x, out = torch.randn(3, IN), torch.randn(3, OUT)
    lora.slots = {0: random_weights(2, 0)}
    assert torch.equal(lora(x, out.clone()), out)  # state.batch None
    empty = LinearLoRA(state)
    state.batch = LoRABatch.build([0], [3], "cpu")
    assert torch.equal(empty(x, out.clone()), out)


def test_3d_input_is_flattened_to_rows():
    state = LoRAState()
    lora = LinearLoRA(state)
    lora.slots = {0: random_weights(2, 0)}
    state.batch = LoRABatch.build([-1, 0], [3, 3], "cpu")
    x, out = torch.randn(2, 3, IN), torch.randn(2, 3, OUT)
    got = lora(x, out.clone())
    want = reference(x.reshape(6, IN), out.reshape(6, OUT), [-1] * 3 + [0] * 3, lora.slots)
    torch.testing.assert_close(got.reshape(6, OUT), want)


def test_row_count_mismatch_raises():
    state = LoRAState()
    lora = LinearLoRA(state)
    lora.slots = {0: random_weights(2, 0)}
    state.batch = LoRABatch.build([0, -1], [2, 2], "cpu")
    with pytest.raises(RuntimeError, match="3 rows of a 4-row batch"):
        lora(torch.randn(3, IN), torch.randn(3, OUT))


# ---------------------------------------------------------------- Linear.forward with .lora
def test_linear_forward_adds_the_lora_update():
    gen = torch.Generator().manual_seed(7)
    layer = Linear(IN, OUT, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(OUT, IN, generator=gen))
        layer.bias.copy_(torch.randn(OUT, generator=gen))
    x = torch.randn(5, IN, generator=gen)
    base = x @ layer.weight.t() + layer.bias
    torch.testing.assert_close(layer(x), base)  # no .lora: the plain layer

    state = LoRAState()
    layer.lora = LinearLoRA(state)
    w = random_weights(3, 9)
    layer.lora.slots[0] = w
    state.batch = LoRABatch.build([0, -1], [2, 3], "cpu")
    got = layer(x)
    torch.testing.assert_close(got[:2], base[:2] + x[:2] @ w.A.t() @ w.B.t())
    torch.testing.assert_close(got[2:], base[2:])
    state.batch = None  # a step without adapter rows
    torch.testing.assert_close(layer(x), base)
