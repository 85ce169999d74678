import argparse
import dataclasses

import pytest

from srt.server_args import ConfigError, PortArgs, ServerArgs


def _parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def test_every_field_is_a_flag_with_help():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in flags
        assert f.metadata.get("help"), f"{f.name} has no help text"


def test_cli_round_trip_sglang_names():
    args = _parse(
        [
            "--model-path", "/m.gguf", "--port", "8123", "--mem-fraction-static", "0.5",
            "--max-running-requests", "7", "--chunked-prefill-size", "64", "--disable-radix-cache",
            "--enable-mixed-chunk", "--page-size", "16", "--schedule-policy", "lpm",
        ]
    )  # fmt: skip
    assert args.model_path == "/m.gguf"
    assert args.port == 8123
    assert args.mem_fraction_static == 0.5
    assert args.max_running_requests == 7
    assert args.chunked_prefill_size == 64
    assert args.disable_radix_cache and args.enable_mixed_chunk
    assert args.page_size == 16 and args.schedule_policy == "lpm"
    # defaults follow SGLang
    d = _parse([])
    assert d.host == "127.0.0.1" and d.port == 30000 and d.model_path is None


def test_bad_choice_rejected_by_cli():
    with pytest.raises(SystemExit):
        _parse(["--schedule-policy", "random"])


def test_resolve_cpu_defaults_and_does_not_mutate():
    a = ServerArgs(device="cpu")
    r = a.resolve()
    assert a.dtype == "auto" and a.mem_fraction_static is None  # original untouched
    assert r.dtype == "float32"
    assert r.kv_cache_dtype == "float32"
    assert r.attention_backend == "fused_cpu"  # torch-native decode inside it when the kernel is not built
    assert r.mem_fraction_static is None  # CPU: the KV pool is sized from the free memory
    assert r.chunked_prefill_size > 0
    assert r.linear_backend in ("native", "onednn", "torch")  # auto resolved (native on AVX2 CPUs)


