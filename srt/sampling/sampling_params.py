"""Per-request sampling parameters (SGLang's names and defaults): validation and normalisation, once.

`SamplingParams` is a ``msgspec.Struct``: it travels inside ``TokenizedGenerateReqInput`` over
msgpack, so it holds only plain values. A user's dict becomes a verified, normalized
`SamplingParams` in `srt.sampling.user_params.parse_sampling_params` (the tokenizer manager, before
anything is sent); `SamplingParams.normalize` is the one place that decides greedy, resolves
``max_new_tokens`` and clamps, and everything after it (the wire, the scheduler,
`SamplingBatchInfo`) reads the canonical form it leaves.

Conventions:
- ``temperature == 0`` (anything below ``GREEDY_EPS``) means greedy decoding; `normalize()` turns it
  into the canonical greedy form ``temperature=0.0, top_k=1`` (``top_k == 1`` then marks a greedy row).
- ``top_k == -1`` disables top-k. ``top_k == 0`` is accepted as a synonym (HF / some OpenAI-style
  clients use 0 for "disabled") and `normalize()` rewrites it to -1, as it does a ``top_k`` at or
  above the vocabulary size when it knows that size.
- ``max_new_tokens=None`` means "as many as fit": `normalize(bounds)` resolves it with
  `resolve_max_new_tokens` once the prompt length is known.
- ``seed=None`` means "no seed given": the scheduler draws one at admission so that every request
  samples from a reproducible (seed, position) noise stream.
- ``logit_bias`` maps token ids written as decimal strings (OpenAI's shape) to an additive bias in
  [-100, 100].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

GREEDY_EPS = 1e-6
# seeds are reduced to 64 bits for the counter-based noise; accept the signed and unsigned range
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_LOGIT_BIAS_LIMIT = 100.0
MAX_N = 128  # copies of one prompt (OpenAI's limit): a bigger n is a denial of service, not a request
# the detokenizer looks for every stop string after each step: thousands would stall every stream
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 64, 512
_SHOWN_CHARS = 200  # of a bad value's repr in an error message (a huge value is not echoed back)
_CONSTRAINTS = ("json_schema", "regex", "ebnf")
_FLAGS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


class SamplingParamsError(ValueError):
    """One invalid sampling parameter.

    ``param`` is the field name, ``value`` the offending value; ``str(err)`` is a complete message
    naming the parameter, the value and the allowed range (suitable for an HTTP 400 body).
    """

    def __init__(self, param: str, value: Any, requirement: str) -> None:
        self.param = param
        self.value = value
        self.requirement = requirement
        super().__init__(f"{param} {requirement}, got {self.shown}")

    @property
    def shown(self) -> str:
        """The value as the message shows it: its repr, cut after ``_SHOWN_CHARS`` characters."""
        r = repr(self.value)
        return r if len(r) <= _SHOWN_CHARS else f"{r[:_SHOWN_CHARS]}... ({len(r)} characters)"


@dataclass(frozen=True, slots=True)
class LengthBounds:
    """What bounds one request's output: its prompt, the model's context, the whole KV pool."""

    prompt_len: int
    context_len: int
    max_total_tokens: int

    @property
    def room(self) -> int:
        """Tokens left for the output (negative when the prompt alone does not fit)."""
        return min(self.context_len, self.max_total_tokens) - self.prompt_len


def resolve_max_new_tokens(
    requested: int | None, prompt_len: int, context_len: int, max_total_tokens: int
) -> int:
    """``max_new_tokens`` of a request: None means "as many as fit" -- up to the context length
    and the whole KV pool (never below 0)."""
    if requested is not None:
        return requested
    return max(0, LengthBounds(prompt_len, context_len, max_total_tokens).room)


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
        """The greedy rule (temperature ~0 or top_k == 1), applied by `normalize`; after it a
        greedy request is exactly ``top_k == 1``."""
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
        """Every invalid value, one `SamplingParamsError` each, in ``_RULES`` order (empty list
        when valid). ``vocab_size`` (when given) bounds ``stop_token_ids`` and ``logit_bias`` keys."""
        errs = []
        for param, rule in _RULES:
            requirement = rule(self, vocab_size)
            if requirement is not None:
                errs.append(SamplingParamsError(param, getattr(self, param), requirement))
        return errs

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise the first `SamplingParamsError` found (see `validation_errors` for all of them)."""
        errs = self.validation_errors(vocab_size)
        if errs:
            raise errs[0]

    def normalize(
        self,
        bounds: LengthBounds | None = None,
        *,
        vocab_size: int | None = None,
        max_new_tokens_given: bool = True,
    ) -> SamplingParams:
        """Rewrite to canonical form in place (call after `verify`); returns ``self``. Idempotent.

        - ``stop``: a string becomes a one-element list;
        - greedy (`is_greedy`) becomes ``temperature=0.0, top_k=1``;
        - ``top_k`` 0, or at or above ``vocab_size`` (when given), becomes -1 (disabled);
        - with ``bounds``: ``max_new_tokens=None`` becomes `resolve_max_new_tokens` (as many as
          fit), and a default the client did not send (``max_new_tokens_given=False``) is capped
          to the room the prompt leaves (at least 1): the default never makes a request fail.
        """
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.is_greedy:
            self.temperature = 0.0
            self.top_k = 1
        elif self.top_k == 0 or (vocab_size is not None and self.top_k >= vocab_size):
            self.top_k = -1
        if bounds is not None:
            if self.max_new_tokens is None:
                b = bounds
                self.max_new_tokens = resolve_max_new_tokens(
                    None, b.prompt_len, b.context_len, b.max_total_tokens
                )
            elif not max_new_tokens_given:
                self.max_new_tokens = max(min(self.max_new_tokens, bounds.room), 1)
        return self

    def logit_bias_items(self) -> list[tuple[int, float]]:
        """``logit_bias`` as ``(token_id, bias)`` pairs (empty when none). Assumes verified params."""
        if not self.logit_bias:
            return []
        return [(int(k), float(v)) for k, v in self.logit_bias.items()]


