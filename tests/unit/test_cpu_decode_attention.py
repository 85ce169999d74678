"""srt.kernels.cpu: the native paged decode-attention op against its pure-torch reference.

Each batch lays its sequences out in a KV pool on randomly permuted pages (non-contiguous slots),
fills every slot no sequence owns with NaN and points req_to_token's entries past seq_len at one
of them, so any read outside a sequence poisons the output. The native comparisons need the
extension: the session fixture ``native_op`` builds it once (or finds it built) and skips them
with the build error when that fails; the fallback tests always run.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

import srt.kernels.cpu as kernels
from srt.kernels.cpu import build as kbuild
from srt.kernels.cpu.reference import paged_decode_attention_ref
from tests.helpers.isa import cpuinfo_flags, isa_params
from tests.helpers.threads import with_threads


@dataclass
class Batch:
    q: torch.Tensor  # [bs, H, D] float32
    k_buffer: torch.Tensor  # [S, H_kv, D]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [R, max_ctx]
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs]
    scale: float

    def args(self) -> tuple:
        return (
            self.q,
            self.k_buffer,
            self.v_buffer,
            self.req_to_token,
            self.req_pool_indices,
            self.seq_lens,
            self.scale,
        )


def make_batch(
    seq_lens: list[int],
    page_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    index_dtype: torch.dtype = torch.int64,
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bs = len(seq_lens)
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 3  # a few pages stay unused (NaN)
    num_slots = num_pages * page_size
    k_buffer = torch.full((num_slots, kv_heads, head_dim), float("nan"), dtype=kv_dtype)
    v_buffer = torch.full((num_slots, kv_heads, head_dim), float("nan"), dtype=kv_dtype)
    pages = list(range(num_pages))
    rng.shuffle(pages)
    nan_slot = pages[-1] * page_size
    max_ctx = max(seq_lens, default=0) + 7
    req_to_token = torch.full((bs + 2, max_ctx), nan_slot, dtype=torch.int64)
    rows = list(range(1, bs + 2))  # row 0 stays unused: indices need not start at 0
    rng.shuffle(rows)
    rows = rows[:bs]
    for i, n in enumerate(seq_lens):
        own = [pages.pop(0) for _ in range(math.ceil(n / page_size))]
        slots = torch.tensor(
            [own[t // page_size] * page_size + t % page_size for t in range(n)], dtype=torch.int64
        )
        req_to_token[rows[i], :n] = slots
        k_buffer[slots] = torch.randn(n, kv_heads, head_dim, generator=g).to(kv_dtype)
        v_buffer[slots] = torch.randn(n, kv_heads, head_dim, generator=g).to(kv_dtype)
    q = torch.randn(bs, heads, head_dim, generator=g) * 2.0  # peakier softmax than 1/sqrt(D) alone
    return Batch(
        q,
        k_buffer,
        v_buffer,
        req_to_token.to(index_dtype),
        torch.tensor(rows, dtype=index_dtype),
        torch.tensor(seq_lens, dtype=index_dtype),
        head_dim**-0.5,
    )


def assert_matches(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """|out - ref| <= rel * (output scale) + rel * |ref| elementwise."""
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    scale = max(ref.abs().max().item(), 1e-6)
    torch.testing.assert_close(out, ref, rtol=rel, atol=rel * scale)


# ---------------------------------------------------------------- native op (built once)
@pytest.fixture(scope="session")
def native_op():
    if os.environ.get(kernels.DISABLE_ENV, "0") not in ("", "0"):
        pytest.skip(f"{kernels.DISABLE_ENV} is set")
    try:
        kbuild.build()
    except Exception as e:  # noqa: BLE001 - any build failure skips the native comparisons
        pytest.skip(f"native kernel not built: {kbuild.summarize_error(e)}")
    return torch.ops.srt_cpu.paged_decode_attention


@pytest.fixture(scope="session", params=isa_params())
def isa(request, native_op) -> str:
    """Each instruction set in turn (the ones above what this CPU runs are skipped)."""
    return request.param


def check_isa(native_op, isa: str, batch: Batch, rel: float = 1e-5, split_len: int = 0) -> None:
    assert_matches(native_op(*batch.args(), split_len, isa), paged_decode_attention_ref(*batch.args()), rel)


MIXED_LENS = [1, 2, 15, 16, 17, 33, 100, 255, 256, 257, 600]
GQA = [(4, 4), (9, 3), (16, 2)]  # ratios 1, 3, 8


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("page_size", [1, 16])
def test_parity_mixed_lengths(native_op, isa, page_size, heads, kv_heads, head_dim):
    batch = make_batch(MIXED_LENS, page_size, heads, kv_heads, head_dim, seed=page_size + heads + head_dim)
    check_isa(native_op, isa, batch)


@pytest.mark.parametrize(
    "seq_lens,page_size,heads,kv_heads,head_dim",
    [
        ([4096], 16, 9, 3, 64),  # batch of 1: split and reduced
        ([4096, 1, 3000, 17], 1, 16, 2, 128),
        ([2048, 5], 16, 4, 4, 128),
    ],
)
def test_parity_long_contexts(native_op, isa, seq_lens, page_size, heads, kv_heads, head_dim):
    check_isa(native_op, isa, make_batch(seq_lens, page_size, heads, kv_heads, head_dim, seed=len(seq_lens)))


def test_parity_batch_of_32(native_op, isa):
    lens = random.Random(5).choices(range(1, 513), k=32)
    check_isa(native_op, isa, make_batch(lens, 16, 9, 3, 64, seed=5))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "seq_lens,page_size,heads,kv_heads,head_dim",
    [(MIXED_LENS, 16, 9, 3, 64), ([2000, 3, 300], 1, 16, 2, 128), (MIXED_LENS, 1, 4, 4, 64)],
)
def test_parity_half_precision_kv(native_op, isa, kv_dtype, seq_lens, page_size, heads, kv_heads, head_dim):
    # the reference upcasts the same 16-bit values, so the tolerance is float32's
    check_isa(native_op, isa, make_batch(seq_lens, page_size, heads, kv_heads, head_dim, kv_dtype, seed=7))


BF16_QUERY_SHAPES = [(12, 2, 128), (9, 3, 64), (8, 8, 32), (10, 2, 96), (5, 1, 80), (4, 2, 256)]
BF16_QUERY_SHAPES += [(14, 2, 64), (32, 4, 64), (32, 2, 32)]  # groups of 7, 8, 16: P V's head tiles hold 8


@pytest.mark.parametrize("heads,kv_heads,head_dim", BF16_QUERY_SHAPES)
def test_parity_bf16_kv_bf16_queries(native_op, isa, heads, kv_heads, head_dim):
    """A bf16 model's queries are bf16 values: on a CPU with AVX512-BF16 the AVX-512 path takes both
    products on bf16 dot products (head dims of whole 32-element loads; 80 keeps float32 FMAs): the
    scores exact, P rounded to bf16 for P @ V. Rounding each p by at most 2^-9 of itself moves an
    output by at most 2^-9 of the largest |V| (the softmax sum stays float32's). Queries not all
    bf16 values (the first KV head's of the first sequence here) take float32 FMAs in the same
    call: float32's tolerance."""
    batch = make_batch([700, 1, 33, 300], 1, heads, kv_heads, head_dim, torch.bfloat16, seed=head_dim)
    q = batch.q.to(torch.bfloat16).float()
    q[0, 0, 0] += 1e-3  # not a bf16 value
    batch.q = q
    out, ref = native_op(*batch.args(), 0, isa), paged_decode_attention_ref(*batch.args())
    group = heads // kv_heads
    assert_matches(out[0, :group], ref[0, :group])
    if not (isa == "avx512" and "avx512_bf16" in cpuinfo_flags() and head_dim % 32 == 0):
        assert_matches(out, ref)
        return
    bound = 2**-9 * batch.v_buffer.float().nan_to_num(0.0).abs().max().item()
    err = (out - ref).abs()
    assert torch.isfinite(out).all() and err.max().item() <= bound + 1e-5 * ref.abs().max().item()
    assert err.mean().item() <= bound / 8  # independent roundings mostly cancel
    out[0, :group] = ref[0, :group] = 0.0
    shrink = ((out - ref) * ref).sum().item() / (ref * ref).sum().item()
    assert abs(shrink) < 4e-5  # P rounded to nearest, as torch rounds: truncating it gives -1.2e-4 here


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(5, 1, 36), (8, 2, 100), (7, 1, 72), (2, 1, 20)])
def test_parity_other_shapes(native_op, isa, heads, kv_heads, head_dim):
    """Head dims with a scalar tail and group sizes that mix the 3-, 2- and 1-query tiles."""
    check_isa(native_op, isa, make_batch([1, 40, 130], 16, heads, kv_heads, head_dim, seed=heads))


