"""Pooled outputs of prefill-only requests: embeddings and label-token logprobs.

An embedding request pools the model's final hidden states (after the last norm: what
transformers' ``AutoModel(...).last_hidden_state`` holds) of its prompt into one vector:

    "last"   the hidden state of the last prompt token (decoder embedding models)
    "mean"   the mean over every prompt token
    "cls"    the hidden state of the first prompt token

Per segment (sequence ``i``: batch rows ``[extend_start_loc[i], + extend_seq_lens[i])``,
positions ``prefix_len .. seq_len - 1``) `pool_segments` returns a partial result that the
scheduler combines over the chunks of a chunked prompt (`combine`): "last" keeps the last
chunk's row, "mean" sums the rows of every chunk (divided by the prompt length at the end),
"cls" keeps row 0 of the chunk at position 0. "mean" and "cls" need every prompt position in
some chunk, so such a request reuses no cached prefix (`Req.prefix_match_key`); "last" needs
only the last token, which is always recomputed, so a cached prefix is fine.

A score request (``label_token_ids``) gets the log-softmax of its next-token logits (the last
row of its prompt) at those ids: `label_logprobs`.

Normalisation (L2) and Matryoshka truncation happen in the main process, on the raw vector.
"""

from __future__ import annotations

import torch

POOLING_METHODS = ("last", "mean", "cls")


def pool_segments(
    hidden_states: torch.Tensor, methods: list[str], lens: list[int], prefix_lens: list[int]
) -> list[torch.Tensor | None]:
    """Per sequence: its partial pooled vector (float32 CPU ``[hidden]``) or None (no pooling,
    or "cls" on a chunk that does not hold position 0). ``hidden_states [T, hidden]``; the
    vectors are gathered on the device and copied to the CPU at once."""
    parts: list[torch.Tensor] = []  # one [hidden] row per pooled sequence, on the device
    which: list[int] = []
    start = 0
    for i, method in enumerate(methods):
        n = lens[i]
        if method and n > 0:
            if method == "last":
                parts.append(hidden_states[start + n - 1])
            elif method == "mean":
                parts.append(hidden_states[start : start + n].float().sum(dim=0))
            elif method == "cls":
                if prefix_lens[i] == 0:
                    parts.append(hidden_states[start])
            else:
                raise ValueError(f"unknown pooling method {method!r}; expected one of {POOLING_METHODS}")
            if len(parts) > len(which):
                which.append(i)
        start += n
    out: list[torch.Tensor | None] = [None] * len(methods)
    if parts:
        rows = torch.stack([p.float() for p in parts]).cpu()
        for k, i in enumerate(which):
            out[i] = rows[k]
    return out


def combine(method: str, acc: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    """A request's pooled state after one more chunk (``acc``: before it; ``part``: the chunk's)."""
    if part is None:
        return acc
    if method == "mean" and acc is not None:
        return acc + part
    if method == "cls" and acc is not None:
        return acc
    return part


def finish(method: str, acc: torch.Tensor | None, prompt_len: int) -> list[float]:
    """The pooled vector of a whole prompt (raw, not normalised)."""
    if acc is None:
        return []
    if method == "mean":
        acc = acc / max(prompt_len, 1)
    return acc.tolist()


def label_logprobs(next_token_logits: torch.Tensor, label_ids: list[list[int]]) -> list[list[float]]:
    """Per sequence ``i``: log-softmax of ``next_token_logits[i]`` at ``label_ids[i]`` ([] for
    none). ``next_token_logits [bs, vocab]`` float32."""
    rows = [i for i, ids in enumerate(label_ids) if ids]
    out: list[list[float]] = [[] for _ in label_ids]
    if not rows:
        return out
    logprobs = torch.log_softmax(next_token_logits[rows].float(), dim=-1)
    for k, i in enumerate(rows):
        idx = torch.tensor(label_ids[i], dtype=torch.int64, device=logprobs.device)
        out[i] = logprobs[k].index_select(0, idx).tolist()
    return out
