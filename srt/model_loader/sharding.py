"""Tensor parallelism as a transformation of a built model (before its weights are loaded).

``shard_model(model, tp)`` rewrites each layer's shapes for rank ``tp.rank`` of ``tp.size``
(Megatron-style; the rules in ``srt/distributed/partition.py``) and returns the ``ShardPlan``
that tells the weight readers which slice of each checkpoint tensor this rank reads::

    attention (qkv_proj, o_proj, attn)   qkv_proj  column-parallel: the rank's q heads and KV heads
                                         o_proj    row-parallel: the columns of its q heads, then
                                                   all_reduce (forward hook); bias on rank 0 only
                                         attn / the module: local num_heads, num_kv_heads
    MLP (gate_up_proj, down_proj)        gate_up   column-parallel: the rank's intermediate rows
                                         down_proj row-parallel: the same columns, all_reduce
    MoE block (srt/layers/moe.py)        every expert's intermediate dim as for the MLP (checkpoint
                                         names per expert and merged), all_reduce after the
                                         experts; router and shared-expert gate replicated
    VocabEmbedding / LMHead              the rank's vocabulary rows (masked lookup + all_reduce;
                                         the logits processor gathers the logits)

The plan also records, per sharded srt parameter, which part of the whole parameter it is
(``ParamView``), so seeded dummy weights are cut from the single-rank model's values, and so
that a checkpoint storing a fused tensor (``qkv_proj``, ``gate_up_proj``) is cut into the rank's
rows of each part (``fused_rows``).

The model code is unchanged: a rank's model is the same module tree with smaller parameters,
and since the readers hand ``load_weights`` tensors already cut to the rank's slice, its checks
(``load_shard`` part sizes, ``copy_weight`` shapes) hold as for one rank. Modules are found by
their srt layer types and attribute names, and checkpoint names are HF's Llama-family ones
(``q_proj``/``k_proj``/``v_proj`` fused into ``qkv_proj``, ``gate_proj``/``up_proj`` into
``gate_up_proj``), which every registered architecture uses. A ``Linear`` outside these patterns
makes ``shard_model`` raise ``ConfigError`` rather than silently run replicated.

This sits with the loader because it decides what the loader reads; the layers only provide
their ``shard*`` methods and the collectives (``srt.distributed``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from srt.distributed.communication import TPInfo
from srt.distributed.partition import aligned_unit, head_shard, split_range
from srt.layers.linear import Linear, MergedColumnLinear, QKVLinear
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.moe import SparseMoeBlock
from srt.layers.radix_attention import RadixAttention
from srt.layers.vocab_embedding import LMHead, VocabEmbedding
from srt.utils.errors import ConfigError

# vocabulary rows are cut in multiples of 8 where the size allows (x8-packed GGUF heads)
_VOCAB_UNIT = 8


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Read ``size`` entries from ``start`` along ``dim`` (0: rows / output features, 1: columns /
    input features) of a checkpoint tensor."""

    dim: int
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class ParamView:
    """A sharded srt parameter as a part of the whole model's: its ``full_shape`` and the
    ``(start, size)`` ranges along ``dim`` it keeps, concatenated (a fused qkv weight keeps three)."""

    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]


