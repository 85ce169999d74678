"""``python -m tests.helpers.launch_and_wait {main|thread}``: launch the serving subprocesses with the
fake scheduler, print the child pids on one line, then sleep (until killed).

With ``thread`` the launch runs in a short-lived worker thread (the parent-death signal is then
not armed and the children rely on their getppid() watchdog)."""

from __future__ import annotations

import sys
import threading
import time

from srt.entrypoints.launch import launch_subprocesses
from srt.server_args import ServerArgs
from tests.helpers.fake_scheduler import run_fake_scheduler_process


def _launch() -> None:
    tm, _ = launch_subprocesses(ServerArgs(log_level="warning"), scheduler_entry=run_fake_scheduler_process)
    print(" ".join(str(pid) for pid in tm.launcher.child_pids.values()), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["thread"]:
        t = threading.Thread(target=_launch)
        t.start()
        t.join()
    else:
        _launch()
    time.sleep(600)
