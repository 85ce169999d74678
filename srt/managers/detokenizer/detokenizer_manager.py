"""DetokenizerManager: token ids -> incremental text, stop strings.

Data path (one process, blocking ZMQ, no polling):

    scheduler --BatchTokenIDOut--> [PULL detokenizer_ipc_name] DetokenizerManager
        --BatchStrOut--> [PUSH tokenizer_ipc_name]         (every other message forwarded unchanged)
        --StopStringHit--> [PUSH scheduler_input_ipc_name]

Per request the manager keeps a `DecodeState`. Text is committed in windows:

    ids:   [ ........ committed ........ | new ]
                       surr_offset ^      ^ read_offset
    delta = decode(ids[surr:]) - decode(ids[surr:read])

The window ``ids[surr:read]`` (the previous chunk) gives the tokenizer the context it needs for
leading spaces; a delta ending in U+FFFD (an incomplete UTF-8 sequence split across tokens) is not
committed until a later token completes it, so no emitted text ever contains a broken character.

Guarantees of the emitted text (``BatchStrOut.output_strs`` are increments):
- stop strings are matched in the committed text, across token boundaries; the output ends right
  before the match (or right after it with ``no_stop_trim``); the finish reason is
  ``FinishReason.of_stop(<the stop string>)`` and a `StopStringHit` tells the scheduler to stop
  generating; later outputs of that rid are dropped;
- a streaming client never receives text that is trimmed later: the longest suffix of the text
  that is a prefix of some stop string is held back until it is decided;
- a request finished by a stop token id (EOS or ``stop_token_ids``; ``matched`` is an int) does not
  include that token's text unless ``no_stop_trim``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from srt.managers.io_struct import (
    BatchStrOut,
    BatchTokenIDOut,
    FinishReason,
    StopStringHit,
    detokenizer_input_decoder,
    encode,
)
from srt.server_args import PortArgs, ServerArgs
from srt.utils.cpu_affinity import confine_aux_process
from srt.utils.hf_tokenizer import load_decode_tokenizer, special_token_ids, tokenizer_source
from srt.utils.zmq import get_zmq_socket

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# rids finished by a stop string whose scheduler-side finish has not been seen yet
_MAX_STOPPED_RIDS = 65536


@dataclass(slots=True)
class DecodeState:
    """Incremental detokenization state of one request (see the module docstring)."""

    ids: list[int] = field(default_factory=list)  # output ids whose text is decoded (stop token excluded)
    surr_offset: int = 0
    read_offset: int = 0
    text: str = ""  # committed text, never ending in a partial character
    sent_offset: int = 0  # len(text) already emitted


class DetokenizerManager:
    """Pure detokenization logic (no sockets): `handle_batch_token_id_out` maps one scheduler output
    to one `BatchStrOut` (or None when every entry was dropped) plus the `StopStringHit`s to send.
    ``tokenizer=None`` (``--skip-tokenizer-init``) passes token ids through with empty text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)
        self.states: dict[str, DecodeState] = {}
        self.stopped_rids: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ decoding
    def decode(self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool) -> str:
        """Text of ``ids``. With special tokens kept and ``spaces_between_special_tokens``, one space
        separates a special token from neighbouring text that has no whitespace at that side."""
        tok = self.tokenizer
        if tok is None:  # --skip-tokenizer-init: token ids only
            return ""
        if skip_special_tokens or not spaces_between_special_tokens or self.special_ids.isdisjoint(ids):
            return tok.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        pieces: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in self.special_ids:
                if run:
                    pieces.append(tok.decode(run, clean_up_tokenization_spaces=False))
                    run = []
                pieces.append(tok.convert_ids_to_tokens(t))
            else:
                run.append(t)
        if run:
            pieces.append(tok.decode(run, clean_up_tokenization_spaces=False))
        # runs are maximal, so of two consecutive pieces at least one is a special token
        out = pieces[0]
        for piece in pieces[1:]:
            if out and piece and not out[-1].isspace() and not piece[0].isspace():
                out += " "
            out += piece
        return out

    def _commit(self, st: DecodeState, skip: bool, spaces: bool, flush: bool) -> None:
        """Decode the uncommitted ids of ``st``; commit the delta unless it ends mid-character
        (``flush``: commit anyway, the request is over)."""
        if st.read_offset >= len(st.ids):
            return
        prefix = self.decode(st.ids[st.surr_offset : st.read_offset], skip, spaces)
        full = self.decode(st.ids[st.surr_offset :], skip, spaces)
        if not full.startswith(prefix):  # tokenizer not prefix-stable: fall back to a common prefix
            n = 0
            while n < min(len(prefix), len(full)) and prefix[n] == full[n]:
                n += 1
            prefix = prefix[:n]
        delta = full[len(prefix) :]
        if delta.endswith(_REPLACEMENT_CHAR) and not flush:
            return
        st.text += delta
        st.surr_offset = st.read_offset
        st.read_offset = len(st.ids)

    # ------------------------------------------------------------------ one batch
    def handle_batch_token_id_out(
        self, recv: BatchTokenIDOut
    ) -> tuple[BatchStrOut | None, list[StopStringHit]]:
        keep: list[int] = []
        strs: list[str] = []
        reasons: list[FinishReason | None] = []
        hits: list[StopStringHit] = []
        for i, rid in enumerate(recv.rids):
            if rid in self.stopped_rids:
                if recv.finished_reasons[i] is not None:
                    del self.stopped_rids[rid]
                continue
            text, reason, hit = self._handle_one(recv, i)
            keep.append(i)
            strs.append(text)
            reasons.append(reason)
            if hit is not None:
                hits.append(hit)
        if not keep:
            return None, hits

        def pick(values: list) -> list:
            return [values[i] for i in keep] if values else []

        out = BatchStrOut(
            rids=pick(recv.rids),
            output_strs=strs,
            output_ids=pick(recv.output_ids),
            finished_reasons=reasons,
            prompt_tokens=pick(recv.prompt_tokens),
            completion_tokens=pick(recv.completion_tokens),
            cached_tokens=pick(recv.cached_tokens),
            output_token_logprobs=pick(recv.output_token_logprobs),
            output_top_logprobs=pick(recv.output_top_logprobs),
            input_token_logprobs=pick(recv.input_token_logprobs),
            input_top_logprobs=pick(recv.input_top_logprobs),
            queue_times=pick(recv.queue_times),
            prefill_times=pick(recv.prefill_times),
            decode_times=pick(recv.decode_times),
            spec_accept_lens=pick(recv.spec_accept_lens),
            pooled_outputs=pick(recv.pooled_outputs),
        )
        return out, hits

    def _handle_one(
        self, recv: BatchTokenIDOut, i: int
    ) -> tuple[str, FinishReason | None, StopStringHit | None]:
        rid = recv.rids[i]
        reason = recv.finished_reasons[i]
        no_stop_trim = recv.no_stop_trim[i]
        stops = [s for s in recv.stop_strs[i] if s]
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = DecodeState()
        new_ids = list(recv.output_ids[i])
        matched = reason.matched if reason is not None and reason.type == "stop" else None
        if isinstance(matched, int) and not no_stop_trim and new_ids and new_ids[-1] == matched:
            new_ids = new_ids[:-1]  # the stop token's text is not part of the output
        st.ids.extend(new_ids)
        old_len = len(st.text)
        self._commit(
            st, recv.skip_special_tokens[i], recv.spaces_between_special_tokens[i], reason is not None
        )

        hit: StopStringHit | None = None
        if stops:
            found = _find_stop(st.text, stops, old_len)
            if found is not None:
                pos, s = found
                end = pos + len(s) if no_stop_trim else pos
                delta = st.text[st.sent_offset : end]
                if reason is None:
                    hit = StopStringHit(rid=rid, matched=s)
                    self.stopped_rids[rid] = None
                    if len(self.stopped_rids) > _MAX_STOPPED_RIDS:
                        self.stopped_rids.popitem(last=False)
                del self.states[rid]
                return delta, FinishReason.of_stop(s), hit
        if reason is not None:
            del self.states[rid]
            return st.text[st.sent_offset :], reason, None
        end = len(st.text) - _held_back(st.text, st.sent_offset, stops)
        delta = st.text[st.sent_offset : end]
        st.sent_offset = end
        return delta, None, None


