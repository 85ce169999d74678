"""The two workloads of bench_speculative.py, written to benchmarks/data/ (committed; rerun to
regenerate them identically: everything is drawn from a fixed seed).

- ``spec_copy.jsonl``: copy-heavy chat prompts, where the answer repeats most of the prompt: rename
  an identifier in a Python module, change one field in a JSON document, fix the typos of a text.
  The code, the records and the text are generated here (random identifiers, values and sentences
  from small word lists), so the files are ours and fixed.
- ``spec_free.jsonl``: free generation (stories, explanations, lists) with nothing to copy.

Each line is ``{"prompt": str, "output_len": int}`` (``srt.bench_serving --dataset-name jsonl``).

    python -m benchmarks.spec_workloads
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
NUM_PROMPTS = 24
COPY_OUTPUT_LEN = 400
FREE_OUTPUT_LEN = 200

_WORDS = (
    "river stone lamp window garden paper engine harbor market winter signal bridge forest "
    "letter copper meadow station thunder mirror valley candle orbit ladder silver canyon"
).split()
_VERBS = "read write count merge split check load store parse build clean send".split()
_NOUNS = "items orders users files rows events records tokens pages blocks".split()
_SUBJECTS = (
    "The old lighthouse keeper",
    "A young engineer",
    "The village council",
    "Our research team",
    "The night train",
    "A quiet librarian",
)
_PREDICATES = (
    "repaired the broken signal before the storm arrived",
    "counted every crate that reached the harbor",
    "wrote a long letter about the winter market",
    "measured the river after three days of rain",
    "planted a row of apple trees along the road",
    "found an old map hidden behind the mirror",
    "explained the new schedule to the passengers",
    "kept a careful record of the copper prices",
)
_TOPICS = (
    "a robot who learns to paint",
    "how bread rises",
    "the water cycle",
    "a city under the sea",
    "why the sky is blue",
    "a friendship between a cat and a crow",
    "how a bicycle stays upright",
    "the first day at a new school",
)
_ASKS = ("Write a short story about {}.", "Explain {} to a ten-year-old.", "Write a poem about {}.")


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _code_prompt(rng: random.Random) -> str:
    funcs = []
    names = rng.sample([f"{v}_{n}" for v in _VERBS for n in _NOUNS], 4)
    for name in names:
        arg, acc = rng.choice(_NOUNS), rng.choice(_WORDS)
        limit = rng.randint(2, 90)
        funcs.append(
            f"def {name}({arg}, limit={limit}):\n"
            f'    """Return the {acc} total of the first {limit} {arg}."""\n'
            f"    {acc} = 0\n"
            f"    for i, item in enumerate({arg}):\n"
            f"        if i >= limit:\n"
            f"            break\n"
            f"        {acc} += len(str(item)) * {rng.randint(2, 9)}\n"
            f"    return {acc}\n"
        )
    old = names[rng.randrange(len(names))]
    new = _ident(rng) + "_v2"
    code = "\n\n".join(funcs)
    return (
        f"Rename the function `{old}` to `{new}` in this Python module. Reply with the complete "
        f"updated module only.\n\n```python\n{code}```"
    )


def _json_prompt(rng: random.Random) -> str:
    records = []
    for i in range(rng.randint(5, 7)):
        records.append(
            {
                "id": i + 1,
                "name": f"{rng.choice(_WORDS)} {rng.choice(_WORDS)}",
                "status": rng.choice(["open", "pending", "closed"]),
                "count": rng.randint(1, 500),
                "tags": rng.sample(_WORDS, 2),
            }
        )
    target = rng.randint(1, len(records))
    doc = json.dumps({"records": records}, indent=2)
    return (
        f'Set the "status" of the record with "id" {target} to "archived" in this JSON document. '
        f"Reply with the complete JSON only.\n\n{doc}"
    )


def _typo(word: str, rng: random.Random) -> str:
    if len(word) < 4:
        return word
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


def _text_prompt(rng: random.Random) -> str:
    sentences = [f"{rng.choice(_SUBJECTS)} {rng.choice(_PREDICATES)}." for _ in range(rng.randint(7, 10))]
    words = " ".join(sentences).split(" ")
    noisy = [_typo(w, rng) if rng.random() < 0.12 else w for w in words]
    return "Fix the spelling mistakes in this text. Reply with the corrected text only.\n\n" + " ".join(noisy)


def copy_rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    makers = (_code_prompt, _json_prompt, _text_prompt)
    return [{"prompt": makers[i % 3](rng), "output_len": COPY_OUTPUT_LEN} for i in range(NUM_PROMPTS)]


def free_rows(seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(NUM_PROMPTS):
        ask = _ASKS[i % len(_ASKS)].format(rng.choice(_TOPICS))
        rows.append({"prompt": ask, "output_len": FREE_OUTPUT_LEN})
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    DATA.mkdir(exist_ok=True)
    write(DATA / "spec_copy.jsonl", copy_rows())
    write(DATA / "spec_free.jsonl", free_rows())
    print(f"wrote {DATA / 'spec_copy.jsonl'} and {DATA / 'spec_free.jsonl'} ({NUM_PROMPTS} prompts each)")


if __name__ == "__main__":
    main()
