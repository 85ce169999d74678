"""srt/lora/config.py and srt/lora/adapter.py: PEFT's adapter_config.json (scaling, target_modules,
each refusal by name) and ``build_adapter`` laying a peft-written adapter onto a tiny srt Llama's fused
layers (stacked A / block-placed B, scaling folded in; each fused layer's update equals peft's
per-module deltas concatenated), its refusals, and the tensor-parallel slices (column-parallel: the
rank's rows of B; row-parallel: its columns of A; Phi-3's checkpoint-fused layers: its rows)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.distributed import TPInfo
from srt.lora.adapter import build_adapter, read_tensors
from srt.lora.config import LoRAConfig
from srt.lora.layer import LinearLoRA, LoRABatch, LoRAState
from srt.model_loader import get_model
from srt.utils.errors import LoRAError
from tests.helpers.lora_adapters import ALL_TARGETS, peft_reference_model, rewrite_adapter, save_peft_adapter
from tests.helpers.tiny_models import build_tiny_hf_model, save_hf_dir

SEED = 0
PREFIX = "base_model.model."
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def load_llama():
    return build_tiny_hf_model("llama", seed=SEED)


# ---------------------------------------------------------------- LoRAConfig
BASE_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def test_scaling_is_alpha_over_r_or_over_sqrt_r_with_rslora():
    plain = LoRAConfig.from_dict({**BASE_CONFIG, "r": 16, "lora_alpha": 8})
    assert plain.rank == 16 and plain.scaling == pytest.approx(8 / 16)
    rs = LoRAConfig.from_dict({**BASE_CONFIG, "r": 16, "lora_alpha": 8, "use_rslora": True})
    assert rs.scaling == pytest.approx(8 / math.sqrt(16))
    # PEFT's default alpha is r when the file has none
    assert LoRAConfig.from_dict({"r": 4, "target_modules": ["q_proj"]}).scaling == pytest.approx(1.0)


def test_target_modules_list_and_regex_match_as_peft_does():
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.10.self_attn.v_proj",
        "lm_head",
    ]
    for targets in (
        ["q_proj", "v_proj"],
        ["self_attn.k_proj", "down_proj"],  # PEFT matches a dotted entry as a suffix of the name
        r".*\.layers\.1\.self_attn\.(q|v)_proj",
        r".*(k|down)_proj",
    ):
        ours = LoRAConfig.from_dict({**BASE_CONFIG, "target_modules": targets})
        peft = LoraConfig(r=8, target_modules=targets)
        for name in names:
            assert ours.targets(name) == bool(check_target_module_exists(peft, name)), (targets, name)
    regex = LoRAConfig.from_dict({**BASE_CONFIG, "target_modules": r".*\.layers\.1\.self_attn\.(q|v)_proj"})
    assert regex.target_modules == r".*\.layers\.1\.self_attn\.(q|v)_proj"
    assert regex.targets("model.layers.1.self_attn.v_proj")
    assert not regex.targets("model.layers.0.self_attn.v_proj")


@pytest.mark.parametrize(
    "key,value",
    [
        ("modules_to_save", ["lm_head"]),
        ("use_dora", True),
        ("rank_pattern", {"q_proj": 4}),
        ("alpha_pattern", {"q_proj": 4}),
        ("layers_to_transform", [0]),
        ("fan_in_fan_out", True),
        ("layer_replication", [[0, 1]]),
        ("bias", "lora_only"),
        ("bias", "all"),
        ("peft_type", "IA3"),
        ("peft_type", "PREFIX_TUNING"),
    ],
)
def test_unsupported_options_are_refused_by_name(key: str, value):
    with pytest.raises(LoRAError, match=key):
        LoRAConfig.from_dict({**BASE_CONFIG, key: value})


def test_peft_defaults_for_refused_keys_are_accepted(tmp_path):
    # peft writes these keys with empty / false values: they must not trip the refusals
    path = save_peft_adapter(load_llama, tmp_path / "a", ["q_proj"], rank=4, seed=1)
    with open(os.path.join(path, "adapter_config.json")) as f:
        raw = json.load(f)
    assert {"modules_to_save", "use_dora", "rank_pattern", "alpha_pattern", "bias"} <= set(raw)
    cfg = LoRAConfig.from_dir(path)
    assert (cfg.rank, cfg.alpha, cfg.use_rslora, cfg.target_modules) == (4, 8.0, False, ("q_proj",))


@pytest.mark.parametrize(
    "edit,key",
    [
        ({"r": 0}, "r"),
        ({"r": "8"}, "r"),
        ({"lora_alpha": "x"}, "lora_alpha"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": None}, "target_modules"),
    ],
)
def test_bad_values_are_refused_by_name(edit: dict, key: str):
    with pytest.raises(LoRAError, match=key):
        LoRAConfig.from_dict({**BASE_CONFIG, **edit})


def test_folder_errors(tmp_path):
    with pytest.raises(LoRAError, match="not a directory"):
        LoRAConfig.from_dir(str(tmp_path / "nowhere"))
    with pytest.raises(LoRAError, match="adapter_config.json"):
        LoRAConfig.from_dir(str(tmp_path))  # a folder without the config
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="adapter_config.json.*cannot read"):
        LoRAConfig.from_dir(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(LoRAError, match="not a JSON object"):
        LoRAConfig.from_dir(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps(BASE_CONFIG))
    with pytest.raises(LoRAError, match="adapter_model"):  # a config but no weights
        read_tensors(str(tmp_path))


# ---------------------------------------------------------------- build_adapter on a tiny Llama
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_adapter")
    model_path = save_hf_dir(load_llama(), root / "base")
    model = get_model(ModelConfig(model_path))
    return root, model_path, model


@pytest.fixture(scope="module")
def qv_adapter(llama):
    root = llama[0]
    return save_peft_adapter(load_llama, root / "qv", ["q_proj", "v_proj"], rank=4, seed=1)


@pytest.fixture(scope="module")
def all_adapter(llama):
    root = llama[0]
    return save_peft_adapter(load_llama, root / "all", ALL_TARGETS, rank=4, seed=2, use_rslora=True)


def peft_deltas(path: str) -> dict[str, torch.Tensor]:
    """HF module name -> scaling * B @ A, from the adapter's own files."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    r = cfg["r"]
    scaling = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    t = read_tensors(path)
    out = {}
    for key in t:
        if key.endswith(".lora_A.weight"):
            module = key[len(PREFIX) : -len(".lora_A.weight")]
            B = t[key.replace("lora_A", "lora_B")]
            out[module] = scaling * (B @ t[key])
    return out


