"""Running an in-process `Scheduler` to the end and reading back what each request produced."""

from __future__ import annotations

from typing import Any

import torch


def drain(sched: Any) -> dict[str, tuple[list[int], list[dict]]]:
    """Step ``sched`` until idle, then shut it down (and free CUDA's cache); returns, per rid, its
    output ids and each output token's top logprobs (``{token id: logprob}``). No request may end
    in an abort."""
    out: dict[str, tuple[list[int], list[dict]]] = {}
    for o in sched.run_until_idle():
        for j, rid in enumerate(o.rids):
            assert o.finished_reasons[j] is None or not o.finished_reasons[j].is_abort, o.finished_reasons[j]
            ids, tops = out.setdefault(rid, ([], []))
            ids.extend(o.output_ids[j])
            tops.extend(dict(t) for t in o.output_top_logprobs[j])
    sched.worker.shutdown()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out