def test_int32_indices(native_op, isa):
    batch = make_batch([5, 70, 300], 16, 9, 3, 64, seed=3, index_dtype=torch.int32)
    check_isa(native_op, isa, batch)


@pytest.mark.parametrize("seq_len,split_len", [(4096, 256), (3001, 512), (300, 16)])
def test_split_and_reduce_equals_unsplit(native_op, isa, seq_len, split_len):
    batch = make_batch([seq_len], 16, 9, 3, 64, seed=seq_len)
    whole = native_op(*batch.args(), 1 << 40, isa)
    split = native_op(*batch.args(), split_len, isa)
    assert_matches(split, whole, rel=2e-6)
    check_isa(native_op, isa, batch, split_len=split_len)


def test_thread_count_does_not_change_results(native_op):
    batch = make_batch([4096, 33, 700], 1, 9, 3, 64, seed=11)
    one, many = with_threads(lambda: native_op(*batch.args()), (1, max(2, torch.get_num_threads())))
    assert_matches(many, one, rel=2e-6)


def test_zero_length_sequence_gives_zeros(native_op):
    batch = make_batch([3, 0, 20], 16, 9, 3, 64, seed=2)
    out = native_op(*batch.args())
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_matches(out, paged_decode_attention_ref(*batch.args()))