def expected_update(srt_module: str, layer, deltas: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The per-module peft deltas of a srt layer's parts concatenated (zeros for untouched parts)."""
    parent, short = srt_module.rsplit(".", 1)
    parts = FUSED.get(short, (short,))
    sizes = getattr(layer, "output_sizes", [layer.out_features])
    cols = []
    for part, rows in zip(parts, sizes):
        d = deltas.get(f"{parent}.{part}")
        cols.append(torch.zeros(x.shape[0], rows) if d is None else x @ d.t())
    return torch.cat(cols, dim=1)


def hf_targets(deltas: dict[str, torch.Tensor]) -> set[str]:
    out = set()
    for module in deltas:
        parent, short = module.rsplit(".", 1)
        fused = next((f for f, parts in FUSED.items() if short in parts), short)
        out.add(f"{parent}.{fused}")
    return out


@pytest.mark.parametrize("which", ["qv", "all"])
def test_each_fused_layer_update_equals_peft_deltas_concatenated(llama, qv_adapter, all_adapter, which):
    _, _, model = llama
    path = qv_adapter if which == "qv" else all_adapter
    adapter = build_adapter(which, path, model, max_rank=8, allowed_targets=None, dtype=torch.float32)
    deltas = peft_deltas(path)
    assert set(adapter.weights) == hf_targets(deltas)
    gen = torch.Generator().manual_seed(3)
    for module, w in adapter.weights.items():
        layer = model.get_submodule(module)
        x = torch.randn(5, layer.in_features, generator=gen)
        torch.testing.assert_close((x @ w.A.t()) @ w.B.t(), expected_update(module, layer, deltas, x))
    assert adapter.nbytes == sum(w.A.nbytes + w.B.nbytes for w in adapter.weights.values())


def test_qkv_and_gate_up_are_stacked_with_scaling_folded_in(llama, qv_adapter, all_adapter):
    _, _, model = llama
    qv = build_adapter("qv", qv_adapter, model, 8, None, torch.float32)
    t = read_tensors(qv_adapter)
    scaling = LoRAConfig.from_dir(qv_adapter).scaling
    assert scaling == 2.0  # alpha 2r, so a missing fold would show
    for layer_idx in range(2):
        hf = f"{PREFIX}model.layers.{layer_idx}.self_attn"
        qkv = model.get_submodule(f"model.layers.{layer_idx}.self_attn.qkv_proj")
        w = qv.weights[f"model.layers.{layer_idx}.self_attn.qkv_proj"]
        r, q, kv = 4, qkv.q_size, qkv.kv_size
        assert w.A.shape == (2 * r, qkv.in_features) and w.B.shape == (q + 2 * kv, 2 * r)
        assert torch.equal(w.A[:r], t[f"{hf}.q_proj.lora_A.weight"])
        assert torch.equal(w.A[r:], t[f"{hf}.v_proj.lora_A.weight"])
        torch.testing.assert_close(w.B[:q, :r], scaling * t[f"{hf}.q_proj.lora_B.weight"])
        torch.testing.assert_close(w.B[q + kv :, r:], scaling * t[f"{hf}.v_proj.lora_B.weight"])
        assert not w.B[:q, r:].any() and not w.B[q + kv :, :r].any()
        assert not w.B[q : q + kv].any()  # k has no adapter: its rows stay zero
    assert not any("mlp" in m or "o_proj" in m for m in qv.weights)

    full = build_adapter("all", all_adapter, model, 8, None, torch.float32)
    t = read_tensors(all_adapter)
    scaling = LoRAConfig.from_dir(all_adapter).scaling
    assert scaling == pytest.approx(8 / 2)  # rslora: alpha / sqrt(r)
    gate_up = model.get_submodule("model.layers.0.mlp.gate_up_proj")
    w = full.weights["model.layers.0.mlp.gate_up_proj"]
    inter = gate_up.output_sizes[0]
    hf = f"{PREFIX}model.layers.0.mlp"
    assert w.A.shape == (8, 64) and w.B.shape == (2 * inter, 8)
    assert torch.equal(w.A, torch.cat([t[f"{hf}.gate_proj.lora_A.weight"], t[f"{hf}.up_proj.lora_A.weight"]]))
    torch.testing.assert_close(w.B[:inter, :4], scaling * t[f"{hf}.gate_proj.lora_B.weight"])
    torch.testing.assert_close(w.B[inter:, 4:], scaling * t[f"{hf}.up_proj.lora_B.weight"])
    assert not w.B[:inter, 4:].any() and not w.B[inter:, :4].any()
    down = full.weights["model.layers.0.mlp.down_proj"]  # one part: no stacking
    torch.testing.assert_close(down.B, scaling * t[f"{hf}.down_proj.lora_B.weight"])


def test_srt_layers_with_the_adapter_equal_peft_modules(llama, all_adapter):
    """srt's fused Linear with the adapter in a slot gives peft's modules' outputs, concatenated."""
    _, _, model = llama
    adapter = build_adapter("all", all_adapter, model, 8, None, torch.float32)
    peft_model = peft_reference_model(load_llama, all_adapter)
    state = LoRAState()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen)
    state.batch = LoRABatch.build([0, -1], [4, 2], "cpu")
    for module in ("model.layers.1.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"):
        layer = model.get_submodule(module)
        parent, short = module.rsplit(".", 1)
        layer.lora = LinearLoRA(state)
        layer.lora.slots[0] = adapter.weights[module]
        try:
            with torch.no_grad():
                got = layer(x)
                peft_out = torch.cat(
                    [peft_model.base_model.model.get_submodule(f"{parent}.{p}")(x) for p in FUSED[short]],
                    dim=1,
                )
                with peft_model.disable_adapter():
                    base_out = torch.cat(
                        [peft_model.base_model.model.get_submodule(f"{parent}.{p}")(x) for p in FUSED[short]],
                        dim=1,
                    )
        finally:
            layer.lora = None
        torch.testing.assert_close(got[:4], peft_out[:4], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[4:], base_out[4:], rtol=1e-4, atol=1e-4)  # base rows
        assert not torch.allclose(peft_out, base_out, atol=1e-2)


