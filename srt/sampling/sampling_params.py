"""Per-request sampling parameters (SGLang's names and defaults) and their validation.

`SamplingParams` is a ``msgspec.Struct``: it travels inside ``TokenizedGenerateReqInput`` over
msgpack, so it holds only plain values. Validation happens at the boundary (tokenizer manager /
HTTP layer) with `verify()` or `validation_errors()`; the scheduler assumes verified, normalized
params.

Conventions:
- ``temperature == 0`` (anything below ``GREEDY_EPS``) means greedy decoding; `normalize()` turns it
  into the canonical greedy form ``temperature=0.0, top_k=1``.
- ``top_k == -1`` disables top-k. ``top_k == 0`` is accepted as a synonym (HF / some OpenAI-style
  clients use 0 for "disabled") and `normalize()` rewrites it to -1.
- ``max_new_tokens=None`` means "until the context length"; the scheduler caps it.
- ``seed=None`` means "no seed given": the scheduler draws one at admission so that every request
  samples from a reproducible (seed, position) noise stream.
- ``logit_bias`` maps token ids written as decimal strings (OpenAI's shape) to an additive bias in
  [-100, 100].
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

GREEDY_EPS = 1e-6
# seeds are reduced to 64 bits for the counter-based noise; accept the signed and unsigned range
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_LOGIT_BIAS_LIMIT = 100.0


class SamplingParamsError(ValueError):
    """One invalid sampling parameter.

    ``param`` is the field name, ``value`` the offending value; ``str(err)`` is a complete message
    naming the parameter, the value and the allowed range (suitable for an HTTP 400 body).
    """

    def __init__(self, param: str, value: Any, requirement: str) -> None:
        self.param = param
        self.value = value
        self.requirement = requirement
        super().__init__(f"{param} {requirement}, got {value!r}")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters of one request (SGLang's field names and defaults)."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # a single string is accepted and normalized to a one-element list in __post_init__
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    # constrained decoding (at most one): a JSON schema (as JSON text), a regex, an EBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        # runs on construction and on msgpack/json decode
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    # ------------------------------------------------------------------ properties
    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily (argmax): temperature ~0 or top_k == 1."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        """The stop strings as a list (empty when none)."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    # ------------------------------------------------------------------ validation
    def validation_errors(self, vocab_size: int | None = None) -> list[SamplingParamsError]:
        """Every invalid value, one `SamplingParamsError` each (empty list when valid).

        ``vocab_size`` (when given) bounds ``stop_token_ids`` and ``logit_bias`` keys.
        """
        errs: list[SamplingParamsError] = []

        def err(param: str, requirement: str) -> None:
            errs.append(SamplingParamsError(param, getattr(self, param), requirement))

        # -- lengths
        mnt = self.max_new_tokens
        if mnt is not None and (not _is_int(mnt) or mnt < 0):
            err("max_new_tokens", "must be an integer >= 0 (or null for 'up to the context length')")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            err("min_new_tokens", "must be an integer >= 0")
        elif _is_int(mnt) and mnt >= 0 and self.min_new_tokens > mnt:
            err("min_new_tokens", f"must be <= max_new_tokens ({mnt})")

        # -- distribution shaping
        if not _is_real(self.temperature) or not self.temperature >= 0.0:
            err("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            err("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 0):
            err("top_k", "must be -1 (disabled), 0 (also disabled) or an integer >= 1")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            err("min_p", "must be in [0, 1]")

        # -- penalties
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                err(name, "must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            err("repetition_penalty", "must be in (0, 2] (1 disables it)")

        # -- stopping
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                err("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
                err("stop_token_ids", "must be a list of integers >= 0")
            elif vocab_size is not None and any(t >= vocab_size for t in ids):
                err("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                err(name, "must be a boolean")

        # -- constrained decoding (the grammar itself is checked by the grammar backend)
        given = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        for name in given:
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                err(name, "must be a non-empty string")
        if len(given) > 1:
            err(
                given[1], f"cannot be combined with {given[0]} (give at most one of json_schema, regex, ebnf)"
            )

        # -- misc
        if not _is_int(self.n) or self.n < 1:
            err("n", "must be an integer >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            err("seed", f"must be an integer in [{_SEED_MIN}, {_SEED_MAX}] or null")
        if self.logit_bias is not None:
            problem = _logit_bias_problem(self.logit_bias, vocab_size)
            if problem is not None:
                err("logit_bias", problem)
        return errs

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise the first `SamplingParamsError` found (see `validation_errors` for all of them)."""
        errs = self.validation_errors(vocab_size)
        if errs:
            raise errs[0]

    def normalize(self) -> SamplingParams:
        """Rewrite to canonical form in place (call after `verify`); returns ``self``.

        - ``stop``: a string becomes a one-element list;
        - ``top_k == 0`` becomes -1 (disabled);
        - temperature below 1e-6 or top_k == 1 becomes the greedy form ``temperature=0.0, top_k=1``.
        """
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == 0:
            self.top_k = -1
        if self.is_greedy:
            self.temperature = 0.0
            self.top_k = 1
        return self

    def logit_bias_items(self) -> list[tuple[int, float]]:
        """``logit_bias`` as ``(token_id, bias)`` pairs (empty when none). Assumes verified params."""
        if not self.logit_bias:
            return []
        return [(int(k), float(v)) for k, v in self.logit_bias.items()]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _logit_bias_problem(bias: Any, vocab_size: int | None) -> str | None:
    upper = f"{vocab_size}" if vocab_size is not None else "vocab_size"
    requirement = (
        f"must map token ids (decimal strings in [0, {upper})) to numbers in "
        f"[-{_LOGIT_BIAS_LIMIT:g}, {_LOGIT_BIAS_LIMIT:g}]"
    )
    if not isinstance(bias, dict):
        return requirement
    for key, value in bias.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            return requirement
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            return requirement
        if not _is_real(value) or abs(value) > _LOGIT_BIAS_LIMIT:
            return requirement
    return None