def test_resolve_gguf_load_format():
    assert ServerArgs(device="cpu", model_path="x/model.gguf").resolve().load_format == "gguf"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"page_size": 3}, "--page-size"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
        ({"page_size": 16, "chunked_prefill_size": 100}, "--chunked-prefill-size"),
        ({"tp_size": 0}, "--tp-size"),
        ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "127.0.0.1:29500"}, "--tp-size 3 must be a multiple"),
        ({"tp_size": 2, "nnodes": 2}, "--dist-init-addr"),
        ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank"),
        ({"tp_size": 2, "dist_init_addr": "no-port"}, "--dist-init-addr"),
        ({"tp_size": 2, "dist_timeout": 0}, "--dist-timeout"),
        ({"tp_size": 2, "cpu_omp_threads_bind": "0"}, "--cpu-omp-threads-bind"),
        ({"json_model_override_args": "{bad"}, "--json-model-override-args"),
        ({"linear_backend": "onednn", "dtype": "bfloat16"}, "--linear-backend"),
        ({"stream_interval": 0}, "--stream-interval"),
        ({"max_top_logprobs_num": -1}, "--max-top-logprobs-num"),
        ({"max_queued_requests": 0}, "--max-queued-requests"),
        ({"max_queue_time": 0}, "--max-queue-time"),
        ({"max_request_body_bytes": 0}, "--max-request-body-bytes"),
        ({"max_sequences_per_request": 0}, "--max-sequences-per-request"),
        ({"chat_template": "no-such-template"}, "--chat-template"),
        ({"enable_priority_scheduling": True, "schedule_policy": "lpm"}, "--enable-priority-scheduling"),
        ({"model_path": "no-such-org/no-such-model"}, "--model-path"),
    ],
)
def test_resolve_errors_name_the_flag(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        ServerArgs(device="cpu", **kwargs).resolve()


def test_chunked_prefill_disable():
    assert ServerArgs(device="cpu", chunked_prefill_size=-1).resolve().chunked_prefill_size == -1


@pytest.mark.parametrize(
    "kwargs,page",
    [
        ({}, 16),  # CPU default: decode K/V in contiguous runs of 16 slots
        ({"chunked_prefill_size": -1}, 16),
        ({"chunked_prefill_size": 512}, 16),
        ({"chunked_prefill_size": 100}, 1),  # a chunk that is not whole pages keeps pages of 1
        ({"page_size": 1}, 1),
        ({"page_size": 64}, 64),
    ],
)
def test_page_size_auto_on_cpu(kwargs, page):
    assert ServerArgs(device="cpu", **kwargs).resolve().page_size == page


def test_port_args_private_dir():
    import os
    import shutil
    import stat

    p = PortArgs.init_new()
    try:
        mode = stat.S_IMODE(os.stat(p.ipc_dir).st_mode)
        assert mode == 0o700
        names = {p.tokenizer_ipc_name, p.scheduler_input_ipc_name, p.detokenizer_ipc_name}
        assert len(names) == 3 and all(n.startswith("ipc://" + p.ipc_dir) for n in names)
    finally:
        shutil.rmtree(p.ipc_dir)


def test_ipc_dirs_of_processes_that_are_gone_are_removed(tmp_path):
    """A launch SIGKILLed leaves its ipc directory behind (nothing runs its clean-up); the next
    launch removes the directories whose owner process no longer runs, and only those."""
    import os
    import subprocess
    import sys

    from srt.configs.port_args import IPC_DIR_PREFIX, OWNER_FILE, _identity, remove_orphaned_ipc_dirs

    made = subprocess.run(
        [
            sys.executable,
            "-c",
            "from srt.configs.port_args import PortArgs; print(PortArgs.init_new().ipc_dir)",
        ],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert os.path.dirname(made) == str(tmp_path) and os.path.isfile(os.path.join(made, OWNER_FILE))

    def ipc_dir(name: str, owner: str | None) -> str:
        d = tmp_path / (IPC_DIR_PREFIX + name)
        d.mkdir()
        if owner is not None:
            (d / OWNER_FILE).write_text(owner)
        return str(d)

    live = ipc_dir("live", _identity(os.getpid()))
    reused_pid = ipc_dir("reused", f"{os.getpid()} 12345.00")  # this pid, another process's start
    unowned = ipc_dir("unowned", None)
    other = tmp_path / "srt-other"
    other.mkdir()
    assert sorted(remove_orphaned_ipc_dirs(str(tmp_path))) == sorted([made, reused_pid])
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(d) for d in (live, unowned, str(other)))


def test_true_default_bool_can_be_switched_off():
    assert _parse([]).enable_metrics is True
    assert _parse(["--no-enable-metrics"]).enable_metrics is False


def test_configuration_doc_lists_every_flag():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(ServerArgs) if f"`--{f.name.replace('_', '-')}`" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_priority_flag_and_policy_imply_each_other():
    on = ServerArgs(device="cpu", enable_priority_scheduling=True).resolve()
    assert on.schedule_policy == "priority" and on.enable_priority_scheduling
    policy = ServerArgs(device="cpu", schedule_policy="priority").resolve()
    assert policy.enable_priority_scheduling
    off = ServerArgs(device="cpu").resolve()
    assert off.schedule_policy == "spf" and not off.enable_priority_scheduling


def test_surface_flags_parse_with_sglang_names():
    args = _parse(
        [
            "--chat-template", "chatml", "--stream-interval", "4", "--enable-cache-report",
            "--trust-remote-code", "--revision", "v1.0", "--enable-priority-scheduling",
            "--incremental-streaming-output",
        ]
    )  # fmt: skip
    assert args.chat_template == "chatml" and args.stream_interval == 4 and args.enable_cache_report
    assert args.trust_remote_code and args.revision == "v1.0" and args.enable_priority_scheduling
    assert args.incremental_streaming_output
    d = _parse([])
    assert d.stream_interval == 1 and not d.enable_cache_report and not d.incremental_streaming_output


def test_dp_with_tp_is_refused():
    with pytest.raises(ConfigError, match="--dp-size"):
        ServerArgs(dp_size=2, tp_size=2, device="cpu", load_format="dummy").resolve()


def test_cuda_graph_flags():
    d = _parse([])
    assert d.disable_cuda_graph is False and d.cuda_graph_max_bs is None
    args = _parse(["--disable-cuda-graph", "--cuda-graph-max-bs", "64"])
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 64
    assert ServerArgs(device="cpu").resolve().cuda_graph_max_bs == 256  # auto
    assert ServerArgs(device="cpu", max_running_requests=40).resolve().cuda_graph_max_bs == 40
    assert (
        ServerArgs(device="cpu", cuda_graph_max_bs=512, max_running_requests=40).resolve().cuda_graph_max_bs
        == 512
    )
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs"):
        ServerArgs(device="cpu", cuda_graph_max_bs=0).resolve()
