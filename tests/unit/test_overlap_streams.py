"""Overlap scheduling on CUDA, its stream protocol checked on CPU with stand-ins for the CUDA
stream API (a CPU torch cannot make CUDA streams or pinned memory): the worker's forward runs on
its own stream after the default stream's queued work, the sampled ids come back as pinned host
copies, and the worker returns only once an event behind those copies completed. The GPU test
(tests/gpu/test_serving_modes_gpu.py, overlap on and off) checks the tokens on a device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from srt.layers.sampler import SampleOutput
from srt.managers.scheduler import overlap
from srt.managers.scheduler.overlap import ForwardWorker


@dataclass
class Log:
    events: list[str] = field(default_factory=list)


class FakeStream:
    def __init__(self, log: Log, name: str) -> None:
        self.log, self.name, self.device = log, name, torch.device("cpu")

    def wait_stream(self, other: FakeStream) -> None:
        self.log.events.append(f"{self.name} waits for {other.name}")

    def synchronize(self) -> None:
        self.log.events.append(f"{self.name} synchronize")


class FakeEvent:
    log: Log

    def record(self, stream: FakeStream) -> None:
        self.log.events.append(f"event recorded on {stream.name}")

    def synchronize(self) -> None:
        self.log.events.append("event synchronize")


class Runner:
    def __init__(self, log: Log, logprobs: bool) -> None:
        self.log, self.logprobs = log, logprobs

    def forward_batch_generation(self, fb):
        self.log.events.append("forward")
        lps = torch.tensor([-0.5, -1.0]) if self.logprobs else None
        return object(), SampleOutput(next_token_ids=torch.tensor([11, 12]), next_token_logprobs=lps)


def _worker(monkeypatch, log: Log, logprobs: bool) -> ForwardWorker:
    default = FakeStream(log, "default")
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)

    @contextlib.contextmanager
    def on(stream):
        log.events.append(f"enter {stream.name}")
        yield
        log.events.append(f"leave {stream.name}")

    monkeypatch.setattr(torch.cuda, "stream", on)
    FakeEvent.log = log
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    def pinned(t):
        log.events.append(f"host copy of {t.tolist()}")
        return t.clone()

    monkeypatch.setattr(overlap, "_pinned_copy", pinned)
    worker = ForwardWorker(threaded=True)
    worker.runner, worker.stream = Runner(log, logprobs), FakeStream(log, "forward")
    return worker


def test_forward_on_its_stream_and_sampled_ids_to_host_behind_an_event(monkeypatch):
    log = Log()
    worker = _worker(monkeypatch, log, logprobs=True)
    try:
        result = worker._run(object(), resolve=False, publish=None)
    finally:
        worker.shutdown()
    assert log.events == [
        "forward waits for default",
        "enter forward",
        "forward",
        "host copy of [11, 12]",
        "host copy of [-0.5, -1.0]",
        "event recorded on forward",
        "event synchronize",
        "leave forward",
    ]
    assert result.sample_output.next_token_ids.tolist() == [11, 12]
    assert result.sample_output.next_token_logprobs.tolist() == [-0.5, -1.0]


def test_without_logprobs_only_the_ids_are_copied(monkeypatch):
    log = Log()
    worker = _worker(monkeypatch, log, logprobs=False)
    try:
        result = worker._run(object(), resolve=False, publish=None)
    finally:
        worker.shutdown()
    assert [e for e in log.events if e.startswith("host copy")] == ["host copy of [11, 12]"]
    assert result.sample_output.next_token_logprobs is None


def test_cpu_worker_has_no_stream():
    class Pool:
        size = 4
        req_to_token = torch.zeros(4, 8, dtype=torch.int32)

    worker = ForwardWorker(threaded=True)
    try:
        worker.attach(type("R", (), {"req_to_token_pool": Pool()})())
        assert worker.stream is None
    finally:
        worker.shutdown()
