"""A user's dict of sampling parameters -> a verified, normalized `SamplingParams`, and the
`RequestError` of a mistyped field: every bad value named as the caller spells it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from srt.sampling.sampling_params import SamplingParams
from srt.utils.errors import RequestError

_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def parse_sampling_params(
    params: dict[str, Any], vocab_size: int | None, param_names: Mapping[str, str] | None = None
) -> SamplingParams:
    """A verified, normalized `SamplingParams` from a user dict (nothing prompt-dependent yet:
    ``normalize(bounds)`` resolves ``max_new_tokens`` once the prompt is tokenized).

    Raises `RequestError` naming every bad value (unknown names, wrong types, out-of-range values);
    ``param`` of the error is the first offending parameter as the caller spells it
    (``param_names``: internal name -> the caller's, e.g. OpenAI's max_new_tokens -> max_tokens).
    """
    names = param_names or {}
    unknown = sorted(k for k in params if k not in _SAMPLING_FIELDS)
    if unknown:
        raise RequestError(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
    clean = {k: v for k, v in params.items() if v is not None or k in ("max_new_tokens", "seed")}
    try:
        sp = msgspec.convert(clean, SamplingParams, strict=True)
    except msgspec.ValidationError as e:
        raise type_error(str(e), names) from None
    errors = sp.validation_errors(vocab_size)
    if errors:

        def requirement(text: str) -> str:
            for internal, external in names.items():
                text = text.replace(internal, external)
            return text

        shown = [names.get(e.param, e.param) for e in errors]
        message = "; ".join(f"{s} {requirement(e.requirement)}, got {e.shown}" for s, e in zip(shown, errors))
        raise RequestError(message, param=shown[0])
    return sp.normalize(vocab_size=vocab_size)


def type_error(msg: str, names: Mapping[str, str] | None = None) -> RequestError:
    """The `RequestError` (code ``invalid_type``) of a msgspec validation message such as
    "Expected `float`, got `str` - at `$.temperature`": it names the top-level field (as the
    caller spells it, ``names``)."""
    names = names or {}
    param = None
    head, at, path = msg.partition(" - at `$.")
    if at:
        param = path.rstrip("`").split(".")[0].split("[")[0]
        param = names.get(param, param)
    text = head.replace("`", "")
    return RequestError(f"{param}: {text}" if param else text, param=param, code="invalid_type")
