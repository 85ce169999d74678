"""SchedulerProfiler: a torch profiler around the scheduler's steps (POST /start_profile, /stop_profile).

    handle(ProfileReq(action="start", output_dir, num_steps, activities))
        -> torch.profiler started now; the reply names the trace file it will write
    on_step()   after every scheduler step: with ``num_steps``, the profiler stops and writes the
                trace by itself once that many steps ran
    handle(ProfileReq(action="stop"))
        -> stopped; the trace written; the reply names the file

The trace is a Chrome trace (``chrome://tracing``, Perfetto), gzipped:
``<output_dir>/srt-<time_ns>.trace.json.gz``; ``output_dir`` defaults to
``$SRT_TORCH_PROFILER_DIR``, else ``/tmp/srt_profile``. Starting while running, stopping while
not running, an unknown activity or a GPU activity without a CUDA device get ``success=False``
(HTTP 400); the profiler never raises into the scheduler loop.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch.profiler import ProfilerActivity

from srt.managers.io_struct import ProfileReq, ProfileReqOutput

logger = logging.getLogger("srt.scheduler")

PROFILER_DIR_ENV = "SRT_TORCH_PROFILER_DIR"
DEFAULT_PROFILER_DIR = "/tmp/srt_profile"
_ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA, "CUDA": ProfilerActivity.CUDA}


def default_output_dir() -> str:
    return os.environ.get(PROFILER_DIR_ENV) or DEFAULT_PROFILER_DIR


class SchedulerProfiler:
    """See the module docstring. ``device``: the scheduler's device."""

    def __init__(self, device: str | torch.device) -> None:
        self.device_type = torch.device(device).type
        self._prof: torch.profiler.profile | None = None
        self._trace_path = ""
        self._steps_left: int | None = None  # None: runs until stopped

    @property
    def active(self) -> bool:
        return self._prof is not None

    def handle(self, req: ProfileReq) -> ProfileReqOutput:
        if req.action == "start":
            return self.start(req.output_dir, req.num_steps, req.activities)
        if req.action == "stop":
            return self.stop()
        return ProfileReqOutput(success=False, message=f"unknown profile action {req.action!r}")

    def start(
        self, output_dir: str | None, num_steps: int | None, activities: list[str] | None
    ) -> ProfileReqOutput:
        if self._prof is not None:
            return ProfileReqOutput(
                success=False,
                message=f"the profiler is already running (trace to {self._trace_path}); stop it first",
            )
        error = self._check_args(num_steps, activities)
        if error is not None:
            return ProfileReqOutput(success=False, message=error)
        out_dir = os.path.abspath(output_dir or default_output_dir())
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            return ProfileReqOutput(success=False, message=f"cannot create output_dir {out_dir}: {e}")
        kinds = [_ACTIVITIES[a] for a in dict.fromkeys(activities or ["CPU"])]
        prof = torch.profiler.profile(activities=kinds, record_shapes=True)
        prof.start()
        self._prof = prof
        self._trace_path = os.path.join(out_dir, f"srt-{time.time_ns()}.trace.json.gz")
        self._steps_left = num_steps
        when = f"after {num_steps} steps or " if num_steps is not None else ""
        logger.info("profiler started; the trace goes to %s", self._trace_path)
        return ProfileReqOutput(
            success=True,
            message=f"Profiling started; the trace is written to {self._trace_path} {when}on /stop_profile.",
            trace_path=self._trace_path,
        )

    def _check_args(self, num_steps: int | None, activities: list[str] | None) -> str | None:
        if num_steps is not None and num_steps < 1:
            return f"num_steps must be >= 1, got {num_steps}"
        for a in activities or ["CPU"]:
            if a not in _ACTIVITIES:
                return f"unknown profiler activity {a!r}; use CPU or GPU"
            if _ACTIVITIES[a] is ProfilerActivity.CUDA and self.device_type != "cuda":
                return f"profiler activity {a} needs a CUDA device (this server runs on {self.device_type})"
        return None

    def stop(self) -> ProfileReqOutput:
        prof, path = self._prof, self._trace_path
        if prof is None:
            return ProfileReqOutput(success=False, message="the profiler is not running")
        self._prof, self._steps_left = None, None
        prof.stop()
        try:
            prof.export_chrome_trace(path)
        except Exception as e:  # noqa: BLE001 - a full disk must not take the scheduler down
            logger.error("profiler: writing the trace to %s failed: %s", path, e)
            return ProfileReqOutput(success=False, message=f"writing the trace to {path} failed: {e}")
        logger.info("profiler stopped; trace written to %s", path)
        return ProfileReqOutput(
            success=True, message=f"Profiling stopped; trace written to {path}.", trace_path=path
        )

    def on_step(self) -> None:
        """Count one scheduler step; stop (writing the trace) when ``num_steps`` have run."""
        if self._prof is None or self._steps_left is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.stop()
