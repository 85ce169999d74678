"""Constrained decoding: grammars (JSON schema, regex, EBNF) that limit which tokens may follow.

    base.py                 GrammarSpec (what a request asked for), GrammarError, the Grammar and
                            GrammarBackend interfaces
    registry.py             the backends by --grammar-backend name, create_grammar_backend
    llguidance_backend.py   the default backend (llguidance: no compile step, masks computed lazily)
    xgrammar_backend.py     the alternative (xgrammar: compiled grammars, cached), if installed
    bitmask.py              token bitmasks ([rows, ceil(vocab / 32)] int32) applied to logits, and
                            the closing tokens that steer an output nearing its budget to its end

The scheduler owns the per-request matchers (srt/managers/scheduler/grammar.py); the sampler only
applies the bitmask rows it is given. Nothing here imports model code.
"""
