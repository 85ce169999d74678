"""Tiny child-process targets for ProcessSupervisor tests (spawn imports them by name)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def ready_then_wait(tag: str, pipe_writer: Any) -> None:
    pipe_writer.send({"status": "ready", "tag": tag})
    time.sleep(600)


def ready_then_exit(code: int, pipe_writer: Any) -> None:
    pipe_writer.send({"status": "ready"})
    time.sleep(0.5)
    os._exit(code)


def raise_error(message: str, pipe_writer: Any) -> None:
    raise ValueError(message)


def exit_silently(code: int, pipe_writer: Any) -> None:
    os._exit(code)


def hang(seconds: float, pipe_writer: Any) -> None:
    time.sleep(seconds)


def report_transformers_import_hook(pipe_writer: Any) -> None:
    """Whether transformers' import-table hook is in place before the target runs."""
    import sys

    from srt.utils.transformers_import import _ImportUtilsFinder

    hook = any(isinstance(f, _ImportUtilsFinder) for f in sys.meta_path)
    pipe_writer.send({"status": "ready", "hook": hook, "transformers": "transformers" in sys.modules})


def kill_self(pipe_writer: Any) -> None:
    """Die by SIGKILL before reporting ready (as the out-of-memory killer stops a process)."""
    os.kill(os.getpid(), signal.SIGKILL)