def test_strided_q_and_empty_batch(native_op):
    batch = make_batch([9, 50], 1, 9, 3, 64, seed=4)
    wide = torch.randn(2, 9, 128)
    wide[..., :64] = batch.q
    batch.q = wide[..., :64]  # last dim contiguous, rows strided: read in place
    assert_matches(native_op(*batch.args()), paged_decode_attention_ref(*batch.args()))
    empty = make_batch([4], 1, 9, 3, 64)
    out = native_op(
        empty.q[:0],
        empty.k_buffer,
        empty.v_buffer,
        empty.req_to_token,
        empty.req_pool_indices[:0],
        empty.seq_lens[:0],
        0.125,
    )
    assert out.shape == (0, 9, 64)


def test_meta_tensors_give_the_output_shape(native_op):
    out = native_op(
        torch.empty(3, 9, 64, device="meta"),
        torch.empty(100, 3, 64, device="meta", dtype=torch.float16),
        torch.empty(100, 3, 64, device="meta", dtype=torch.float16),
        torch.empty(4, 50, device="meta", dtype=torch.int64),
        torch.empty(3, device="meta", dtype=torch.int64),
        torch.empty(3, device="meta", dtype=torch.int64),
        0.125,
    )
    assert out.shape == (3, 9, 64) and out.dtype == torch.float32 and out.device.type == "meta"


def _bad(batch: Batch, **changes) -> tuple:
    fields = {
        "q": batch.q,
        "k_buffer": batch.k_buffer,
        "v_buffer": batch.v_buffer,
        "req_to_token": batch.req_to_token,
        "req_pool_indices": batch.req_pool_indices,
        "seq_lens": batch.seq_lens,
        "scale": batch.scale,
    }
    fields.update(changes)
    return tuple(fields.values())


