"""The scheduler child imports transformers with torch hidden from it before it imports torch
(``_transformers_first`` in srt/entrypoints/launch.py): its config modules then skip the
activation and weight-conversion code (and ``torch.distributed.tensor``), and the model's config
holds the same values, except ``dtype``, kept as its name (srt reads the checkpoint's dtype from
config.json). A vision-language model, a config defined by the repository's code and a path that
cannot be read keep transformers as it is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from srt.configs.gguf_header import model_config_dict
from srt.configs.model_config import _build_hf_config
from srt.utils.model_path import resolve_model_path
from tests.helpers.tiny_models import tiny_config

# the scheduler child's first steps, as run_scheduler takes them, then the model's config
_CHILD = """
import json, sys
from srt.entrypoints.launch import _model_config, _transformers_first
path = sys.argv[1] or None
hidden = _transformers_first(_model_config(path))
import torch
from transformers.utils.import_utils import is_torch_available
out = {"hidden": hidden, "torch_seen": is_torch_available()}
if sys.argv[2] == "build":
    from srt.configs.gguf_header import model_config_dict
    from srt.configs.model_config import _build_hf_config
    from srt.utils.model_path import resolve_model_path
    cfg = _build_hf_config(model_config_dict(resolve_model_path(path)))
    out["config"] = {k: repr(v) for k, v in vars(cfg).items()}
out["dtensor"] = "torch.distributed.tensor" in sys.modules
print(json.dumps(out))
"""


def _child(path: str | None, build: bool = True) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, path or "", "build" if build else "-"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _config_dir(tmp_path, config: dict) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _here(path: str | None) -> dict:
    """The config built in this process (torch in sight of transformers), as the child reports it."""
    return {
        k: repr(v) for k, v in vars(_build_hf_config(model_config_dict(resolve_model_path(path)))).items()
    }


@pytest.mark.parametrize("which", ["default_gguf", "llama_bf16_dir"])
def test_a_text_models_config_is_the_same_without_torch_in_sight(which, tmp_path):
    if which == "default_gguf":
        path = None
    else:
        path = _config_dir(tmp_path / "llama", {**tiny_config("llama").to_dict(), "torch_dtype": "bfloat16"})
    out = _child(path)
    assert out["hidden"] and not out["torch_seen"]
    assert not out["dtensor"]  # the import transformers' config modules make only with torch in sight
    expected = _here(path)
    if which == "llama_bf16_dir":  # the one difference: the declared dtype kept as its name
        assert expected.pop("dtype") == "torch.bfloat16" and out["config"].pop("dtype") == "'bfloat16'"
    assert out["config"] == expected


@pytest.mark.parametrize("case", ["vision", "repository_code", "unreadable"])
def test_models_that_need_transformers_as_it_is_keep_it(case, tmp_path):
    if case == "vision":  # the vision tower runs transformers' own modules, which need torch
        path = _config_dir(
            tmp_path / "vlm", {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]}
        )
    elif case == "repository_code":
        config = {**tiny_config("llama").to_dict(), "auto_map": {"AutoConfig": "configuration_x.XConfig"}}
        path = _config_dir(tmp_path / "remote", config)
    else:
        path = str(tmp_path / "missing")
    out = _child(path, build=False)
    assert not out["hidden"] and out["torch_seen"]