def test_regex_targets_adapter_covers_only_its_layers(llama):
    root, _, model = llama
    regex = r".*\.layers\.1\.self_attn\.(q|v)_proj"
    path = save_peft_adapter(load_llama, root / "regex", regex, rank=4, seed=6)
    adapter = build_adapter("regex", path, model, 8, None, torch.float32)
    assert adapter.config.target_modules == regex
    assert set(adapter.weights) == {"model.layers.1.self_attn.qkv_proj"}


# ---------------------------------------------------------------- refusals
def test_rank_above_max_rank_is_refused(llama, qv_adapter):
    with pytest.raises(LoRAError, match="rank 4 is above --max-lora-rank 2"):
        build_adapter("qv", qv_adapter, llama[2], 2, None, torch.float32)
    build_adapter("qv", qv_adapter, llama[2], 4, None, torch.float32)  # equal is fine


def test_target_outside_allowed_set_is_refused(llama, qv_adapter):
    with pytest.raises(LoRAError, match="v_proj, not in --lora-target-modules"):
        build_adapter("qv", qv_adapter, llama[2], 8, {"q_proj", "k_proj"}, torch.float32)
    build_adapter("qv", qv_adapter, llama[2], 8, {"q_proj", "v_proj"}, torch.float32)


def test_module_the_model_lacks_is_refused(llama, qv_adapter):
    root = llama[0]
    path = rewrite_adapter(qv_adapter, root / "c_attn", rename=lambda k: k.replace("q_proj", "c_attn"))
    with pytest.raises(LoRAError, match=r"self_attn\.c_attn, which this model has no linear layer for"):
        build_adapter("c", path, llama[2], 8, None, torch.float32)
    # a name inside the model that is no Linear (a norm)
    path = rewrite_adapter(
        qv_adapter, root / "norm", rename=lambda k: k.replace("self_attn.q_proj", "input_layernorm")
    )
    with pytest.raises(LoRAError, match="input_layernorm"):
        build_adapter("n", path, llama[2], 8, None, torch.float32)


