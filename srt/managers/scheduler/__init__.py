"""The scheduler, as small parts with one owner each (the layout and the one-iteration flow are
in ``scheduler.py``'s docstring).

``Scheduler`` drives the model in-process (tests, benchmarks); ``run_scheduler_process`` is the
entry of the scheduler process (``process.py``, which imports the scheduler, never the reverse).
"""

from srt.managers.scheduler.process import run_scheduler_process
from srt.managers.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "run_scheduler_process"]
