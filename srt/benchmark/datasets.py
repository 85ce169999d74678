"""Seeded benchmark workloads, each a list of ``DatasetRow``.

Every sampler takes a ``numpy.random.Generator`` so that one ``--seed`` fixes the whole
workload. Prompt lengths are measured with the benchmark tokenizer on the final prompt (what
the server will see for text prompts); ``prompt_ids`` is set only for ``random-ids`` rows,
which backends that accept token ids send as ids (exact lengths).

* ``random``: input/output lengths uniform in ``[max(1, int(L * range_ratio)), L]``; text made
  of vocabulary tokens that are a space followed by ASCII letters (so that text -> tokens is
  stable), or windows of ShareGPT text when a local dataset file is given.
* ``random-ids``: the same lengths, token ids uniform over the non-special vocabulary.
* ``sharegpt``: first human/gpt turn pairs of a local ShareGPT JSON file; output length from
  the reference answer (or ``--sharegpt-output-len``); SGLang's length filters.
* ``generated-shared-prefix``: ``num_groups`` system prompts, each shared by
  ``prompts_per_group`` questions; rows shuffled so that groups interleave.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the datasets use."""

    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def __len__(self) -> int: ...


@dataclass(slots=True)
class DatasetRow:
    prompt: str
    prompt_len: int
    output_len: int
    prompt_ids: list[int] | None = None


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def sample_lengths(rng: np.random.Generator, n: int, max_len: int, range_ratio: float) -> list[int]:
    """n lengths uniform in ``[max(1, int(max_len * range_ratio)), max_len]`` (inclusive)."""
    if max_len < 1:
        raise ValueError(f"length must be >= 1, got {max_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    lo = max(1, int(max_len * range_ratio))
    return [int(x) for x in rng.integers(lo, max_len + 1, size=n)]


def word_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of tokens that are a leading-space marker followed by 2+ ASCII letters ("Ġthe", "▁cat").

    Text made of these re-tokenizes to the same ids with byte-level and sentencepiece BPE, so a
    prompt of n such tokens is n tokens long on the server too.
    """
    special = set(tokenizer.all_special_ids)
    ids: list[int] = []
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or not tok or tok[0] not in ("Ġ", "▁"):
            continue
        body = tok[1:]
        if len(body) >= 2 and body.isascii() and body.isalpha():
            ids.append(i)
    if not ids:
        raise ValueError("the tokenizer has no word tokens with a leading-space marker")
    return ids


def _text_of_length(tokenizer: Tokenizer, pool: Sequence[int], rng: np.random.Generator, n: int) -> str:
    ids = [int(pool[j]) for j in rng.integers(0, len(pool), size=n)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def _window_text(tokenizer: Tokenizer, corpus_ids: list[int], rng: np.random.Generator, n: int) -> str:
    """n tokens of a corpus starting at a random offset (wrapping around)."""
    start = int(rng.integers(0, len(corpus_ids)))
    ids = [corpus_ids[(start + k) % len(corpus_ids)] for k in range(n)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def load_sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with at least two turns."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") or []
        if len(conv) >= 2:
            pairs.append((str(conv[0].get("value", "")), str(conv[1].get("value", ""))))
    if not pairs:
        raise ValueError(f"{path}: no conversation with two turns (ShareGPT format expected)")
    return pairs


def sample_random_requests(
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    random_ids: bool = False,
    dataset_path: str | None = None,
) -> list[DatasetRow]:
    """The ``random`` / ``random-ids`` workloads (see the module docstring)."""
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    rows = []
    if random_ids:
        special = set(tokenizer.all_special_ids)
        pool = np.array([i for i in range(len(tokenizer)) if i not in special])
        for n, o in zip(in_lens, out_lens):
            ids = [int(x) for x in pool[rng.integers(0, len(pool), size=n)]]
            rows.append(DatasetRow(tokenizer.decode(ids), n, o, prompt_ids=ids))
        return rows
    corpus: list[int] | None = None
    if dataset_path:
        text = "\n".join(h for h, _ in load_sharegpt_pairs(dataset_path))
        corpus = tokenizer.encode(text, add_special_tokens=False)
    pool_ids = word_token_ids(tokenizer) if corpus is None else []
    for n, o in zip(in_lens, out_lens):
        if corpus is not None:
            prompt = _window_text(tokenizer, corpus, rng, n)
        else:
            prompt = _text_of_length(tokenizer, pool_ids, rng, n)
        rows.append(DatasetRow(prompt, count_tokens(tokenizer, prompt), o))
    return rows


def sample_sharegpt_requests(
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    dataset_path: str,
    num_prompts: int,
    fixed_output_len: int | None = None,
    context_len: int | None = None,
) -> list[DatasetRow]:
    """``num_prompts`` ShareGPT rows in a seeded order, filtered like SGLang: prompt and output
    at least 4 tokens (when the output length comes from the reply), prompt <= 1024 and prompt +
    output <= 2048 tokens (or <= ``context_len`` when given)."""
    pairs = load_sharegpt_pairs(dataset_path)
    order = rng.permutation(len(pairs))
    rows: list[DatasetRow] = []
    for j in order:
        if len(rows) == num_prompts:
            break
        prompt, reply = pairs[int(j)]
        p_len = count_tokens(tokenizer, prompt)
        o_len = fixed_output_len if fixed_output_len is not None else count_tokens(tokenizer, reply)
        if p_len < 4 or (fixed_output_len is None and o_len < 4):
            continue
        if context_len is not None:
            if p_len + o_len > context_len:
                continue
        elif p_len > 1024 or p_len + o_len > 2048:
            continue
        rows.append(DatasetRow(prompt, p_len, o_len))
    if len(rows) < num_prompts:
        raise ValueError(f"{dataset_path}: only {len(rows)} usable conversations, {num_prompts} requested")
    return rows


def sample_generated_shared_prefix_requests(
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
) -> list[DatasetRow]:
    """Groups of prompts sharing a system prompt: ``system + "\\n\\n" + question``."""
    pool = word_token_ids(tokenizer)
    rows = []
    for _ in range(num_groups):
        system = _text_of_length(tokenizer, pool, rng, system_prompt_len)
        for _ in range(prompts_per_group):
            prompt = system + "\n\n" + _text_of_length(tokenizer, pool, rng, question_len)
            rows.append(DatasetRow(prompt, count_tokens(tokenizer, prompt), output_len))
    return [rows[int(i)] for i in rng.permutation(len(rows))]


def load_jsonl_requests(tokenizer: Tokenizer, path: str, num_prompts: int) -> list[DatasetRow]:
    """The rows of a JSON-lines file, one ``{"prompt": str, "output_len": int}`` per line, in file
    order, cycled to ``num_prompts`` (e.g. benchmarks/data/*.jsonl)."""
    rows: list[DatasetRow] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if not isinstance(item.get("prompt"), str) or not isinstance(item.get("output_len"), int):
                raise ValueError(f"{path}:{n}: need a string 'prompt' and an int 'output_len'")
            rows.append(
                DatasetRow(item["prompt"], count_tokens(tokenizer, item["prompt"]), item["output_len"])
            )
    if not rows:
        raise ValueError(f"{path}: no rows")
    return [rows[i % len(rows)] for i in range(num_prompts)]


def get_dataset(args: argparse.Namespace, tokenizer: Tokenizer, rng: np.random.Generator) -> list[DatasetRow]:
    """The workload ``--dataset-name`` names, from the parsed flags of ``srt.bench_serving``."""
    name = args.dataset_name
    if name in ("random", "random-ids"):
        return sample_random_requests(
            tokenizer,
            rng,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            random_ids=name == "random-ids",
            dataset_path=args.dataset_path,
        )
    if name == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file)")
        return sample_sharegpt_requests(
            tokenizer,
            rng,
            args.dataset_path,
            args.num_prompts,
            args.sharegpt_output_len,
            args.sharegpt_context_len,
        )
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix_requests(
            tokenizer,
            rng,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
        )
    if name == "jsonl":
        if not args.dataset_path:
            raise SystemExit("--dataset-name jsonl needs --dataset-path (prompt and output_len per line)")
        return load_jsonl_requests(tokenizer, args.dataset_path, args.num_prompts)
    raise SystemExit(f"unknown --dataset-name {name!r}")
