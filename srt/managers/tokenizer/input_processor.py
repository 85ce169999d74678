"""Input normalization and validation: a `GenerateReqInput` -> a `PreparedRequest` (nothing sent).

    GenerateReqInput --expand()--> SingleInput per prompt
        --check_top_logprobs-----> top_logprobs_num within --max-top-logprobs-num
        --LoRARegistry.check-----> each prompt's lora_path a loaded adapter (or None: the base model)
        --parse_sampling_params--> verified SamplingParams (one message per bad value)
        --check_grammar----------> json_schema / regex / ebnf valid for the grammar backend
        --_check_text_lengths----> a text that needs more tokens than the context holds at any
                                   tokenization (`srt.utils.token_cover.TokenCover`): refused untokenized
        --TokenizeBatcher--------> token ids (prompts arriving together: one tokenizer call)
        --ImagePrompts.expand----> images loaded and preprocessed, their placeholders expanded
        --normalize(bounds)------> max_new_tokens resolved for the prompt (`SamplingParams.normalize`)
        --check_prompt-----------> vocabulary, the fit rule (`srt.managers.request_fit`), logprob_start_len
        --fan-out----------------> TokenizedGenerateReqInput per output (+ the n > 1 warm-up)

Every error is raised here, before the scheduler sees anything: `RequestError` (HTTP 400) or
its subclass `ContextLengthError` (the message gives the numbers); a ``priority`` without
``--enable-priority-scheduling`` is one. Admission control
(``--max-queued-requests``) is the registry's (`srt.managers.tokenizer.req_state.ReqRegistry.admit`).

``n > 1``: unless the radix cache is disabled, the prompt is first sent as a prefill-only request
(rid ``f"{rid}-prefill"``, ``max_new_tokens=0``) so that the n copies (rids ``f"{rid}-{i}"``,
seeds ``seed + i``) share its KV through the radix cache.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from srt.constrained.base import GrammarError, GrammarSpec
from srt.constrained.registry import backend_class
from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.request_fit import request_fit_error
from srt.managers.tokenizer.generate_input import GenerateReqInput, SingleInput
from srt.managers.tokenizer.image_prompts import ImagePrompts
from srt.managers.tokenizer.lora_registry import LoRARegistry
from srt.managers.tokenizer.tokenize_batcher import TokenizeBatcher
from srt.multimodal.inputs import MultimodalInputs
from srt.sampling.sampling_params import LengthBounds, SamplingParams
from srt.sampling.user_params import parse_sampling_params
from srt.utils.errors import ContextLengthError, RequestError
from srt.utils.token_cover import token_cover

# grammars already validated, remembered so that a repeated schema is not checked again
_VALID_GRAMMARS_KEPT = 1024


@dataclass(slots=True)
class PreparedRequest:
    """A validated request, ready for `TokenizerManager.run` (nothing sent yet)."""

    reqs: list[tuple[TokenizedGenerateReqInput, str]]  # (request, parent rid) per output index
    warmups: list[TokenizedGenerateReqInput]  # prefill-only requests to send first (n > 1)
    stream: bool
    is_batch: bool
    incremental: bool = True  # streamed chunks hold the new output only (else all of it so far)
    # return_text_in_logprobs: the text of each token id, decoded alone (None: the slots stay None)
    token_texts: Callable[[list[int]], list[str]] | None = None


@dataclass(frozen=True, slots=True)
class InputLimits:
    """What the scheduler reported that bounds a request (from its ready message)."""

    context_len: int
    max_total_num_tokens: int  # the whole KV pool in tokens (0: not reported)
    page_size: int
    vocab_size: int | None  # input ids must be below it (None: unknown)

    @classmethod
    def from_scheduler_info(cls, info: dict[str, Any], tokenizer: Any) -> InputLimits:
        """Limits of ``info`` (the scheduler's ready message); the vocabulary bound is the
        smaller of the model's and the tokenizer's (when there is one)."""
        known = [int(v) for v in (info.get("vocab_size"), len(tokenizer) if tokenizer else None) if v]
        return cls(
            context_len=int(info["context_len"]),
            max_total_num_tokens=int(info.get("max_total_num_tokens") or 0),
            page_size=int(info.get("page_size") or 1),
            vocab_size=min(known) if known else None,
        )

    @property
    def pool(self) -> int:
        """The KV pool bound for the fit rule (unbounded when not reported)."""
        return self.max_total_num_tokens or sys.maxsize


class InputProcessor:
    """Turns a `GenerateReqInput` into a `PreparedRequest` (see the module docstring)."""

    def __init__(
        self,
        limits: InputLimits,
        tokenizer: Any,
        share_prefill: bool,
        grammar_backend: str = "none",
        enable_priority: bool = False,
        max_top_logprobs: int | None = None,
        max_sequences: int | None = None,
        incremental_stream: bool = True,
        lora: LoRARegistry | None = None,
        images: ImagePrompts | None = None,
    ) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.share_prefill = share_prefill  # n > 1 sends a warm-up prefill (radix cache enabled)
        self.grammar_backend = grammar_backend  # resolved --grammar-backend
        self.enable_priority = enable_priority  # --enable-priority-scheduling
        self.max_top_logprobs = max_top_logprobs  # --max-top-logprobs-num (None: no bound)
        self.max_sequences = max_sequences  # --max-sequences-per-request (None: no bound)
        self.incremental_stream = incremental_stream  # --incremental-streaming-output
        self.lora = lora if lora is not None else LoRARegistry()  # the adapters a request may name
        self.images = images  # None: image inputs are refused (no model behind this processor)
        self._batcher: TokenizeBatcher | None = None
        # what one token covers at most: a text that needs more tokens than the context holds is
        # refused untokenized (a 200 MB prompt took the tokenizer minutes and 12 GiB)
        self._cover = token_cover(tokenizer) if tokenizer is not None else None
        self._texts: dict[int, str] = {}  # token id -> its text alone (return_text_in_logprobs)
        self._valid_grammars: OrderedDict[GrammarSpec, None] = OrderedDict()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the tokenize batcher to the serving event loop."""
        if self.tokenizer is not None:
            self._batcher = TokenizeBatcher(self.tokenizer, loop)

    async def prepare(self, obj: GenerateReqInput, in_use: Callable[[str], bool]) -> PreparedRequest:
        """Validate and tokenize ``obj`` (``in_use(rid)``: the rid belongs to a request in flight).
        Raises `RequestError` / `ContextLengthError`."""
        now = time.time()  # the server's receipt: the clock of ``timeout`` and ttft starts here
        timeout = obj.checked_timeout()
        count = obj.sequence_count()  # before the batch is expanded
        self._check_sequence_count(
            count, f"the request asks for {count} sequences (prompts x n)", "prompt" if obj.is_batch else "n"
        )
        singles = obj.expand()
        if not self.enable_priority and any(s.priority is not None for s in singles):
            raise RequestError(
                "priority needs a server started with --enable-priority-scheduling", param="priority"
            )
        self.lora.check_all(s.lora_path for s in singles)
        if obj.return_text_in_logprobs and self.tokenizer is None:
            raise RequestError(
                "return_text_in_logprobs needs the tokenizer (the server runs with --skip-tokenizer-init)",
                param="return_text_in_logprobs",
            )
        names = obj.param_names
        self.check_top_logprobs(singles, names)
        params = [parse_sampling_params(s.sampling_params, self.limits.vocab_size, names) for s in singles]
        for sp in params:
            self.check_grammar(sp)
        ids_list = await self._tokenize(singles, obj.add_special_tokens)
        mms = await self._expand_images(singles, ids_list)
        reqs: list[tuple[TokenizedGenerateReqInput, str]] = []
        warmups: list[TokenizedGenerateReqInput] = []
        seen: set[str] = set()
        deadline = now + timeout if timeout is not None else 0.0
        lim = self.limits
        for s, sp, (ids, mm) in zip(singles, params, mms):
            bounds = LengthBounds(len(ids), lim.context_len, lim.pool)
            sp.normalize(bounds, max_new_tokens_given="max_new_tokens" in s.sampling_params)
            self.check_prompt(s, sp, ids, names)
            if in_use(s.rid) or s.rid in seen:
                raise RequestError(f"rid {s.rid!r} is already in use", param="rid")
            seen.add(s.rid)
            self._fan_out(s, sp, (ids, mm), obj.stream, (now, deadline), reqs, warmups)
        incremental = self.incremental_stream if obj.incremental_stream is None else obj.incremental_stream
        texts = self._token_texts if obj.return_text_in_logprobs else None
        return PreparedRequest(reqs, warmups, obj.stream, obj.is_batch, incremental, texts)

    def _token_texts(self, ids: list[int]) -> list[str]:
        """Each id's text decoded alone, special tokens kept (SGLang's return_text_in_logprobs);
        remembered, so at most one decode per id of the vocabulary."""
        texts, decode = self._texts, self.tokenizer.decode
        for i in ids:
            if i not in texts:
                texts[i] = decode([i])
        return [texts[i] for i in ids]

    def _check_sequence_count(self, count: int, what: str, param: str) -> None:
        """At most --max-sequences-per-request sequences (``what``: how the message names them)."""
        if self.max_sequences is not None and count > self.max_sequences:
            raise RequestError(
                f"{what}; this server takes at most --max-sequences-per-request={self.max_sequences} "
                "in one request: send several",
                param=param,
            )

    def check_top_logprobs(self, singles: list[SingleInput], names: Mapping[str, str]) -> None:
        """Each prompt's top_logprobs_num within --max-top-logprobs-num."""
        bound = self.max_top_logprobs
        asked = max((s.top_logprobs_num for s in singles), default=0)
        if bound is not None and asked > bound:
            name = names.get("top_logprobs_num", "top_logprobs_num")
            raise RequestError(
                f"{name} must be <= {bound} on this server (--max-top-logprobs-num), got {asked}", param=name
            )

    def check_grammar(self, sp: SamplingParams) -> None:
        """``sp``'s json_schema / regex / ebnf is one the grammar backend accepts (RequestError
        naming the field otherwise); valid grammars are remembered (the check is not repeated)."""
        spec = GrammarSpec.from_fields(sp.json_schema, sp.regex, sp.ebnf)
        if spec is None or spec in self._valid_grammars:
            return
        if self.grammar_backend == "none" or self.tokenizer is None:
            why = "--grammar-backend none" if self.grammar_backend == "none" else "--skip-tokenizer-init"
            raise RequestError(f"{spec.kind}: constrained decoding is off on this server ({why})", spec.kind)
        try:
            backend_class(self.grammar_backend).validate(spec)
        except GrammarError as e:
            raise RequestError(str(e), param=e.param) from None
        self._valid_grammars[spec] = None
        if len(self._valid_grammars) > _VALID_GRAMMARS_KEPT:
            self._valid_grammars.popitem(last=False)

    async def _tokenize(self, singles: list[SingleInput], add_special_tokens: bool) -> list[list[int]]:
        texts = [self._prompt_text(s) for s in singles if s.text is not None]
        encoded: list[list[int]] = []
        if texts:
            if self._batcher is None:
                raise RequestError("the server runs with --skip-tokenizer-init: send input_ids, not text")
            self._check_text_lengths(texts)
            encoded = await self._batcher.encode(texts, add_special_tokens)
        it = iter(encoded)
        return [list(s.input_ids) if s.input_ids is not None else next(it) for s in singles]

    def _prompt_text(self, s: SingleInput) -> str:
        """The text to tokenize: a prompt with images as the model's processor writes it before
        tokenizing (Gemma 3 expands its image placeholders in the text)."""
        assert s.text is not None
        if s.image_data and self.images is not None and self.images.processor is not None:
            return self.images.processor.expand_text(s.text)
        return s.text

    async def _expand_images(
        self, singles: list[SingleInput], ids_list: list[list[int]]
    ) -> list[tuple[list[int], MultimodalInputs | None]]:
        if not any(s.image_data for s in singles) and (self.images is None or self.images.processor is None):
            return [(ids, None) for ids in ids_list]  # (text only: no task per prompt)
        if self.images is None:
            raise RequestError("this server takes no image input", param="image_data")
        jobs = [self.images.expand(ids, s.image_data, s.image_params) for s, ids in zip(singles, ids_list)]
        return list(await asyncio.gather(*jobs))

    async def tokenize(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """The token ids of each text (POST /tokenize); `RequestError` without a tokenizer or for
        a text too long for the context at any tokenization."""
        if self._batcher is None:
            raise RequestError("the server runs with --skip-tokenizer-init: it cannot tokenize")
        self._check_sequence_count(len(texts), f"{len(texts)} prompts to tokenize", "prompt")
        self._check_text_lengths(texts)
        return await self._batcher.encode(texts, add_special_tokens)

    def _check_text_lengths(self, texts: list[str]) -> None:
        """`ContextLengthError` for a text that needs more tokens than the context holds at any
        tokenization (`TokenCover`): it is never tokenized."""
        cover, ctx = self._cover, self.limits.context_len
        if cover is None:
            return
        for text in texts:
            if len(text) > ctx * cover.chars and (least := cover.min_tokens(text)) > ctx:
                raise ContextLengthError(
                    f"The input ({len(text)} characters, so at least {least} tokens) is longer than "
                    f"the model's context length ({ctx} tokens). Shorten the input.",
                    param="prompt",
                )

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The text of ``ids`` (POST /detokenize); `RequestError` for ids outside the vocabulary
        or without a tokenizer."""
        if self.tokenizer is None:
            raise RequestError("the server runs with --skip-tokenizer-init: it cannot detokenize")
        vocab = self.limits.vocab_size
        bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_prompt(
        self, s: SingleInput, sp: SamplingParams, ids: list[int], names: Mapping[str, str]
    ) -> None:
        """Token ids inside the vocabulary, the fit rule (empty prompt, context length, KV pool;
        ``sp`` normalized with the prompt's bounds), and ``logprob_start_len`` inside the prompt."""
        n = len(ids)
        vocab = self.limits.vocab_size
        if ids and vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if t < 0 or t >= vocab)
            raise RequestError(f"input token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        lim = self.limits
        m = sp.max_new_tokens
        assert m is not None, "normalize(bounds) resolves max_new_tokens"
        mnt_name = names.get("max_new_tokens", "max_new_tokens")
        err = request_fit_error(n, m, lim.context_len, lim.pool, lim.page_size, mnt_name)
        if err is not None:
            if err.context_length:
                raise ContextLengthError(err.message, param=err.param)
            raise RequestError(err.message, param="prompt")
        if s.return_logprob and s.logprob_start_len >= n:
            raise RequestError(
                f"logprob_start_len ({s.logprob_start_len}) must be < the prompt length ({n})",
                "logprob_start_len",
            )

    def _fan_out(
        self,
        s: SingleInput,
        sp: SamplingParams,
        prompt: tuple[list[int], MultimodalInputs | None],
        stream: bool,
        times: tuple[float, float],
        reqs: list[tuple[TokenizedGenerateReqInput, str]],
        warmups: list[TokenizedGenerateReqInput],
    ) -> None:
        """Append the request(s) of one prompt: itself when ``n == 1``, else its n copies (and
        the warm-up prefill they share). ``prompt``: (token ids, images); ``times``:
        (arrival_time, deadline)."""
        ids, mm = prompt
        base = TokenizedGenerateReqInput(
            rid=s.rid,
            input_ids=ids,
            sampling_params=sp,
            return_logprob=s.return_logprob,
            logprob_start_len=s.logprob_start_len if s.return_logprob else -1,
            top_logprobs_num=s.top_logprobs_num,
            stream=stream,
            priority=s.priority or 0,
            arrival_time=times[0],
            deadline=times[1],
            lora_name=s.lora_path or "",
            mm=mm,
        )
        if sp.n == 1:
            reqs.append((base, s.rid))
            return
        if self.share_prefill:
            warm_sp = msgspec.structs.replace(sp, n=1, max_new_tokens=0, min_new_tokens=0)
            warmups.append(
                msgspec.structs.replace(
                    base,
                    rid=f"{s.rid}-prefill",
                    sampling_params=warm_sp,
                    return_logprob=False,
                    logprob_start_len=-1,
                    top_logprobs_num=0,
                )
            )
        for j in range(sp.n):
            seed = None if sp.seed is None else (sp.seed + j) % (2**63)
            copy_sp = msgspec.structs.replace(sp, n=1, seed=seed)
            reqs.append((msgspec.structs.replace(base, rid=f"{s.rid}-{j}", sampling_params=copy_sp), s.rid))
