"""``SRT_TEST_OVERLAP_SCHEDULE=1``: a test run in which overlap scheduling is on by default on
CPU, for the schedulers built in-process (the resolution default is patched when pytest starts)
and for the servers the tests launch (``--enable-overlap-schedule`` added unless the test chose).
tests/integration/test_overlap_suites.py reruns the scheduler and server suites that way."""

from __future__ import annotations

import os

ENV = "SRT_TEST_OVERLAP_SCHEDULE"
_FLAGS = ("--enable-overlap-schedule", "--disable-overlap-schedule")


def forced() -> bool:
    return os.environ.get(ENV) == "1"


def force_default_on() -> None:
    """Overlap scheduling on by default on CPU in this process (only under ``ENV``)."""
    from srt.configs import server_args_resolve

    server_args_resolve.OVERLAP_BY_DEFAULT["cpu"] = True


def server_args(args: list[str]) -> list[str]:
    """A test server's flags, with overlap scheduling turned on under ``ENV`` where allowed."""
    if not forced() or any(f in args for f in _FLAGS) or "--tp-size" in args:
        return args
    return [*args, "--enable-overlap-schedule"]