def _find_stop(text: str, stops: list[str], old_len: int) -> tuple[int, str] | None:
    """Earliest stop-string match that ends after ``old_len`` (earlier ones were found before)."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(0, old_len - len(s) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def _held_back(text: str, sent: int, stops: list[str]) -> int:
    """Length of the longest suffix of ``text[sent:]`` that is a proper prefix of a stop string.
    Per stop string only the positions of its first character in the tail are tried, earliest
    (longest suffix) first, each with one comparison."""
    hold = 0
    n = len(text)
    avail = n - sent
    for s in stops:
        first, end = s[0], n - hold  # a longer hold starts before ``end``
        p = text.find(first, n - min(len(s) - 1, avail), end)
        while p != -1:
            if s.startswith(text[p:]):
                hold = n - p
                break
            p = text.find(first, p + 1, end)
    return hold


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, pipe_writer: Any, tokenizer_path: str | None = None
) -> None:
    """Process entry: step aside from the compute CPUs (`confine_aux_process`: pinned to the spare
    CPUs, or niced), load the tokenizer, report ready, then serve forever (blocking recv)."""
    confine_aux_process(server_args.cpu_omp_threads_bind, server_args.aux_process_nice, "detokenizer")
    tokenizer = None
    if not server_args.skip_tokenizer_init:
        # decoding never needs torch, and a fast tokenizer's not even transformers (hf_tokenizer.py)
        tokenizer = load_decode_tokenizer(
            tokenizer_path or tokenizer_source(server_args), server_args.trust_remote_code
        )
    manager = DetokenizerManager(tokenizer)
    ctx = zmq.Context(io_threads=1)
    recv_sock = get_zmq_socket(ctx, zmq.PULL, port_args.detokenizer_ipc_name, bind=True)
    to_tokenizer = get_zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)
    to_scheduler = get_zmq_socket(ctx, zmq.PUSH, port_args.scheduler_input_ipc_name, bind=False)
    pipe_writer.send({"status": "ready"})
    pipe_writer.close()
    while True:
        raw = recv_sock.recv()
        msg = detokenizer_input_decoder.decode(raw)
        if not isinstance(msg, BatchTokenIDOut):
            to_tokenizer.send(raw)
            continue
        out, hits = manager.handle_batch_token_id_out(msg)
        for hit in hits:
            to_scheduler.send(encode(hit))
        if out is not None:
            to_tokenizer.send(encode(out))