# ---------------------------------------------------------------------- the rules
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_Rule = Callable[[SamplingParams, "int | None"], "str | None"]


def _field(name: str, ok: Callable[[Any], bool], requirement: str) -> _Rule:
    """A rule on one field's value alone."""
    return lambda p, _vocab: None if ok(getattr(p, name)) else requirement


def _min_new_tokens(p: SamplingParams, _vocab: int | None) -> str | None:
    if not _is_int(p.min_new_tokens) or p.min_new_tokens < 0:
        return "must be an integer >= 0"
    mnt = p.max_new_tokens
    if _is_int(mnt) and mnt >= 0 and p.min_new_tokens > mnt:  # type: ignore[operator]
        return f"must be <= max_new_tokens ({mnt})"
    return None


def _stop(p: SamplingParams, _vocab: int | None) -> str | None:
    stops = [p.stop] if isinstance(p.stop, str) else p.stop
    if stops is None:
        return None
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        return "must be a non-empty string or a list of non-empty strings"
    longest = max(map(len, stops), default=0)
    if len(stops) <= MAX_STOP_STRINGS and longest <= MAX_STOP_STRING_CHARS:
        return None
    return (
        f"must be at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters "
        f"({len(stops)} given, the longest of {longest})"
    )


def _stop_token_ids(p: SamplingParams, vocab: int | None) -> str | None:
    ids = p.stop_token_ids
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
        return "must be a list of integers >= 0"
    if vocab is not None and any(t >= vocab for t in ids):
        return f"must be token ids in [0, {vocab})"
    return None


def _constraint(name: str) -> _Rule:
    """json_schema / regex / ebnf: a non-empty string, and at most one of them (the grammar itself
    is checked by the grammar backend)."""

    def rule(p: SamplingParams, _vocab: int | None) -> str | None:
        v = getattr(p, name)
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip():
            return "must be a non-empty string"
        given = [c for c in _CONSTRAINTS if getattr(p, c) is not None]
        if len(given) > 1 and given[1] == name:
            return f"cannot be combined with {given[0]} (give at most one of json_schema, regex, ebnf)"
        return None

    return rule


def _logit_bias(p: SamplingParams, vocab: int | None) -> str | None:
    bias = p.logit_bias
    if bias is None:
        return None
    upper = f"{vocab}" if vocab is not None else "vocab_size"
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
        if tid < 0 or (vocab is not None and tid >= vocab):
            return requirement
        if not _is_real(value) or abs(value) > _LOGIT_BIAS_LIMIT:
            return requirement
    return None


def _penalty(name: str) -> tuple[str, _Rule]:
    return name, _field(name, lambda v: _is_real(v) and -2.0 <= v <= 2.0, "must be in [-2, 2]")


# (param, rule): every rule returns the requirement a bad value breaks, or None; errors are
# reported in this order
_RULES: tuple[tuple[str, _Rule], ...] = (
    (
        "max_new_tokens",
        _field(
            "max_new_tokens",
            lambda v: v is None or (_is_int(v) and v >= 0),
            "must be an integer >= 0 (or null for 'up to the context length')",
        ),
    ),
    ("min_new_tokens", _min_new_tokens),
    (
        "temperature",
        _field(
            "temperature", lambda v: _is_real(v) and v >= 0.0, "must be a finite number >= 0 (0 means greedy)"
        ),
    ),
    ("top_p", _field("top_p", lambda v: _is_real(v) and 0.0 < v <= 1.0, "must be in (0, 1]")),
    (
        "top_k",
        _field(
            "top_k",
            lambda v: _is_int(v) and (v == -1 or v >= 0),
            "must be -1 (disabled), 0 (also disabled) or an integer >= 1",
        ),
    ),
    ("min_p", _field("min_p", lambda v: _is_real(v) and 0.0 <= v <= 1.0, "must be in [0, 1]")),
    _penalty("frequency_penalty"),
    _penalty("presence_penalty"),
    (
        "repetition_penalty",
        _field(
            "repetition_penalty",
            lambda v: _is_real(v) and 0.0 < v <= 2.0,
            "must be in (0, 2] (1 disables it)",
        ),
    ),
    ("stop", _stop),
    ("stop_token_ids", _stop_token_ids),
    *((name, _field(name, lambda v: isinstance(v, bool), "must be a boolean")) for name in _FLAGS),
    *((name, _constraint(name)) for name in _CONSTRAINTS),
    ("n", _field("n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"must be in [1, {MAX_N}]")),
    (
        "seed",
        _field(
            "seed",
            lambda v: v is None or (_is_int(v) and _SEED_MIN <= v <= _SEED_MAX),
            f"must be an integer in [{_SEED_MIN}, {_SEED_MAX}] or null",
        ),
    ),
    ("logit_bias", _logit_bias),
)
_RULE_OF = dict(_RULES)


def check_param(param: str, value: Any) -> SamplingParamsError | None:
    """``param``'s own rule (one that needs no other field and no vocabulary) applied to ``value``
    before a `SamplingParams` exists; the error it breaks, or None."""
    requirement = _RULE_OF[param](SamplingParams(**{param: value}), None)
    return None if requirement is None else SamplingParamsError(param, value, requirement)
