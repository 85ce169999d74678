"""Test-only fault injection: ``SRT_TEST_FAULT`` (read once by the scheduler process).

Values (documented in docs/configuration.md, "Environment"; never set it in production):

    stall_forward_after:N       after N forwards ran, the next one never returns: it sleeps in
                                a loop (``time.sleep``: the GIL is released)
    stall_forward_gil_after:N   the same, but blocked inside a C call that holds the GIL (libc
                                ``sleep`` called through ``ctypes.PyDLL``): no other thread of
                                the process runs Python code any more

The hang watchdog's tests use them to stall the scheduler on purpose. Unset or empty: no fault.
An unknown value is a `ConfigError` (a typo must not silently test nothing).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass

from srt.utils.errors import ConfigError

logger = logging.getLogger(__name__)

FAULT_ENV = "SRT_TEST_FAULT"
_KINDS = ("stall_forward_after", "stall_forward_gil_after")


@dataclass(slots=True)
class FaultHook:
    """``before_forward()`` is called right before each forward; it counts them and stalls the
    one after the first ``after`` forwards when ``kind`` is set."""

    kind: str | None = None
    after: int = 0
    forwards: int = 0

    @classmethod
    def parse(cls, value: str | None) -> FaultHook:
        if not value:
            return cls()
        kind, sep, n = value.partition(":")
        if kind not in _KINDS or not sep or not n.isdigit():
            raise ConfigError(f"{FAULT_ENV}={value!r}: expected one of {', '.join(k + ':N' for k in _KINDS)}")
        return cls(kind, int(n))

    @classmethod
    def from_env(cls) -> FaultHook:
        hook = cls.parse(os.environ.get(FAULT_ENV))
        if hook.kind is not None:
            logger.warning("test fault armed: %s:%d (%s)", hook.kind, hook.after, FAULT_ENV)
        return hook

    def before_forward(self) -> None:
        if self.kind is None:
            return
        self.forwards += 1
        if self.forwards <= self.after:
            return
        logger.warning("test fault: stalling forward %d for good (%s)", self.forwards, self.kind)
        if self.kind == "stall_forward_gil_after":
            stall_forward_holding_gil()
        else:
            stall_forward_sleeping()


def stall_forward_sleeping() -> None:
    """Never returns; sleeps with the GIL released."""
    while True:
        time.sleep(1.0)


def stall_forward_holding_gil() -> None:
    """Never returns; blocks in libc ``sleep`` with the GIL held (``PyDLL`` keeps the GIL over
    the call). A signal interrupts ``sleep``; the loop goes back to it."""
    libc = ctypes.PyDLL(None)
    while True:
        libc.sleep(3600)
