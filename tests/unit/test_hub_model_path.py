"""--model-path as a hub id in the local HF cache (offline), --revision, --trust-remote-code.

The cache is a fake one in a tmp dir (HF_HOME) laid out as huggingface_hub lays it out, holding
tiny models (tests/helpers/tiny_models.py)."""

from __future__ import annotations

import json
import os

import pytest

from srt.configs.model_config import ModelConfig
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError, ModelNotFoundError
from srt.utils.model_path import is_hub_id, resolve_hub_snapshot
from tests.helpers.tiny_models import save_tiny_model

REPO = "TinyOrg/tiny-model"
MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> str:
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    save_tiny_model("llama", repo / "snapshots" / MAIN)
    save_tiny_model("qwen2", repo / "snapshots" / V2)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2 + "\n")
    return str(home)


@pytest.fixture
def cache(hf_home, monkeypatch) -> str:
    monkeypatch.setenv("HF_HOME", hf_home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return os.path.join(hf_home, "hub", "models--TinyOrg--tiny-model", "snapshots")


def test_hub_id_shapes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/name.v1")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "model").mkdir()
    assert not is_hub_id("local/model")  # an existing relative path is a path
    for not_hub in (None, "/abs/path", "x/model.gguf", "a/b/c", "./x", "../x/y", "gpt2"):
        assert not is_hub_id(not_hub), not_hub


def test_revisions_resolve_to_their_snapshots(cache):
    assert resolve_hub_snapshot(REPO, None) == os.path.join(cache, MAIN)
    assert resolve_hub_snapshot(REPO, "main") == os.path.join(cache, MAIN)
    assert resolve_hub_snapshot(REPO, "v2") == os.path.join(cache, V2)
    assert resolve_hub_snapshot(REPO, V2) == os.path.join(cache, V2)  # a commit hash
    with pytest.raises(ModelNotFoundError) as e:
        resolve_hub_snapshot(REPO, "v3")
    assert "'v3'" in str(e.value) and "v2" in str(e.value) and "never downloads" in str(e.value)
    with pytest.raises(ModelNotFoundError):
        resolve_hub_snapshot(REPO, "../../etc")


def test_server_args_resolve_a_cached_hub_id_offline(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ServerArgs(device="cpu", model_path=REPO).resolve()
    assert args.model_path == os.path.join(cache, MAIN) and args.served_model_name == REPO
    assert ModelConfig.from_server_args(args).architecture == "LlamaForCausalLM"
    v2 = ServerArgs(device="cpu", model_path=REPO, revision="v2", served_model_name="mine").resolve()
    assert v2.model_path == os.path.join(cache, V2) and v2.served_model_name == "mine"
    assert ModelConfig.from_server_args(v2).architecture == "Qwen2ForCausalLM"
    tok = ServerArgs(device="cpu", model_path=REPO, tokenizer_path=REPO, revision="v2").resolve()
    assert tok.tokenizer_path == os.path.join(cache, V2)


def test_a_hub_id_not_in_the_cache_is_a_config_error(cache):
    with pytest.raises(ConfigError) as e:
        ServerArgs(device="cpu", model_path="TinyOrg/not-cached").resolve()
    msg = str(e.value)
    assert "--model-path 'TinyOrg/not-cached'" in msg and "never downloads" in msg
    assert os.path.dirname(os.path.dirname(os.path.dirname(cache))) in msg  # where it looked


def test_a_local_path_ignores_the_revision(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m")
    args = ServerArgs(device="cpu", model_path=path, revision="v2").resolve()
    assert args.model_path == path and args.served_model_name is None


def _custom_code_model(path) -> str:
    save_tiny_model("llama", path)
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["model_type"] = "srt_test_custom_llama"
    cfg["auto_map"] = {"AutoConfig": "configuration_custom.CustomLlamaConfig"}
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "configuration_custom.py"), "w") as f:
        f.write(
            "from transformers import LlamaConfig\n\n\n"
            "class CustomLlamaConfig(LlamaConfig):\n"
            '    model_type = "srt_test_custom_llama"\n'
        )
    return str(path)


def test_trust_remote_code_loads_a_config_class_of_the_repository(tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dyn

    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    path = _custom_code_model(tmp_path / "custom")
    with pytest.raises(ConfigError, match="--trust-remote-code"):
        ModelConfig(path)
    mc = ModelConfig(path, trust_remote_code=True, override_args={"num_hidden_layers": 1})
    assert type(mc.hf_config).__name__ == "CustomLlamaConfig"
    assert mc.architecture == "LlamaForCausalLM" and mc.num_hidden_layers == 1


def test_tokenizer_loader_gets_the_flag_and_stays_offline(tmp_path, monkeypatch):
    import transformers

    from srt.utils.hf_tokenizer import load_tokenizer

    seen = {}

    def fake_from_pretrained(path, **kwargs):
        seen.update(kwargs, path=path)
        return "tokenizer"

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert load_tokenizer(str(tmp_path), trust_remote_code=True) == "tokenizer"
    assert seen == {"path": str(tmp_path), "trust_remote_code": True, "local_files_only": True}


def test_a_folder_without_a_tokenizer_is_a_config_error_naming_the_ways_out(tmp_path):
    from srt.utils.errors import ConfigError
    from srt.utils.hf_tokenizer import load_tokenizer

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ConfigError, match="no tokenizer in .*--tokenizer-path.*--skip-tokenizer-init"):
        load_tokenizer(str(tmp_path))