BAD_INPUTS = {
    "q float64": (lambda b: {"q": b.q.double()}, "q must be float32"),
    "q 2-D": (lambda b: {"q": b.q[0]}, r"q must be \[bs, H, D\]"),
    "kv int8": (
        lambda b: {"k_buffer": b.k_buffer.to(torch.int8), "v_buffer": b.v_buffer.to(torch.int8)},
        "float32, float16 or bfloat16",
    ),
    "k/v dtypes differ": (lambda b: {"v_buffer": b.v_buffer.half()}, "v_buffer dtype"),
    "k/v shapes differ": (lambda b: {"v_buffer": b.v_buffer[:-1]}, "v_buffer shape"),
    "head dim": (lambda b: {"q": b.q[..., :32].contiguous()}, "head dim mismatch"),
    "heads not a multiple": (lambda b: {"q": b.q[:, :8].contiguous()}, "multiple of k_buffer's heads"),
    "req_to_token float": (
        lambda b: {"req_to_token": b.req_to_token.float()},
        "req_to_token must be int64/int32",
    ),
    "seq_lens length": (lambda b: {"seq_lens": b.seq_lens[:1]}, "seq_lens must be"),
    "seq_len > max_ctx": (lambda b: {"seq_lens": b.seq_lens + 1000}, "outside"),
    "negative seq_len": (lambda b: {"seq_lens": -b.seq_lens}, "outside"),
    "row out of range": (lambda b: {"req_pool_indices": b.req_pool_indices + 100}, "req_pool_indices"),
    "slot out of range": (lambda b: {"req_to_token": b.req_to_token + 10_000}, "slot outside"),
    "negative slot": (lambda b: {"req_to_token": b.req_to_token - 10_000}, "slot outside"),
    "kv last dim strided": (
        lambda b: {"k_buffer": b.k_buffer.transpose(1, 2).contiguous().transpose(1, 2)},
        "contiguous last dim",
    ),
    "scale nan": (lambda b: {"scale": float("nan")}, "scale must be finite"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(native_op, case):
    batch = make_batch([5, 30], 16, 9, 3, 64, seed=1)
    change, match = BAD_INPUTS[case]
    with pytest.raises(RuntimeError, match=match):
        native_op(*_bad(batch, **change(batch)))


def test_bad_isa_or_split_raises(native_op):
    batch = make_batch([5], 16, 9, 3, 64)
    with pytest.raises(RuntimeError, match="isa must be"):
        native_op(*batch.args(), 0, "sse9")
    with pytest.raises(RuntimeError, match="split_len must be"):
        native_op(*batch.args(), -1, "")


def test_public_function_uses_the_native_op(native_op, monkeypatch):
    monkeypatch.setattr(kernels, "_state", None)
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    assert kernels.native_available()
    assert kernels.kernel_status().startswith("native:")
    batch = make_batch([3, 100], 1, 9, 3, 64, seed=9)
    assert torch.equal(kernels.paged_decode_attention(*batch.args()), native_op(*batch.args()))


# ---------------------------------------------------------------- fallback (always runs)
@pytest.fixture
def fresh_state(monkeypatch):
    """kernels' load state reset for the test and restored after it."""
    monkeypatch.setattr(kernels, "_state", None)
    return monkeypatch


def test_disable_env_forces_the_fallback(fresh_state):
    fresh_state.setenv(kernels.DISABLE_ENV, "1")
    assert kernels.load(build_if_missing=True) is False
    assert not kernels.native_available()
    status = kernels.kernel_status()
    assert status.startswith("fallback:") and kernels.DISABLE_ENV in status
    batch = make_batch([1, 20, 77], 16, 9, 3, 64, seed=6)
    assert torch.equal(
        kernels.paged_decode_attention(*batch.args()), paged_decode_attention_ref(*batch.args())
    )


def test_not_built_falls_back_without_compiling(fresh_state):
    fresh_state.delenv(kernels.DISABLE_ENV, raising=False)
    fresh_state.setattr(kernels, "_op_registered", lambda: False)
    fresh_state.setattr(kbuild, "prebuilt_library", lambda: None)

    def no_build(verbose: bool = False):
        raise AssertionError("load() must not compile unless asked")

    fresh_state.setattr(kbuild, "build", no_build)
    assert not kernels.native_available()
    assert (
        "not built" in kernels.kernel_status()
        and "python -m srt.kernels.cpu.build" in kernels.kernel_status()
    )
    batch = make_batch([4, 9], 1, 4, 4, 64, kv_dtype=torch.float16, seed=8)
    assert torch.equal(
        kernels.paged_decode_attention(*batch.args()), paged_decode_attention_ref(*batch.args())
    )


def test_build_failure_falls_back_with_the_reason(fresh_state):
    fresh_state.delenv(kernels.DISABLE_ENV, raising=False)
    fresh_state.setattr(kernels, "_op_registered", lambda: False)
    fresh_state.setattr(kbuild, "prebuilt_library", lambda: None)

    def failing_build(verbose: bool = False):
        raise RuntimeError("Error building extension\nfoo.cpp:1:1: error: no such instruction")

    fresh_state.setattr(kbuild, "build", failing_build)
    assert kernels.load(build_if_missing=True) is False
    status = kernels.kernel_status()
    assert status.startswith("fallback:") and "build failed" in status and "no such instruction" in status


def test_broken_library_falls_back(fresh_state, tmp_path):
    fresh_state.delenv(kernels.DISABLE_ENV, raising=False)
    fresh_state.setattr(kernels, "_op_registered", lambda: False)
    broken = tmp_path / "srt_cpu_kernels.so"
    broken.write_bytes(b"not an ELF file")
    fresh_state.setattr(kbuild, "prebuilt_library", lambda: broken)
    assert kernels.load() is False
    assert "load failed" in kernels.kernel_status()


def test_reference_rejects_bad_shapes():
    batch = make_batch([5], 16, 9, 3, 64)
    with pytest.raises(ValueError, match="q must be float32"):
        paged_decode_attention_ref(*_bad(batch, q=batch.q.double()))
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention_ref(*_bad(batch, q=batch.q[:, :8]))
