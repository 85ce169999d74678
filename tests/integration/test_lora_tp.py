"""Multi-LoRA under tensor parallelism (2 ranks, CPU, gloo): a tiny random Llama (4 query heads, 2 KV
heads: one KV head per rank) served with PEFT adapters, one on q/v (rank 8) and one on all seven
projections (rank 4, so the row-parallel o_proj / down_proj updates are summed by the all-reduce).

* One batch mixes the base model and both adapters, the same prompt under each of the three (their KV
  never shared: prefix-cache namespaces); every prompt's greedy tokens equal transformers + peft's
  for its adapter (near-tie rule of hf_reference.py).
* A third adapter loaded at run time (both ranks read it at the same step) with two adapter slots:
  its requests wait for a slot, reuse the least recently used one on both ranks alike, and match peft;
  it then unloads."""

from __future__ import annotations

import pytest

from srt import Engine
from tests.helpers.hf_reference import assert_tokens_match, hf_greedy_references, make_prompts
from tests.helpers.lora_adapters import ALL_TARGETS, peft_reference_model, save_peft_adapter
from tests.helpers.tiny_models import build_tiny_hf_model, save_hf_dir

MAX_NEW_TOKENS = 12
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
SEED = 3


def load_base():
    return build_tiny_hf_model("llama", seed=SEED)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp")
    base = load_base()
    assert (base.config.num_attention_heads, base.config.num_key_value_heads) == (4, 2)
    model_path = save_hf_dir(base, root / "base")
    adapters = {
        "qv": save_peft_adapter(load_base, root / "qv", ["q_proj", "v_proj"], rank=8, seed=11),
        "all": save_peft_adapter(load_base, root / "all", ALL_TARGETS, rank=4, seed=12),
        "late": save_peft_adapter(
            load_base, root / "late", ["o_proj", "gate_proj", "down_proj"], rank=8, seed=13
        ),
    }
    return model_path, adapters


def references(prompts, names, adapters):
    """Each prompt's transformers + peft greedy reference for its adapter (None: the base model)."""
    refs: list = [None] * len(prompts)
    for adapter in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == adapter]
        path = adapters[adapter] if adapter else None
        got = hf_greedy_references(
            None,
            [prompts[i] for i in idx],
            MAX_NEW_TOKENS,
            lambda path=path: peft_reference_model(load_base, path),
        )
        for i, ref in zip(idx, got):
            refs[i] = ref
    return refs


def check(outs, refs) -> None:
    near_ties = sum(
        assert_tokens_match(o["output_ids"], ref.token_ids, ref.top_logprobs) for o, ref in zip(outs, refs)
    )
    assert near_ties <= 1


def test_tp2_adapters_match_transformers_peft(served):
    model_path, adapters = served
    shared = make_prompts([27], seed=9, vocab_size=320)[0]
    prompts = make_prompts([5, 23, 40, 9, 31, 17], seed=4, vocab_size=320) + [shared] * 3
    names = ["qv", "all", None, "all", "qv", None, None, "qv", "all"]
    refs = references(prompts, names, adapters)
    # the adapters change the greedy tokens, else the comparison could not tell them apart
    assert len({tuple(refs[i].token_ids) for i in (6, 7, 8)}) == 3
    late_prompts = make_prompts([12, 33], seed=5, vocab_size=320)
    late_refs = references(late_prompts, ["late"] * 2, adapters)
    base_late = references(late_prompts, [None] * 2, adapters)
    assert all(a.token_ids != b.token_ids for a, b in zip(late_refs, base_late))

    llm = Engine(
        model_path=model_path,
        tp_size=2,
        skip_tokenizer_init=True,
        lora_paths=[f"{name}={adapters[name]}" for name in ("qv", "all")],
        max_loras_per_batch=2,
        max_total_tokens=2048,
        log_level="warning",
    )
    try:
        assert {"scheduler", "scheduler-tp1"} <= set(llm.tokenizer_manager.launcher.child_pids)
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
        check(outs, refs)
        # the shared prompt again, now from the prefix cache of each namespace
        again = llm.generate(input_ids=prompts[6:], sampling_params=GREEDY, lora_path=names[6:])
        check(again, refs[6:])

        out = llm.load_lora_adapter("late", adapters["late"])
        assert set(out["loaded_adapters"]) == {"qv", "all", "late"}, out
        # three adapters, two slots: "late" takes the slot of the one used least recently
        mixed = llm.generate(
            input_ids=[late_prompts[0], prompts[1], late_prompts[1], prompts[0]],
            sampling_params=GREEDY,
            lora_path=["late", "all", "late", "qv"],
        )
        check(mixed, [late_refs[0], refs[1], late_refs[1], refs[0]])
        out = llm.unload_lora_adapter("late")
        assert set(out["loaded_adapters"]) == {"qv", "all"}, out
        after = llm.generate(input_ids=prompts[:3], sampling_params=GREEDY, lora_path=names[:3])
        check(after, refs[:3])
    finally:
        llm.shutdown()
