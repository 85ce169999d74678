"""The one launch function, shared by the Engine and the HTTP server.

`launch_subprocesses(server_args)`:

1. resolves ``server_args`` once (every ``auto`` filled) and creates the ipc endpoints
   (`PortArgs.init_new`: a private temporary directory, removed at shutdown / interpreter exit);
2. spawns the scheduler process (`run_scheduler`: the scheduler module is imported in the child
   only, so the main process never imports torch model code), loads the tokenizer in this process
   meanwhile (``--chat-template`` replaces its template), saves a fast-loading copy into the ipc
   directory and spawns the detokenizer with it;
3. waits for both ready messages (pipe *and* liveness polled: a child that fails or dies at
   start-up raises `LaunchError` carrying the child's traceback, never a hang);
4. builds the `TokenizerManager` and starts a monitor thread: if a child exits later, the
   tokenizer manager fails every in-flight request and the ``on_child_death`` hooks run;
   with ``--watchdog-timeout`` > 0 a watchdog thread reads the scheduler's heartbeat (shared
   memory, srt/utils/watchdog.py) and, on a hang, dumps every process's stacks, fails in-flight
   requests the same way and stops the children;
5. with ``owns_process`` (launch_server, not an `Engine` inside a user's program), steps this
   process aside from the scheduler's compute CPUs like the detokenizer (`confine_aux_process`),
   after the children are started so that they do not inherit it.

With ``--dp-size N`` step 2 starts N scheduler groups and the data-parallel controller between
them and the tokenizer manager instead (`start_dp_groups`); ``scheduler_info`` is group 0's.

It returns ``(tokenizer_manager, scheduler_info)``; ``tokenizer_manager.launcher`` is the
`Launcher` whose `shutdown()` stops the children and removes the ipc directory.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

from srt.configs.chat_templates import load_chat_template
from srt.configs.gguf_header import model_config_dict
from srt.entrypoints.dp_launch import start_dp_groups
from srt.entrypoints.tp_launch import start_scheduler_ranks
from srt.managers.detokenizer.detokenizer_manager import run_detokenizer_process
from srt.managers.tokenizer.image_prompts import image_prompts
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.multimodal.processor import VISION_MODEL_TYPES
from srt.server_args import PortArgs, ServerArgs
from srt.utils.cpu_affinity import confine_aux_process
from srt.utils.cpu_memory import configure_cpu_allocator
from srt.utils.errors import ConfigError, EngineDeadError, LaunchError, ModelNotFoundError
from srt.utils.hf_tokenizer import (
    load_tokenizer,
    load_tokenizer_without_torch,
    save_decode_copy,
    tokenizer_source,
)
from srt.utils.logging_utils import configure_logging
from srt.utils.model_path import resolve_model_path
from srt.utils.process import ProcessSupervisor
from srt.utils.torch_free import transformers_without_torch
from srt.utils.watchdog import (
    HeartbeatReader,
    Watchdog,
    create_heartbeat_file,
    heartbeat_path,
    register_stack_dump_signal,
)

logger = logging.getLogger(__name__)

SchedulerEntry = Callable[..., None]


def run_scheduler(
    server_args: ServerArgs, port_args: PortArgs, pipe_writer: Any, tp_rank: int = 0, dist_init_addr: str = ""
) -> None:
    """Entry of the scheduler child: ``run_scheduler_process``, imported in the child only
    (``run_tp_scheduler_process`` for rank ``tp_rank`` with ``--tp-size`` > 1).

    The scheduler pulls in torch and the model code; importing it here, at call time in the
    spawned child, keeps the main process (tokenizer manager, HTTP server, Engine front end) free
    of both. These are the only edges from srt.entrypoints to the scheduler (a process boundary).

    On a CPU the allocator is set up first, before torch is imported (srt/utils/cpu_memory.py);
    then transformers, with torch hidden where the model allows (`_transformers_first`)."""
    config = _model_config(server_args.model_path)
    if server_args.device == "cpu":
        logger.info(configure_cpu_allocator(_hidden_size(config)))
    if _transformers_first(config):
        logger.debug("transformers imported with torch hidden from it")
    if server_args.tp_size > 1:
        from srt.managers.scheduler.tp_process import run_tp_scheduler_process

        run_tp_scheduler_process(server_args, port_args, pipe_writer, tp_rank, dist_init_addr)
        return
    from srt.managers.scheduler.process import run_scheduler_process

    run_scheduler_process(server_args, port_args, pipe_writer)


def _model_config(model_path: str | None) -> dict | None:
    """The model's config.json or GGUF header as a dict, read without torch; None when it cannot
    be read here (the scheduler reports that)."""
    try:
        return model_config_dict(resolve_model_path(model_path))  # None: the default model's GGUF
    except (OSError, ValueError, TypeError, AttributeError, ModelNotFoundError):
        return None


def _hidden_size(config: dict | None) -> int | None:
    """The model's hidden size from its config; None when it does not say (the allocator then
    keeps its defaults)."""
    try:
        config = config if "hidden_size" in config else config.get("text_config", {})
        return int(config["hidden_size"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _transformers_first(config: dict | None) -> bool:
    """Import transformers' config and tokenizer classes with torch hidden from it, before the
    scheduler imports torch; True when it did. With torch in sight transformers' config modules
    also load its activation and weight-conversion code, and ``torch.distributed.tensor`` with
    them (about 1 s of a 6 s start-up on a 2-core CPU); srt's text models read only the config's
    values (config.json's dtype is read as JSON, srt/configs/cpu_dtype.py). Not for a
    vision-language model, whose vision tower runs transformers' own modules, nor for a config
    the repository's code defines (``auto_map``), nor where the config could not be read (None)."""
    if config is None or config.get("model_type") in VISION_MODEL_TYPES or "auto_map" in config:
        return False
    with transformers_without_torch() as hidden:
        return hidden


class Launcher:
    """Owns the children and the ipc directory of one launch; `shutdown` is idempotent."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.supervisor = ProcessSupervisor(log_level=server_args.log_level)
        self._lock = threading.Lock()
        self._done = False
        self.watchdogs: list[Watchdog] = []  # the hang watchdogs (--watchdog-timeout), one per DP group
        atexit.register(self.shutdown)

    def shutdown(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        for watchdog in self.watchdogs:
            watchdog.stop()
        self.supervisor.stop()
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)
        atexit.unregister(self.shutdown)

    @property
    def child_pids(self) -> dict[str, int | None]:
        return self.supervisor.pids()


def launch_subprocesses(
    server_args: ServerArgs,
    scheduler_entry: SchedulerEntry | None = None,
    owns_process: bool = False,
    while_starting: Callable[[], object] | None = None,
) -> tuple[TokenizerManager, dict[str, Any]]:
    """Start the scheduler and the detokenizer; return ``(tokenizer_manager, scheduler_info)``.

    ``scheduler_entry`` replaces ``run_scheduler_process`` (tests use fakes), called in the child
    as ``entry(server_args, port_args, pipe_writer)``. ``owns_process``: this is srt's own process
    (launch_server), confined as an auxiliary one. ``while_starting`` runs here while the children
    start (the HTTP server imports its app then). Raises `LaunchError` when a child fails to start
    (after stopping everything it started)."""
    configure_logging(server_args.log_level, "main")
    server_args = server_args.resolve()
    if server_args.node_rank > 0:
        raise ConfigError(
            f"--node-rank {server_args.node_rank} runs scheduler ranks only: start it with "
            "python -m srt.launch_server (the Engine and the HTTP server run on node rank 0)."
        )
    port_args = PortArgs.init_new()
    launcher = Launcher(server_args, port_args)
    sup = launcher.supervisor
    if server_args.watchdog_timeout > 0:
        for group in range(server_args.dp_size):
            create_heartbeat_file(heartbeat_path(port_args.ipc_dir, group))
    try:
        scheduler_name, tokenizer = _start_children(
            sup, server_args, port_args, scheduler_entry or run_scheduler, owns_process
        )
        if while_starting is not None:
            while_starting()
        ready = sup.wait_ready()
        images = image_prompts(server_args, tokenizer)  # the model's image processor, if it takes images
    except BaseException:
        launcher.shutdown()
        raise
    scheduler_info = {k: v for k, v in ready[scheduler_name].items() if k != "status"}
    tm = TokenizerManager(server_args, port_args, scheduler_info, tokenizer, images)
    tm.launcher = launcher

    def on_death(name: str, exitcode: int | None) -> None:
        tm.on_child_death(name, exitcode)
        launcher.shutdown()  # stop the surviving child too

    sup.start_monitor(on_death)
    if server_args.watchdog_timeout > 0:
        launcher.watchdogs = [
            _start_watchdog(server_args, launcher, tm, g) for g in range(server_args.dp_size)
        ]
    if owns_process:  # `kill -USR1 <pid>` prints this process's stacks, as for the children
        register_stack_dump_signal()
        confine_aux_process(server_args.cpu_omp_threads_bind, server_args.aux_process_nice, "main")
    logger.info(
        "ready: context length %s, KV pool %s tokens, max running requests %s",
        scheduler_info.get("context_len"),
        scheduler_info.get("max_total_num_tokens"),
        scheduler_info.get("max_running_requests"),
    )
    return tm, scheduler_info


def _start_children(
    sup: ProcessSupervisor,
    server_args: ServerArgs,
    port_args: PortArgs,
    entry: SchedulerEntry,
    owns_process: bool,
) -> tuple[str, Any]:
    """Start the scheduler ranks (or DP groups) first, the longest to be ready, then load this
    process's tokenizer and start the detokenizer; returns the first scheduler's name and the
    tokenizer."""
    if server_args.dp_size > 1:
        scheduler_name = start_dp_groups(sup, server_args, port_args, entry)[0]
    else:
        scheduler_name = start_scheduler_ranks(sup, server_args, port_args, entry)[0]
    tokenizer, detok_tokenizer_path = _load_tokenizer(server_args, port_args, owns_process)
    detok_entry = functools.partial(run_detokenizer_process, tokenizer_path=detok_tokenizer_path)
    sup.start("detokenizer", detok_entry, (server_args, port_args))
    return scheduler_name, tokenizer


def _load_tokenizer(
    server_args: ServerArgs, port_args: PortArgs, owns_process: bool
) -> tuple[Any, str | None]:
    """This process's tokenizer (``--chat-template`` applied) and the fast-loading copy saved for
    the detokenizer in the ipc directory; ``(None, None)`` with ``--skip-tokenizer-init``. In a
    process of srt's own (launch_server) transformers is loaded without torch when the tokenizer
    needs none (srt/utils/torch_free.py), never in an `Engine`'s host program."""
    if server_args.skip_tokenizer_init:
        return None, None
    load = load_tokenizer_without_torch if owns_process else load_tokenizer
    try:
        tokenizer = load(tokenizer_source(server_args), server_args.trust_remote_code)
    except Exception as e:
        raise LaunchError("main", f"could not load the tokenizer: {e}") from e
    if server_args.chat_template is not None:
        tokenizer.chat_template = load_chat_template(server_args.chat_template)
    path = os.path.join(port_args.ipc_dir, "hf_tokenizer")
    save_decode_copy(tokenizer, path)
    return tokenizer, path


def _start_watchdog(
    server_args: ServerArgs, launcher: Launcher, tm: TokenizerManager, group: int
) -> Watchdog:
    """The hang watchdog over the heartbeat of data-parallel group ``group`` (its scheduler, or
    its TP rank 0, which steps in lock step with the other ranks); on a hang (after the stack
    dumps of every process) it fails in-flight requests with `EngineDeadError` and stops the
    children."""

    def on_hang(message: str) -> None:
        tm.on_engine_dead(EngineDeadError(message))
        launcher.shutdown()

    reader = HeartbeatReader(heartbeat_path(launcher.port_args.ipc_dir, group))
    return Watchdog(reader, server_args.watchdog_timeout, launcher.supervisor.pids, on_hang).start()