def test_adapter_of_another_base_model_is_refused(llama, tmp_path):
    def load_other():
        return build_tiny_hf_model("llama", seed=SEED, hidden_size=32, intermediate_size=96)

    path = save_peft_adapter(load_other, tmp_path / "other", ["q_proj", "v_proj"], rank=4, seed=1)
    with pytest.raises(LoRAError, match="another base model"):
        build_adapter("o", path, llama[2], 8, None, torch.float32)


def test_tensors_disagreeing_with_the_config_rank_are_refused(llama, qv_adapter):
    path = rewrite_adapter(qv_adapter, llama[0] / "r2", config_edits={"r": 2})
    with pytest.raises(LoRAError, match="r = 2"):
        build_adapter("r2", path, llama[2], 8, None, torch.float32)


def _drop_and_save(src: str, dst, drop) -> str:
    from safetensors.torch import save_file

    rewrite_adapter(src, dst)
    tensors = {k: v for k, v in read_tensors(src).items() if not drop(k)}
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return str(dst)


def test_lora_a_without_lora_b_is_refused(llama, qv_adapter):
    victim = f"{PREFIX}model.layers.0.self_attn.v_proj.lora_B.weight"
    path = _drop_and_save(qv_adapter, llama[0] / "no_b", lambda k: k == victim)
    with pytest.raises(LoRAError, match=r"lora_A or lora_B alone.*layers\.0\.self_attn\.v_proj"):
        build_adapter("x", path, llama[2], 8, None, torch.float32)


def test_other_tensors_and_empty_files_are_refused(llama, qv_adapter, tmp_path):
    from safetensors.torch import save_file

    path = rewrite_adapter(qv_adapter, tmp_path / "bias")
    tensors = read_tensors(qv_adapter)
    extra = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.bias"
    save_file({**tensors, extra: torch.zeros(64)}, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="lora_B.bias"):
        build_adapter("x", path, llama[2], 8, None, torch.float32)
    save_file({}, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="no lora_A / lora_B tensors"):
        build_adapter("x", path, llama[2], 8, None, torch.float32)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"truncated")
    with pytest.raises(LoRAError, match="cannot read the adapter weights"):
        build_adapter("x", path, llama[2], 8, None, torch.float32)


# ---------------------------------------------------------------- tensor parallelism
def view_index(model, module: str) -> tuple[int, torch.Tensor]:
    """(dim, the indices of the whole layer's rows or columns this rank's layer keeps)."""
    view = model.shard_plan.views[f"{module}.weight"]
    return view.dim, torch.cat([torch.arange(s, s + n) for s, n in view.ranges])


