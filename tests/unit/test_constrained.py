"""Constrained decoding below the server: bitmasks, the grammar backends on the default model's
tokenizer, and the scheduler's GrammarManager (compile off the loop, cache, failures)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from srt.configs.backends import GRAMMAR_BACKENDS, module_importable, resolve_grammar_backend
from srt.constrained.base import GrammarError, GrammarSpec
from srt.constrained.bitmask import allocate_bitmask, apply_bitmask_, unpack_bitmask
from srt.constrained.registry import backend_class, create_grammar_backend
from srt.utils.errors import ConfigError

INSTALLED = [n for n, pkg in GRAMMAR_BACKENDS.items() if module_importable(pkg)]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}


# ---------------------------------------------------------------- bitmasks
def test_unpack_bitmask_matches_bit_arithmetic():
    gen = torch.Generator().manual_seed(0)
    vocab = 77
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    got = unpack_bitmask(mask, vocab)
    for r in range(3):
        for t in range(vocab):
            word = int(mask[r, t // 32]) & 0xFFFFFFFF
            assert bool(got[r, t]) == bool((word >> (t % 32)) & 1)


def test_apply_bitmask_only_touches_given_rows_and_disallowed_tokens():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 70, generator=gen)
    before = logits.clone()
    mask = allocate_bitmask(2, 70)
    mask[0].zero_()
    mask[0, 0] = 0b1010  # tokens 1 and 3
    mask[1, 2] = 0  # tokens 64.. disallowed
    apply_bitmask_(logits, torch.tensor([1, 3]), mask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [1, 3]
    assert torch.equal(logits[1, [1, 3]], before[1, [1, 3]])
    assert torch.isinf(logits[3, 64:]).all() and torch.equal(logits[3, :64], before[3, :64])


def test_apply_bitmask_disallows_tokens_past_the_mask():
    logits = torch.zeros(1, 40)
    apply_bitmask_(logits, torch.tensor([0]), allocate_bitmask(1, 32))  # covers 32 tokens
    assert torch.isfinite(logits[0, :32]).all() and torch.isinf(logits[0, 32:]).all()


# ---------------------------------------------------------------- backend choice
def test_resolve_grammar_backend():
    assert resolve_grammar_backend("none") == "none"
    assert resolve_grammar_backend("auto", lambda pkg: pkg == "xgrammar") == "xgrammar"
    assert resolve_grammar_backend("auto", lambda pkg: True) == "llguidance"
    assert resolve_grammar_backend("auto", lambda pkg: False) == "none"
    with pytest.raises(ConfigError, match="pip install xgrammar"):
        resolve_grammar_backend("xgrammar", lambda pkg: False)
    with pytest.raises(ConfigError, match="unknown"):
        resolve_grammar_backend("outlines")


def test_llguidance_is_installed_as_a_dependency():
    assert "llguidance" in INSTALLED


# ---------------------------------------------------------------- backends on the real tokenizer
@pytest.fixture(scope="module")
def tokenizer():
    from srt.server_args import ServerArgs
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    return load_tokenizer(tokenizer_source(ServerArgs()))


@pytest.fixture(scope="module", params=INSTALLED)
def backend(request, tokenizer):
    return create_grammar_backend(request.param, tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _constrained_sample(backend, tokenizer, spec: GrammarSpec, seed: int, max_steps: int = 300) -> str:
    """Sample from random logits under the grammar until it terminates (the way the sampler
    does: masked logits, then a draw)."""
    gen = torch.Generator().manual_seed(seed)
    g = backend.matcher(backend.compile(spec))
    vocab = len(tokenizer)
    out: list[int] = []
    eos = tokenizer.eos_token_id
    for _ in range(max_steps):
        mask = allocate_bitmask(1, vocab)
        g.fill_bitmask(mask, 0)
        logits = torch.randn(1, vocab, generator=gen) * 3
        apply_bitmask_(logits, torch.tensor([0]), mask)
        tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert g.accept_token(tok), g.error()
        if tok == eos:
            break
        out.append(tok)
        if g.is_terminated():
            break
    assert g.is_terminated(), "the grammar did not complete"
    return tokenizer.decode(out)


def test_json_schema_outputs_validate(backend, tokenizer):
    jsonschema = pytest.importorskip("jsonschema")
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    for seed in range(4):
        doc = json.loads(_constrained_sample(backend, tokenizer, spec, seed))
        jsonschema.validate(doc, SCHEMA)


def test_regex_outputs_match(backend, tokenizer):
    import re

    pattern = r"(cat|dog)-[0-9]{2,4}"
    for seed in range(3):
        text = _constrained_sample(backend, tokenizer, GrammarSpec("regex", pattern), seed)
        assert re.fullmatch(pattern, text), text


def test_ebnf_outputs_follow_the_grammar(backend, tokenizer):
    ebnf = 'root ::= "yes" | "no" | "maybe"'
    for seed in range(3):
        assert _constrained_sample(backend, tokenizer, GrammarSpec("ebnf", ebnf), seed) in (
            "yes",
            "no",
            "maybe",
        )


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("ebnf", "root ::= ( "),
    ],
)
@pytest.mark.parametrize("name", INSTALLED)
def test_invalid_grammars_raise_grammar_error(name, spec):
    with pytest.raises(GrammarError) as e:
        backend_class(name).validate(spec)
    assert e.value.param == spec.kind and str(e.value)


def test_grammar_spec_from_fields():
    assert GrammarSpec.from_fields(None, None, None) is None
    assert GrammarSpec.from_fields(None, "a+", None) == GrammarSpec("regex", "a+")
    assert hash(GrammarSpec("regex", "a+")) == hash(GrammarSpec("regex", "a+"))


# ---------------------------------------------------------------- GrammarManager
class _Req:
    def __init__(self, rid: str, spec: GrammarSpec) -> None:
        self.rid = rid
        self.grammar_spec = spec
        self.grammar = None


class _CountingBackend:
    """Wraps a real backend and counts compiles (the cache must make repeats free)."""

    def __init__(self, inner, delay: float = 0.0) -> None:
        self.inner = inner
        self.delay = delay
        self.compiles = 0

    def compile(self, spec):
        self.compiles += 1
        time.sleep(self.delay)
        return self.inner.compile(spec)

    def matcher(self, compiled):
        return self.inner.matcher(compiled)


def test_grammar_manager_compiles_off_the_caller_and_caches(tokenizer):
    from srt.managers.scheduler.grammar import GrammarManager

    inner = create_grammar_backend("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    counting = _CountingBackend(inner, delay=0.2)
    gm = GrammarManager(lambda: counting)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    a, b = _Req("a", spec), _Req("b", GrammarSpec("json_schema", json.dumps(SCHEMA)))
    t0 = time.perf_counter()
    gm.submit(a)
    gm.submit(b)
    assert gm.poll() == ([], [])  # nothing ready yet, and poll did not block
    assert time.perf_counter() - t0 < 0.15
    deadline = time.time() + 10
    ready: list = []
    while len(ready) < 2 and time.time() < deadline:
        r, failed = gm.poll(timeout=0.05)
        assert failed == []
        ready += r
    assert {r.rid for r in ready} == {"a", "b"} and counting.compiles == 1
    assert a.grammar is not None and b.grammar is not None and a.grammar is not b.grammar
    gm.shutdown()


def test_grammar_backend_is_built_after_an_idle_stretch_or_at_the_first_grammar():
    """`idle_tick`: the backend is built once the loop has been idle for WARM_UP_AFTER_IDLE_S in
    one stretch (work in between starts the count again), never while it is busy, and at once for
    the first grammar; the loop is told how long it may block until then."""
    from srt.managers.scheduler.grammar import WARM_UP_AFTER_IDLE_S, GrammarManager

    built: list[int] = []
    gm = GrammarManager(lambda: built.append(1) or object())
    w = WARM_UP_AFTER_IDLE_S
    assert gm.idle_tick(False, 0.0) is None and not gm.started
    assert gm.idle_tick(True, 1.0) == pytest.approx(w)
    assert gm.idle_tick(True, 1.0 + w / 2) == pytest.approx(w / 2)
    assert gm.idle_tick(False, 1.0 + w * 0.9) is None  # work: the stretch ends
    assert gm.idle_tick(True, 1.0 + w * 1.5) == pytest.approx(w) and not gm.started
    assert gm.idle_tick(True, 1.0 + w * 2.5) is None and gm.started
    assert gm.idle_tick(True, 100.0) is None
    gm._backend.result(timeout=10)
    assert built == [1]
    gm.shutdown()

    busy = GrammarManager(lambda: built.append(2) or object())
    for t in range(100):
        assert busy.idle_tick(False, float(t)) is None
    assert not busy.started
    busy.submit(_Req("a", GrammarSpec("regex", "a+")))  # the first grammar builds it at once
    assert busy.started
    busy.shutdown()


def test_grammar_manager_reports_failures_and_discards(tokenizer):
    from srt.managers.scheduler.grammar import GrammarManager

    inner = create_grammar_backend("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    gm = GrammarManager(lambda: inner)
    bad, gone = _Req("bad", GrammarSpec("regex", "(unclosed")), _Req("gone", GrammarSpec("regex", "x+"))
    gm.submit(bad)
    gm.submit(gone)
    assert gm.discard(gone) and not gm.discard(gone)
    deadline = time.time() + 10
    failed: list = []
    while not failed and time.time() < deadline:
        _, failed = gm.poll(timeout=0.05)
    assert [r.rid for r, _ in failed] == ["bad"] and "regex" in failed[0][1]
    assert gm.pending == []
    gm.shutdown()


class _Decoding:
    """What GrammarManager.accept reads and writes of a request."""

    def __init__(self, grammar) -> None:
        self.rid, self.grammar, self.output_ids, self.finished_reason = "r", grammar, [], None

    def finish(self, reason) -> None:
        self.finished_reason = reason


def _allowed(backend, grammar, vocab: int) -> list[int]:
    bitmask = allocate_bitmask(1, vocab)
    backend.fill_bitmasks([grammar], bitmask)
    return unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist()


def test_a_grammar_past_the_backends_limits_is_the_requests_400_a_masking_bug_a_500(tokenizer):
    """llguidance allows the token 'xxxx' for (x{1000}){1000}, then fails to consume it ("too many
    expressions constructed"): the grammar's size, not srt, so the request gets a 400. A token the
    grammar never allowed (as a wrong mask would let through) stays a 500. Either message is the
    error's first line, without the parser state llguidance appends."""
    from srt.managers.scheduler.grammar import GrammarManager

    backend = create_grammar_backend("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    huge = _Decoding(backend.matcher(backend.compile(GrammarSpec("regex", "(x{1000}){1000}"))))
    token = _allowed(backend, huge.grammar, len(tokenizer))[0]
    huge.output_ids.append(token)
    GrammarManager.accept(huge, token)
    reason = huge.finished_reason
    assert reason.type == "abort" and reason.status_code == 400, reason
    assert "too large for the grammar backend after 0 tokens" in reason.message and "\n" not in reason.message

    letters = _Decoding(backend.matcher(backend.compile(GrammarSpec("regex", "[a-z]{3}"))))
    bad = tokenizer.encode("1", add_special_tokens=False)[0]
    assert bad not in _allowed(backend, letters.grammar, len(tokenizer))
    GrammarManager.accept(letters, bad)
    reason = letters.finished_reason
    assert (
        reason.status_code == 500 and f"rejected token {bad}" in reason.message and "\n" not in reason.message
    )


def test_batched_mask_fill_equals_row_by_row(backend, tokenizer):
    """The backend's batch fill (llguidance: in parallel) gives each row its own matcher's mask."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compiled = backend.compile(spec)
    doc = tokenizer.encode(json.dumps({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "X"}}))
    grammars = []
    for n in (0, 2, 5, 9, 14):  # matchers at different points of the same document
        g = backend.matcher(compiled)
        for t in doc[:n]:
            assert g.accept_token(t), g.error()
        grammars.append(g)
    vocab = len(tokenizer)
    batched = allocate_bitmask(len(grammars), vocab)
    backend.fill_bitmasks(grammars, batched)
    one = allocate_bitmask(len(grammars), vocab)
    for k, g in enumerate(grammars):
        g.fill_bitmask(one, k)
    assert torch.equal(batched, one)
    assert len({tuple(r.tolist()) for r in one}) > 1  # the rows really differ


# ---------------------------------------------------------------- grammars after the reasoning
@pytest.fixture(scope="module")
def reasoning_backends(tokenizer):
    return {
        name: create_grammar_backend(
            "llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id], reasoning_parser=name
        )
        for name in ("deepseek-r1", "qwen3", "deepseek-v3", "qwen3-thinking")
    }


def _accepts(backend, tokenizer, spec: GrammarSpec, text: str) -> bool:
    g = backend.matcher(backend.compile(spec))
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return all(g.accept_token(t) for t in ids) and g.is_terminated()


@pytest.mark.parametrize(
    "parser,text,ok",
    [
        ("deepseek-r1", "Let me think. {x}</think>\n\ncat-12", True),
        ("deepseek-r1", "<think>hmm</think>dog-9999", True),
        ("deepseek-r1", "cat-12", False),  # deepseek-r1 outputs start inside the reasoning
        ("deepseek-r1", "hmm</think>bird-1", False),  # the answer still follows the grammar
        ("qwen3", "<think>a</think> cat-12", True),
        ("qwen3", "cat-12", True),  # no reasoning
        ("qwen3", "hmm</think>cat-12", False),
        ("deepseek-v3", "<think>a</think> dog-99", True),  # as qwen3
        ("deepseek-v3", "cat-12", True),
        ("qwen3-thinking", "hmm</think>cat-12", True),  # as deepseek-r1
        ("qwen3-thinking", "cat-12", False),
    ],
)
def test_grammar_applies_after_the_reasoning(reasoning_backends, tokenizer, parser, text, ok):
    spec = GrammarSpec("regex", r"(cat|dog)-[0-9]{2,4}")
    assert _accepts(reasoning_backends[parser], tokenizer, spec, text) is ok


def test_sampled_answer_after_reasoning_parses(reasoning_backends, tokenizer):
    """Reasoning written by the model, then an answer sampled under the mask: the reasoning parser
    splits it, and the answer validates against the schema."""
    from srt.parsers.reasoning import create_reasoning_parser

    backend = reasoning_backends["deepseek-r1"]
    g = backend.matcher(backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))))
    reasoning = tokenizer.encode("The user wants a person. [1, 2] {ok}</think>\n", add_special_tokens=False)
    for k, t in enumerate(reasoning):
        # inside the reasoning until its text holds </think>
        assert g.can_close() is ("</think>" in tokenizer.decode(reasoning[:k]))
        assert g.accept_token(t), g.error()
    assert g.can_close() is True
    gen = torch.Generator().manual_seed(5)
    out: list[int] = []
    for _ in range(300):
        mask = allocate_bitmask(1, len(tokenizer))
        g.fill_bitmask(mask, 0)
        logits = torch.randn(1, len(tokenizer), generator=gen) * 3
        apply_bitmask_(logits, torch.tensor([0]), mask)
        tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert g.accept_token(tok), g.error()
        if tok == tokenizer.eos_token_id:
            break
        out.append(tok)
        if g.is_terminated():
            break
    reasoning_text, answer = create_reasoning_parser("deepseek-r1").parse(tokenizer.decode(reasoning + out))
    assert reasoning_text.startswith("The user wants a person.")
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_closing_rule_waits_for_the_reasoning_to_end(reasoning_backends, tokenizer):
    from srt.managers.scheduler.grammar import GrammarManager

    backend = reasoning_backends["deepseek-r1"]
    gm = GrammarManager(lambda: backend)
    gm.warm_up()
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    req = _Req("r", spec)
    req.grammar = backend.matcher(backend.compile(spec))
    req.max_new_tokens, req.remaining_new_tokens = 100, 3  # deep inside the closing reserve
    _, inside = gm.fill_masks([req], [0], len(tokenizer))
    free = allocate_bitmask(1, len(tokenizer))
    req.grammar.fill_bitmask(free, 0)
    assert torch.equal(inside, free)  # reasoning: not narrowed to closing tokens
    for t in tokenizer.encode("ok</think>", add_special_tokens=False) + tokenizer.encode(
        '{"name": "A', add_special_tokens=False
    ):
        assert req.grammar.accept_token(t)
    _, answering = gm.fill_masks([req], [0], len(tokenizer))
    req.grammar.fill_bitmask(free, 0)
    assert not torch.equal(answering, free)  # inside the JSON string: narrowed to closing tokens
    gm.shutdown()


def test_reasoning_parser_with_xgrammar_is_refused_at_start_up():
    from srt.server_args import ServerArgs

    if not module_importable("xgrammar"):
        pytest.skip("xgrammar is not installed")
    with pytest.raises(ConfigError, match="llguidance backend only"):
        ServerArgs(reasoning_parser="qwen3", grammar_backend="xgrammar").resolve()


def test_closing_rule_prefers_separators_over_more_letters(tokenizer):
    """A regex that a weak model could extend forever (``[a-z]+``) moves on to its separator near
    the end of the budget; outside the reserve the mask is the grammar's own."""
    from srt.managers.scheduler.grammar import GrammarManager

    backend = create_grammar_backend("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    gm = GrammarManager(lambda: backend)
    gm.warm_up()
    spec = GrammarSpec("regex", r"[a-z]+@[a-z]+\.(com|org)")
    req = _Req("r", spec)
    req.grammar = backend.matcher(backend.compile(spec))
    for t in tokenizer.encode("alice", add_special_tokens=False):
        assert req.grammar.accept_token(t)
    req.max_new_tokens, req.remaining_new_tokens = 64, 60
    _, early = gm.fill_masks([req], [0], len(tokenizer))
    req.remaining_new_tokens = 4
    _, late = gm.fill_masks([req], [0], len(tokenizer))
    allowed_early = unpack_bitmask(early, len(tokenizer))[0].nonzero().flatten().tolist()
    allowed_late = unpack_bitmask(late, len(tokenizer))[0].nonzero().flatten().tolist()
    assert len(allowed_early) > 100 and allowed_late
    assert all(set(tokenizer.decode([t]).strip()) <= set("@") for t in allowed_late)
    gm.shutdown()
