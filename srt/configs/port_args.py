"""``PortArgs``: the ZMQ endpoints of one launch (re-exported by srt.server_args)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass

import psutil

logger = logging.getLogger(__name__)

IPC_DIR_PREFIX = "srt-ipc-"
OWNER_FILE = "owner"  # "<pid> <process creation time>" of the process that made the directory


@dataclass
class PortArgs:
    """ZMQ ipc:// endpoints, all inside one private temporary directory."""

    ipc_dir: str
    tokenizer_ipc_name: str  # detokenizer -> tokenizer manager
    scheduler_input_ipc_name: str  # tokenizer manager -> scheduler
    detokenizer_ipc_name: str  # scheduler -> detokenizer
    # --dp-size > 1: scheduler groups -> data-parallel controller (load reports, control replies);
    # a group's own PortArgs names its input socket in scheduler_input_ipc_name and its dp_rank
    dp_controller_ipc_name: str = ""
    dp_rank: int | None = None  # None: this scheduler is not a data-parallel group

    @classmethod
    def init_new(cls) -> PortArgs:
        """A fresh private directory, owned by this process. The directories of launches whose
        process is gone (SIGKILLed: its children die with it and nothing ran its clean-up) are
        removed first."""
        remove_orphaned_ipc_dirs()
        d = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        os.chmod(d, 0o700)
        with open(os.path.join(d, OWNER_FILE), "w") as f:
            f.write(_identity(os.getpid()) or "")
        return cls(
            ipc_dir=d,
            tokenizer_ipc_name=f"ipc://{d}/tokenizer",
            scheduler_input_ipc_name=f"ipc://{d}/scheduler",
            detokenizer_ipc_name=f"ipc://{d}/detokenizer",
            dp_controller_ipc_name=f"ipc://{d}/dp_controller",
        )


def _identity(pid: int) -> str | None:
    """``"<pid> <creation time>"`` of a live process (a reused pid gets another creation time);
    None when there is no such process or it is a zombie."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"{pid} {p.create_time():.2f}"
    except (psutil.Error, OSError):
        return None


def remove_orphaned_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove this user's ipc directories under ``root`` (the temporary directory) whose owner
    file names a process that no longer runs; returns them. A directory with no owner file (being
    made right now, or made by an older srt) is left alone, as is anything not a plain directory
    of this user's."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(IPC_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = f.read().strip()
            pid = int(owner.split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if _identity(pid) == owner:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.debug("removed %d ipc directories of launches that are gone", len(removed))
    return removed
