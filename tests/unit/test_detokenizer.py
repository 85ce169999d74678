"""DetokenizerManager: UTF-8 hold-back, stop strings across tokens, no trimmed text ever streamed."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from srt.managers.detokenizer.detokenizer_manager import DetokenizerManager, _held_back
from srt.managers.io_struct import BatchTokenIDOut, FinishReason


class ByteTokenizer:
    """A tokenizer whose token i is an arbitrary byte string (so tests can split UTF-8 at will)."""

    def __init__(self, pieces: list[bytes], special: dict[int, str] | None = None) -> None:
        self.pieces = pieces
        self.special = special or {}
        self.added_tokens_decoder = {
            i: SimpleNamespace(content=s, special=True) for i, s in self.special.items()
        }
        self.all_special_ids = list(self.special)

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        out = b""
        for i in ids:
            if i in self.special:
                if not skip_special_tokens:
                    out += self.special[i].encode()
            else:
                out += self.pieces[i]
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, i):
        return self.special.get(i) or self.pieces[i].decode("utf-8", errors="replace")


def step(rid: str, ids: list[int], *, stop=(), reason=None, no_stop_trim=False, skip=True, spaces=True):
    return BatchTokenIDOut(
        rids=[rid],
        output_ids=[ids],
        finished_reasons=[reason],
        prompt_tokens=[3],
        completion_tokens=[1],
        cached_tokens=[0],
        skip_special_tokens=[skip],
        spaces_between_special_tokens=[spaces],
        no_stop_trim=[no_stop_trim],
        stop_strs=[list(stop)],
    )


def run(mgr: DetokenizerManager, rid: str, tokens: list[int], **kw):
    """Feed tokens one per step (the last with finish reason length); return (deltas, reason, hits),
    the reason as SGLang's dict."""
    deltas, hits, reason = [], [], None
    for k, t in enumerate(tokens):
        last = k == len(tokens) - 1
        out, h = mgr.handle_batch_token_id_out(
            step(rid, [t], reason=FinishReason.of_length(len(tokens)) if last else None, **kw)
        )
        hits += h
        if out is not None:
            assert out.rids == [rid]
            deltas.append(out.output_strs[0])
            if out.finished_reasons[0] is not None:
                reason = out.finished_reasons[0].to_dict()
                break
    return deltas, reason, hits


def test_multibyte_char_split_across_tokens_is_held_back():
    # "世" = e4 b8 96 split over two tokens, "é" = c3 a9 split over two tokens
    tok = ByteTokenizer([b"h", b"\xe4\xb8", b"\x96", b"x", b"\xc3", b"\xa9"])
    mgr = DetokenizerManager(tok)
    deltas, reason, _ = run(mgr, "r", [0, 1, 2, 3, 4, 5])
    assert "".join(deltas) == "h世xé"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == ""  # the first half of 世 is not emitted alone
    assert reason == {"type": "length", "length": 6}
    assert mgr.states == {}


def test_incomplete_char_is_flushed_when_request_finishes():
    tok = ByteTokenizer([b"a", b"\xe4\xb8"])
    deltas, _, _ = run(DetokenizerManager(tok), "r", [0, 1])
    assert "".join(deltas) == "a\ufffd"


def test_stop_string_spanning_tokens_is_trimmed_and_reported():
    tok = ByteTokenizer([b"ab", b"cd", b"ef", b"gh"])
    mgr = DetokenizerManager(tok)
    deltas, reason, hits = run(mgr, "r", [0, 1, 2, 3], stop=["bcd"])
    assert "".join(deltas) == "a"
    assert deltas[0] == "a"  # "b" is held back: it may start the stop string
    assert reason == {"type": "stop", "matched": "bcd"}
    assert [(h.rid, h.matched) for h in hits] == [("r", "bcd")]
    # tokens the scheduler produced before it saw the hit are dropped, and so is its finish
    out, _ = mgr.handle_batch_token_id_out(step("r", [2]))
    assert out is None
    out, _ = mgr.handle_batch_token_id_out(step("r", [3], reason=FinishReason.of_abort("x")))
    assert out is None and "r" not in mgr.stopped_rids


def test_no_stop_trim_keeps_the_stop_string():
    tok = ByteTokenizer([b"ab", b"cd", b"ef"])
    deltas, reason, _ = run(DetokenizerManager(tok), "r", [0, 1, 2], stop=["bc"], no_stop_trim=True)
    assert "".join(deltas) == "abc"
    assert reason == {"type": "stop", "matched": "bc"}


def test_held_back_prefix_is_released_when_it_does_not_match():
    tok = ByteTokenizer([b"xa", b"b", b"z"])
    deltas, reason, hits = run(DetokenizerManager(tok), "r", [0, 1, 2], stop=["abc"])
    assert deltas == ["x", "", "abz"]
    assert reason["type"] == "length" and hits == []


