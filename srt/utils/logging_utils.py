"""Logging set-up shared by the main process and the child processes."""

from __future__ import annotations

import logging

_FORMAT = "[%(asctime)s %(srt_process)s] %(levelname)s %(name)s: %(message)s"


class _ProcessNameFilter(logging.Filter):
    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def filter(self, record: logging.LogRecord) -> bool:
        record.srt_process = self.process_name
        return True


def configure_logging(level: str = "info", process_name: str = "main", logger_name: str = "srt") -> None:
    """Give ``logger_name`` one stderr handler in srt's format (idempotent).

    The main process configures the ``srt`` logger only (an embedding application keeps its own
    root configuration; the ``srt`` logger stops propagating to avoid duplicate lines); child
    processes pass ``logger_name=""`` to configure their root logger.
    """
    root = logging.getLogger(logger_name)
    root.setLevel(level.upper())
    if logger_name:
        root.propagate = False
    for h in root.handlers:
        if getattr(h, "_srt_handler", False):
            h.filters.clear()
            h.addFilter(_ProcessNameFilter(process_name))
            return
    handler = logging.StreamHandler()
    handler._srt_handler = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_ProcessNameFilter(process_name))
    root.addHandler(handler)
