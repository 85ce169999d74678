"""GenerateReqInput: one native generation request, declared once: the body of POST /generate
(decoded by `GenerateReqInput.from_json`, which refuses fields srt cannot honour: see
`srt.managers.tokenizer.generate_fields`), what ``Engine.generate`` builds, and what the OpenAI
routes build from their requests.

In-process only (it never crosses a socket; `srt.managers.tokenizer.input_processor` turns it into
``io_struct.TokenizedGenerateReqInput``s). A request is *single* (``text: str`` or
``input_ids: list[int]``) or a *batch* (``text: list[str]`` or ``input_ids: list[list[int]]``);
per-prompt fields (``sampling_params``, ``rid``, ``return_logprob`` ...) are either one value for
all prompts or a list with one value per prompt. `expand` normalizes this into `SingleInput`s.
``sampling_params`` stays the user's dict here; `srt.sampling.user_params.parse_sampling_params`
turns it into a verified `SamplingParams`.

How a route serves the request (``incremental_stream``, ``add_special_tokens``, ``param_names``)
is not part of the body: class defaults that a route overrides on its instance with `serve_as`, so
no client can set them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import msgspec

from srt.managers.tokenizer.generate_fields import check_extra_fields
from srt.sampling.sampling_params import MAX_N
from srt.sampling.user_params import type_error
from srt.utils.errors import RequestError


def surrogate_message(body: bytes) -> str | None:
    """The message for a body that a strict JSON parser refused but Python's reads whole: what it
    holds is then an unpaired UTF-16 surrogate escape (``"\\ud800"``), which strict parsers report
    as truncated input or a bad hex escape. None when Python's parser refuses it too."""
    try:
        json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return "a string holds an unpaired UTF-16 surrogate escape (such as \\ud800), which is no character"


def _decode_error(body: bytes, e: msgspec.DecodeError) -> str:
    """msgspec's message for a body it cannot decode, except for a lone surrogate escape, which it
    calls truncated input."""
    return (surrogate_message(body) if "truncated" in str(e) else None) or str(e)


def _n_of(sampling_params: Any) -> int:
    n = sampling_params.get("n", 1) if isinstance(sampling_params, dict) else 1
    return min(n, MAX_N) if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


