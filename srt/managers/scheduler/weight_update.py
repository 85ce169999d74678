"""WeightUpdateGate: the scheduler's side of POST /update_weights_from_disk.

An update waits for the scheduler to go idle; meanwhile new requests are held here (not admitted),
so the requests already admitted (running and queued) finish on the old weights and the held ones
run on the new weights::

    submit(UpdateWeightsFromDiskReq)   pending (or refused: an update is already pending)
    hold(TokenizedGenerateReqInput)    True while an update is pending: the request waits here
    drop(rid)                          an abort of a held request ("" drops all)
    ... the scheduler steps until idle ...
    take() -> (the update, the held requests)   the scheduler reloads the weights (model runner),
                                                flushes the prefix cache (its KV came from the old
                                                weights), replies, then admits the held requests

The reload itself is the model runner's (``update_weights_from_disk``); a failed one leaves the
old weights serving and is answered ``success=False``.
"""

from __future__ import annotations

from srt.managers.io_struct import (
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)


class WeightUpdateGate:
    """See the module docstring."""

    def __init__(self) -> None:
        self.pending: UpdateWeightsFromDiskReq | None = None
        self.held: list[TokenizedGenerateReqInput] = []

    def submit(self, req: UpdateWeightsFromDiskReq) -> UpdateWeightsFromDiskReqOutput | None:
        """Accept ``req`` (None: the reply comes once it ran) or refuse it (the reply)."""
        if self.pending is not None:
            return UpdateWeightsFromDiskReqOutput(
                success=False,
                message=f"a weight update from {self.pending.model_path} is already in progress",
            )
        self.pending = req
        return None

    def hold(self, msg: TokenizedGenerateReqInput) -> bool:
        """Hold ``msg`` until the pending update ran (False: no update pending, admit it now)."""
        if self.pending is None:
            return False
        self.held.append(msg)
        return True

    def drop(self, rid: str) -> None:
        """Forget held requests aborted before they were admitted ("" drops every one)."""
        self.held = [m for m in self.held if rid and m.rid != rid]

    def take(self) -> tuple[UpdateWeightsFromDiskReq, list[TokenizedGenerateReqInput]]:
        """The pending update and the requests held behind it (the gate opens)."""
        assert self.pending is not None
        req, held = self.pending, self.held
        self.pending, self.held = None, []
        return req, held
