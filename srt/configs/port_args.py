"""``PortArgs``: the ZMQ endpoints of one launch (re-exported by srt.server_args)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


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
        d = tempfile.mkdtemp(prefix="srt-ipc-")
        os.chmod(d, 0o700)
        return cls(
            ipc_dir=d,
            tokenizer_ipc_name=f"ipc://{d}/tokenizer",
            scheduler_input_ipc_name=f"ipc://{d}/scheduler",
            detokenizer_ipc_name=f"ipc://{d}/detokenizer",
            dp_controller_ipc_name=f"ipc://{d}/dp_controller",
        )