class ShardPlan:
    """Per checkpoint module name (``model.layers.3.self_attn.q_proj``), the slice this rank
    reads of its weight (and bias). A row-parallel layer's bias (its slice is along dim 1) is read
    whole by rank 0 and skipped by the others. ``views``: per srt parameter name, its
    ``ParamView`` (what dummy weights draw, so that they equal one rank's whole model's)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slices: dict[str, TensorSlice] = {}
        self.views: dict[str, ParamView] = {}

    def view(self, param: str, full_shape: tuple[int, ...], dim: int, *ranges: tuple[int, int]) -> None:
        self.views[param] = ParamView(tuple(full_shape), dim, ranges)

    def add(self, module: str, dim: int, start: int, size: int) -> None:
        self.slices[module] = TensorSlice(dim, start, size)

    def _entry(self, name: str) -> tuple[TensorSlice | None, bool]:
        module, _, kind = name.rpartition(".")
        s = self.slices.get(module)
        if s is not None and kind == "bias" and s.dim == 1:
            return None, self.rank == 0
        return s, True

    def lookup(self, name: str) -> TensorSlice | None:
        """The slice of checkpoint tensor ``name`` to read; None: the whole tensor."""
        return self._entry(name)[0]

    def skip(self, name: str) -> bool:
        """True when this rank reads nothing of ``name`` (another rank's row-parallel bias)."""
        return not self._entry(name)[1]

    def fused_rows(self, name: str) -> tuple[tuple[int, int], ...] | None:
        """A checkpoint tensor stored fused (Phi-3's ``qkv_proj`` / ``gate_up_proj``, named as
        the srt parameter it fills): the ``(start, rows)`` ranges this rank keeps, to be read and
        concatenated; None for every other tensor (``lookup`` says what to read of those)."""
        view = self.views.get(name)
        if view is None or view.dim != 0 or self.lookup(name) is not None:
            return None
        return view.ranges


def _shard_attention(prefix: str, module: nn.Module, tp: TPInfo, plan: ShardPlan) -> None:
    qkv: QKVLinear = module.qkv_proj
    attn: RadixAttention = module.attn
    o_proj: Linear = module.o_proj
    hs = head_shard(qkv.num_heads, qkv.num_kv_heads, tp.size, tp.rank)
    d = qkv.head_dim
    q_part, kv_part = (hs.q_start * d, hs.q_count * d), (hs.kv_start * d, hs.kv_count * d)
    q_size, kv_size = qkv.q_size, qkv.kv_size
    qkv_rows = (q_part, (q_size + kv_part[0], kv_part[1]), (q_size + kv_size + kv_part[0], kv_part[1]))
    plan.view(f"{prefix}.qkv_proj.weight", tuple(qkv.weight.shape), 0, *qkv_rows)
    if qkv.bias is not None:
        plan.view(f"{prefix}.qkv_proj.bias", tuple(qkv.bias.shape), 0, *qkv_rows)
    plan.view(f"{prefix}.o_proj.weight", tuple(o_proj.weight.shape), 1, q_part)
    qkv.shard_heads(hs.q_count, hs.kv_count)
    o_proj.shard(hs.q_count * d, o_proj.out_features, keep_bias=tp.rank == 0)
    attn.num_heads, attn.num_kv_heads = hs.q_count, hs.kv_count
    if hasattr(module, "num_heads"):
        module.num_heads, module.num_kv_heads = hs.q_count, hs.kv_count
    plan.add(f"{prefix}.q_proj", 0, *q_part)
    plan.add(f"{prefix}.k_proj", 0, *kv_part)
    plan.add(f"{prefix}.v_proj", 0, *kv_part)
    plan.add(f"{prefix}.o_proj", 1, *q_part)
    o_proj.register_forward_hook(lambda _m, _inp, out: tp.all_reduce(out))


def _shard_mlp(prefix: str, module: nn.Module, tp: TPInfo, plan: ShardPlan) -> None:
    gate_up: MergedColumnLinear = module.gate_up_proj
    down: Linear = module.down_proj
    inter = down.in_features
    start, size = split_range(inter, tp.size, tp.rank, aligned_unit(inter, tp.size))
    parts = [(i * inter + start, size) for i in range(len(gate_up.output_sizes))]
    plan.view(f"{prefix}.gate_up_proj.weight", tuple(gate_up.weight.shape), 0, *parts)
    if gate_up.bias is not None:
        plan.view(f"{prefix}.gate_up_proj.bias", tuple(gate_up.bias.shape), 0, *parts)
    plan.view(f"{prefix}.down_proj.weight", tuple(down.weight.shape), 1, (start, size))
    gate_up.shard_outputs(gate_up.in_features, [size] * len(gate_up.output_sizes))
    down.shard(size, down.out_features, keep_bias=tp.rank == 0)
    plan.add(f"{prefix}.gate_proj", 0, start, size)
    plan.add(f"{prefix}.up_proj", 0, start, size)
    plan.add(f"{prefix}.down_proj", 1, start, size)
    down.register_forward_hook(lambda _m, _inp, out: tp.all_reduce(out))


def _shard_moe(prefix: str, module: SparseMoeBlock, tp: TPInfo, plan: ShardPlan) -> set[int]:
    """Each expert's intermediate dim cut like a dense MLP's (gate/up rows, down columns, then
    all_reduce after the experts); router and shared-expert gate replicated. Returns the ids of
    the replicated Linears (the shared expert itself is a gated MLP, cut by ``_shard_mlp``)."""
    experts = module.experts
    inter = experts.intermediate_size
    start, size = split_range(inter, tp.size, tp.rank, aligned_unit(inter, tp.size))
    shape = tuple(experts.gate_up_proj.shape)
    plan.view(f"{prefix}.experts.gate_up_proj", shape, 1, (start, size), (inter + start, size))
    plan.view(f"{prefix}.experts.down_proj", tuple(experts.down_proj.shape), 2, (start, size))
    for name, _part, dim in module.checkpoint_expert_modules(prefix):
        plan.add(name, dim, start, size)
    experts.shard(size)
    experts.register_forward_hook(lambda _m, _inp, out: tp.all_reduce(out))
    return {id(module.gate), id(module.shared_expert_gate)}


def vocab_sizes(vocab: int, tp_size: int) -> list[tuple[int, int]]:
    """``(start, rows)`` of each rank's vocabulary slice."""
    unit = _VOCAB_UNIT if vocab % _VOCAB_UNIT == 0 and vocab // _VOCAB_UNIT >= tp_size else 1
    return [split_range(vocab, tp_size, r, unit) for r in range(tp_size)]


def shard_model(model: nn.Module, tp: TPInfo) -> ShardPlan:
    """Rewrite ``model`` (built, not loaded) for rank ``tp.rank``; see the module docstring.
    Raises ``ConfigError`` for a layout it cannot shard."""
    plan = ShardPlan(tp.rank)
    covered: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(getattr(module, "qkv_proj", None), QKVLinear) and hasattr(module, "o_proj"):
            _shard_attention(name, module, tp, plan)
            covered |= {id(module.qkv_proj), id(module.o_proj)}
        elif isinstance(getattr(module, "gate_up_proj", None), MergedColumnLinear) and hasattr(
            module, "down_proj"
        ):
            _shard_mlp(name, module, tp, plan)
            covered |= {id(module.gate_up_proj), id(module.down_proj)}
        elif isinstance(module, SparseMoeBlock):
            covered |= _shard_moe(name, module, tp, plan)
        elif isinstance(module, VocabEmbedding | LMHead):
            parts = vocab_sizes(module.weight.shape[0], tp.size)
            plan.view(f"{name}.weight", tuple(module.weight.shape), 0, parts[tp.rank])
            module.shard_vocab(*parts[tp.rank], tp)
            plan.add(name, 0, *parts[tp.rank])
        elif isinstance(module, LogitsProcessor):
            module.shard_vocab([n for _, n in vocab_sizes(module.vocab_size, tp.size)], tp)
    for name, module in model.named_modules():
        if (
            isinstance(module, Linear)
            and id(module) not in covered
            and not getattr(module, "replicated", False)
        ):
            raise ConfigError(
                f"tensor parallelism: do not know how to shard {name} ({type(module).__name__})"
            )
    return plan