class GenerateReqInput(msgspec.Struct, kw_only=True, dict=True):
    """The /generate body (SGLang's shape; one prompt or a batch). Construction does not check
    types (`from_json` does, for HTTP bodies); `expand` checks shapes."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None  # token ids, or one list of them per prompt
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    # first prompt position whose logprob is returned (-1: no prompt logprobs)
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    # each logprob entry's third slot holds its token's text (decoded alone), else None
    return_text_in_logprobs: bool = False
    stream: bool = False
    # queue priority (higher first; needs --enable-priority-scheduling); None: not given (0)
    priority: int | list[int] | None = None
    # seconds from the server's receipt after which the request is aborted with a "timeout"
    # finish reason (HTTP: the body field, else the X-Request-Timeout header); None: no deadline
    timeout: float | None = None
    # the LoRA adapter (a loaded adapter's name; SGLang's field name) of every prompt, or one entry
    # per prompt; None: the base model
    lora_path: str | list[str | None] | None = None
    # images (SGLang's shapes): one prompt's image or list of images; a batch's list with one
    # entry (an image, a list of them, or null) per prompt. Each image: a data: URI, an http(s)
    # URL, a base64 string (srt/multimodal/image_io.py)
    image_data: str | list[Any] | None = None

    # ---- how the route serves it (not body fields; `serve_as` sets them on one instance)
    # streamed chunks hold only the new output (True) or the whole output so far (False); None:
    # the server's --incremental-streaming-output (the OpenAI routes always ask for deltas)
    incremental_stream: ClassVar[bool | None] = None
    # False for text that already holds the special tokens (chat-templated prompts)
    add_special_tokens: ClassVar[bool] = True
    # how the caller names SamplingParams fields in error messages (OpenAI: max_new_tokens -> max_tokens)
    param_names: ClassVar[Mapping[str, str]] = MappingProxyType({})

    @classmethod
    def from_json(cls, body: bytes) -> GenerateReqInput:
        """The request of a JSON body (an empty body is ``{}``). `RequestError` (code
        ``invalid_type``) for malformed JSON or a mistyped field; for a field of SGLang's that srt
        cannot honour, or one neither knows (`check_extra_fields`)."""
        try:
            obj = msgspec.json.decode(body or b"{}", type=cls)
            top = msgspec.json.decode(body or b"{}", type=dict[str, msgspec.Raw])
        except msgspec.ValidationError as e:
            raise type_error(str(e)) from None
        except msgspec.DecodeError as e:
            raise RequestError(
                f"malformed JSON body: {_decode_error(body, e)}", code="invalid_type"
            ) from None
        extra = {k: msgspec.json.decode(v) for k, v in top.items() if k not in cls.__struct_fields__}
        if extra:
            check_extra_fields(extra, cls.__struct_fields__)
        return obj

    def serve_as(
        self,
        *,
        incremental_stream: bool | None = None,
        add_special_tokens: bool = True,
        param_names: Mapping[str, str] | None = None,
    ) -> GenerateReqInput:
        """Set how this request is served (see the fields' comments); returns ``self``."""
        self.__dict__.update(
            incremental_stream=incremental_stream,
            add_special_tokens=add_special_tokens,
            param_names=MappingProxyType(dict(param_names or {})),
        )
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def sequence_count(self) -> int:
        """How many sequences the request asks for (prompts x n), counted without expanding it:
        a shape `expand` refuses counts its prompts, an n out of range counts as at most `MAX_N`
        (the sampling checks refuse it)."""
        src = self.text if self.text is not None else self.input_ids
        batch = isinstance(src, list) and bool(src) and (self.text is not None or isinstance(src[0], list))
        prompts = len(src) if batch else 1  # type: ignore[arg-type]
        sp = self.sampling_params
        if isinstance(sp, list):
            return sum(_n_of(d) for d in sp[:prompts]) + max(0, prompts - len(sp))
        return prompts * _n_of(sp)

    def checked_timeout(self) -> float | None:
        """``timeout`` validated: a finite number of seconds > 0 (`RequestError` otherwise)."""
        t = self.timeout
        if t is None:
            return None
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise RequestError(f"timeout must be a number of seconds > 0, got {t!r}", param="timeout")
        return float(t)

    def expand(self) -> list[SingleInput]:
        """One `SingleInput` per prompt (shape errors raise `RequestError`)."""
        if self.text is None and self.input_ids is None:
            raise RequestError("either text (prompt) or input_ids must be given", param="prompt")
        if self.text is not None and self.input_ids is not None:
            raise RequestError("give either text or input_ids, not both", param="input_ids")
        if self.text is not None:
            prompts: list[Any] = self.text if isinstance(self.text, list) else [self.text]
            if not all(isinstance(t, str) for t in prompts):
                raise RequestError("text must be a string or a list of strings", param="prompt")
        else:
            ids = self.input_ids
            if not isinstance(ids, list):
                raise RequestError("input_ids must be a list of token ids or a list of such lists")
            prompts = ids if ids and isinstance(ids[0], list) else [ids]
            for p in prompts:
                if not isinstance(p, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p
                ):
                    raise RequestError(
                        "input_ids must be a list of integers or a list of such lists", param="prompt"
                    )
        if not prompts:
            raise RequestError("the batch of prompts is empty", param="prompt")
        n = len(prompts)
        sps = _per_prompt(self.sampling_params, n, "sampling_params", dict)
        rids = _per_prompt(self.rid, n, "rid", str)
        rlp = _per_prompt(self.return_logprob, n, "return_logprob", bool)
        lsl = _per_prompt(self.logprob_start_len, n, "logprob_start_len", int)
        tln = _per_prompt(self.top_logprobs_num, n, "top_logprobs_num", int)
        pri = _per_prompt(self.priority, n, "priority", int)
        lora = self.lora_path
        loras = _per_prompt(lora if isinstance(lora, list) else [lora] * n, n, "lora_path", str)
        images = _images_per_prompt(self.image_data, n, self.is_batch)
        out = []
        for i, p in enumerate(prompts):
            if tln[i] < 0:
                raise RequestError(f"top_logprobs_num must be >= 0, got {tln[i]}", param="top_logprobs_num")
            if lsl[i] < -1:
                raise RequestError(
                    f"logprob_start_len must be >= 0 (a prompt position) or -1 (none), got {lsl[i]}",
                    param="logprob_start_len",
                )
            out.append(
                SingleInput(
                    text=p if isinstance(p, str) else None,
                    input_ids=p if isinstance(p, list) else None,
                    sampling_params=dict(sps[i] or {}),
                    rid=rids[i] or uuid.uuid4().hex,
                    return_logprob=bool(rlp[i]) or tln[i] > 0,
                    logprob_start_len=lsl[i],
                    top_logprobs_num=tln[i],
                    priority=pri[i],
                    lora_path=loras[i],
                    image_data=images[i][0] if images[i] else None,
                    image_params=(getattr(self, "image_params", None) or images[i][1]) if images[i] else None,
                )
            )
        return out


@dataclass
class SingleInput:
    text: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]
    rid: str
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    priority: int | None = None
    lora_path: str | None = None  # a LoRA adapter's name (checked by the input processor)
    image_data: list[Any] | None = None  # the prompt's images (srt/managers/tokenizer/image_prompts.py)
    image_params: list[str] | None = None  # how the request names each image (errors)


def _images_per_prompt(data: Any, n: int, batch: bool) -> list[tuple[list[Any], list[str]] | None]:
    """Each prompt's images and how the request names each (None: no image) from SGLang's
    ``image_data`` shapes."""
    if data is None:
        return [None] * n
    if not batch:  # (one prompt's images are image_data[j], however given)
        return [_images_of(data if isinstance(data, list) else [data], "image_data")]
    if not isinstance(data, list) or len(data) != n:
        raise RequestError(f"image_data must be a list with one entry per prompt ({n})", param="image_data")
    return [_images_of(entry, f"image_data[{i}]") for i, entry in enumerate(data)]


def _images_of(entry: Any, name: str) -> tuple[list[Any], list[str]] | None:
    """One prompt's images (an image or a list of them) and their names; None for none."""
    if entry is None or entry == []:
        return None
    images, names = (
        (entry, [f"{name}[{j}]" for j in range(len(entry))]) if isinstance(entry, list) else ([entry], [name])
    )
    for im, where in zip(images, names):
        if not isinstance(im, (str, bytes)) and type(im).__module__.split(".")[0] != "PIL":
            raise RequestError(
                f"{where} must be an image (a data: URI, a URL, base64; a PIL image in-process), "
                f"got {type(im).__name__}",
                param=where,
            )
    return images, names


def _per_prompt(value: Any, n: int, name: str, kind: type) -> list[Any]:
    if isinstance(value, list) and kind is not list:
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompts", param=name)
        for v in value:
            _check_type(v, name, kind)
        return value
    _check_type(value, name, kind)
    if kind is str and value is not None and n > 1:
        return [f"{value}-{i}" for i in range(n)]
    return [value] * n


def _check_type(value: Any, name: str, kind: type) -> None:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if value is not None and not ok:
        raise RequestError(f"{name} must be a {kind.__name__}, got {type(value).__name__}", param=name)