def check_rank_slices(full_model, full, ranks) -> None:
    """Each rank's (A, B): column-parallel layers the rank's rows of B, row-parallel ones its
    columns of A; and over the ranks the updates add up to the whole model's."""
    gen = torch.Generator().manual_seed(11)
    for module, F in full.weights.items():
        x = torch.randn(3, full_model.get_submodule(module).in_features, generator=gen)
        whole = (x @ F.A.t()) @ F.B.t()
        partial_sum = torch.zeros_like(whole)
        for model, adapter in ranks:
            W = adapter.weights[module]
            dim, idx = view_index(model, module)
            if dim == 0:  # column-parallel: the rank's output rows of B, A whole
                assert torch.equal(W.A, F.A), module
                assert torch.equal(W.B, F.B[idx]), module
                torch.testing.assert_close((x @ W.A.t()) @ W.B.t(), whole[:, idx])
            else:  # row-parallel: the rank's input columns of A, B whole; partial sums
                assert dim == 1
                assert torch.equal(W.A, F.A[:, idx]), module
                assert torch.equal(W.B, F.B), module
                partial_sum += (x[:, idx] @ W.A.t()) @ W.B.t()
        if view_index(ranks[0][0], module)[0] == 1:
            torch.testing.assert_close(partial_sum, whole)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_ranks_keep_their_slices(llama, all_adapter, qv_adapter, tp_size: int):
    _, model_path, full_model = llama
    mc = ModelConfig(model_path)
    models = [get_model(mc, tp=TPInfo(r, tp_size)) for r in range(tp_size)]
    assert all(m.shard_plan is not None for m in models) and full_model.shard_plan is None
    for path in (all_adapter, qv_adapter):
        full = build_adapter("a", path, full_model, 8, None, torch.float32)
        ranks = [(m, build_adapter("a", path, m, 8, None, torch.float32)) for m in models]
        for m, a in ranks:
            assert set(a.weights) == set(full.weights)
            for module, w in a.weights.items():
                layer = m.get_submodule(module)
                assert w.A.shape[1] == layer.in_features and w.B.shape[0] == layer.out_features
        check_rank_slices(full_model, full, ranks)


def test_tp_slices_of_phi3_checkpoint_fused_layers(tmp_path):
    """Phi-3 names its fused qkv_proj / gate_up_proj, so an adapter targets them whole: each rank
    keeps its rows of each part (``ShardPlan.fused_rows``)."""
    from tests.helpers.tiny_phi3 import build_tiny_phi3

    def load_phi3():
        return build_tiny_phi3(seed=1)

    model_path = save_hf_dir(load_phi3(), tmp_path / "phi3")
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    path = save_peft_adapter(load_phi3, tmp_path / "adapter", targets, rank=4, seed=3)
    mc = ModelConfig(model_path)
    full_model = get_model(mc)
    full = build_adapter("p", path, full_model, 8, None, torch.float32)
    deltas = peft_deltas(path)
    for module, w in full.weights.items():  # one part each: the whole fused delta
        torch.testing.assert_close(w.B @ w.A, deltas[module])
    models = [get_model(mc, tp=TPInfo(r, 2)) for r in range(2)]
    ranks = [(m, build_adapter("p", path, m, 8, None, torch.float32)) for m in models]
    assert ranks[0][1].weights.keys() == full.weights.keys()
    check_rank_slices(full_model, full, ranks)


# ---------------------------------------------------------------- vision-language models
def _write_adapter(path, tensors: dict, rank: int = 4, alpha: int = 8) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["down_proj"]}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(
        {PREFIX + k: v.contiguous() for k, v in tensors.items()},
        os.path.join(path, "adapter_model.safetensors"),
    )
    return str(path)


def test_a_vlm_takes_its_decoders_adapters_and_refuses_the_towers(tmp_path):
    """Qwen2.5-VL's tower has gate/up/down_proj layers too: an adapter of the decoder, named as
    transformers 5 names it (``model.language_model.layers...``), lands on srt's decoder layer;
    one of the tower (``model.visual...`` or the Hub's ``visual...``) is refused by name."""
    from tests.helpers.tiny_vlm import save_tiny_vlm

    model = get_model(ModelConfig(save_tiny_vlm("qwen2_5_vl", tmp_path / "vlm")))
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(4, 128, generator=g), torch.randn(64, 4, generator=g)
    name = "model.language_model.layers.1.mlp.down_proj"
    text = _write_adapter(tmp_path / "text", {f"{name}.lora_A.weight": A, f"{name}.lora_B.weight": B})
    adapter = build_adapter("text", text, model, 8, None, torch.float32)
    assert set(adapter.weights) == {"model.layers.1.mlp.down_proj"}
    got = adapter.weights["model.layers.1.mlp.down_proj"]
    assert torch.equal(got.A, A) and torch.equal(got.B, B * 2.0)  # scaling alpha / r
    for tower in ("model.visual.blocks.0.mlp.down_proj", "visual.blocks.0.mlp.down_proj"):
        a, b = torch.randn(4, 64, generator=g), torch.randn(32, 4, generator=g)
        tensors = {f"{tower}.lora_A.weight": a, f"{tower}.lora_B.weight": b}
        both = _write_adapter(
            tmp_path / tower, {**tensors, f"{name}.lora_A.weight": A, f"{name}.lora_B.weight": B}
        )
        with pytest.raises(LoRAError, match=r"visual\.blocks\.0\.mlp\.down_proj.*image side"):
            build_adapter("both", both, model, 8, None, torch.float32)
