"""The command line generated from a configuration dataclass (``ServerArgs``): one flag per field,
``--model-path`` for ``model_path``, with the field's help text, choices and (for lists) nargs
from its metadata (``arg_field``). A bool field is a switch; one that defaults to True also gets
its ``--no-...`` form."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, get_type_hints


def add_dataclass_cli_args(cls: type, parser: argparse.ArgumentParser) -> None:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        hint = hints[f.name]
        if hint is bool:
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            parser.add_argument(flag, action=action, default=f.default, help=help_)
        elif f.metadata.get("nargs"):  # a list: its items as separate words
            parser.add_argument(flag, nargs=f.metadata["nargs"], default=f.default, help=help_)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag, type=_base_type(hint), default=f.default, choices=choices, help=help_)


def _base_type(hint: Any):
    """``X`` of ``X | None``; other hints as they are."""
    return next((a for a in getattr(hint, "__args__", None) or () if a is not type(None)), hint)