def _held_back_reference(text: str, sent: int, stops: list[str]) -> int:
    """Every proper prefix of every stop string, longest first, against the end of the text."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text) - sent), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best


@pytest.mark.parametrize("seed", range(4))
def test_held_back_length_matches_the_reference(seed):
    """Small alphabets, so that stop strings' prefixes recur and overlap in the text."""
    rng = random.Random(seed)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abcé"
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 4))
        ]
        sent = rng.randint(0, len(text))
        assert _held_back(text, sent, stops) == _held_back_reference(text, sent, stops), (text, sent, stops)


def test_stop_token_id_text_is_not_included():
    tok = ByteTokenizer([b"a", b"b", b"."])
    mgr = DetokenizerManager(tok)
    out, _ = mgr.handle_batch_token_id_out(step("r", [0, 1]))
    out, _ = mgr.handle_batch_token_id_out(step("r", [2], reason=FinishReason.of_stop(2)))
    assert out.output_strs == [""] and out.output_ids == [[2]]
    assert [r.to_dict() for r in out.finished_reasons] == [{"type": "stop", "matched": 2}]
    mgr.handle_batch_token_id_out(step("k", [0]))
    out, _ = mgr.handle_batch_token_id_out(step("k", [2], reason=FinishReason.of_stop(2), no_stop_trim=True))
    assert out.output_strs == ["."]


def test_special_tokens_skipped_or_spaced():
    tok = ByteTokenizer([b"hi", b" there", b"x"], special={3: "<s>"})
    ids = [0, 3, 1, 3, 2]
    assert "".join(run(DetokenizerManager(tok), "a", ids)[0]) == "hi therex"
    assert "".join(run(DetokenizerManager(tok), "b", ids, skip=False, spaces=False)[0]) == "hi<s> there<s>x"
    assert "".join(run(DetokenizerManager(tok), "c", ids, skip=False, spaces=True)[0]) == "hi <s> there <s> x"


def test_batch_keeps_parallel_arrays_aligned():
    tok = ByteTokenizer([b"a", b"b", b"c"])
    mgr = DetokenizerManager(tok)
    mgr.handle_batch_token_id_out(step("s", [0], stop=["ab"]))
    recv = BatchTokenIDOut(
        rids=["s", "t"],
        output_ids=[[1], [2]],
        finished_reasons=[None, None],
        prompt_tokens=[1, 2],
        completion_tokens=[2, 1],
        cached_tokens=[0, 1],
        skip_special_tokens=[True, True],
        spaces_between_special_tokens=[True, True],
        no_stop_trim=[False, False],
        stop_strs=[["ab"], []],
        output_token_logprobs=[[-0.5], [-0.25]],
    )
    out, hits = mgr.handle_batch_token_id_out(recv)
    assert out.rids == ["s", "t"] and out.output_strs == ["", "c"]
    assert [h.rid for h in hits] == ["s"]
    recv.completion_tokens = [3, 2]
    recv.output_token_logprobs = [[-0.1], [-0.2]]
    out, _ = mgr.handle_batch_token_id_out(recv)  # "s" is stopped: only "t" remains, arrays aligned
    assert out.rids == ["t"] and out.completion_tokens == [2] and out.output_token_logprobs == [[-0.2]]


@pytest.mark.parametrize("seed", range(40))
def test_streamed_text_is_never_trimmed_later(seed):
    """Random one-character tokens and stop strings: every streamed prefix is a prefix of the
    final text, and the final text is the text before the first stop occurrence."""
    rng = random.Random(seed)
    alphabet = "abc"
    tok = ByteTokenizer([c.encode() for c in alphabet])
    tokens = [rng.randrange(3) for _ in range(30)]
    stops = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(1, 2))
    ]
    full = "".join(alphabet[t] for t in tokens)
    expected = full
    for e in range(1, len(full) + 1):  # first position at which some stop string ends
        ending = [s for s in stops if full[:e].endswith(s)]
        if ending:
            expected = full[: e - max(len(s) for s in ending)]
            break
    deltas, reason, _ = run(DetokenizerManager(tok), "r", tokens, stop=stops)
    streamed = ""
    for d in deltas:
        streamed += d
        assert expected.startswith(streamed)
    assert streamed == expected
    assert reason["type"] == ("stop" if expected != full or any(s in full for s in stops) else "length")


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from srt.server_args import ServerArgs
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    try:
        return load_tokenizer(tokenizer_source(ServerArgs()))
    except Exception as e:  # pragma: no cover - default model package missing
        pytest.skip(f"default tokenizer unavailable: {e}")


def test_real_tokenizer_emoji_and_cjk_split_across_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "Hi 世界 🎉 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters really are split over several tokens
    deltas, _, _ = run(DetokenizerManager(tok), "r", ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_real_tokenizer_stop_string_across_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    deltas, reason, hits = run(DetokenizerManager(tok), "r", ids, stop=["of Fr"])
    assert "".join(deltas) == "The capital "
    assert reason == {"type": "stop", "matched": "of Fr"} and len(hits) == 1
