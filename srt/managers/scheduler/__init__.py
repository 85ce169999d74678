"""The scheduler, as small parts with one owner each (the one-iteration flow is in
``scheduler.py``'s docstring). ``scheduler.py``'s ``Scheduler`` only wires the parts together;
each part owns one job and its state:

    prefill.py     PrefillManager: waiting queue, request mid-prompt, admission budgets,
                   chunking, the EXTEND batch
    decode.py      DecodeManager: running batch, retraction and its hysteresis (NewTokenRatio)
    cache.py       CacheManager: request rows, KV allocator and prefix cache (match, lock,
                   insert, free, evict, flush, integrity)
    output.py      forward results -> Req state; the step's BatchTokenIDOut
    metrics.py     SchedulerMetrics: counters and log lines
    deadlines.py   DeadlineTracker: per-request deadlines and --max-queue-time, checked each step
    step_timing.py StepTimings: per-step scheduling / forward time histograms; StepTrace (--step-trace-path)
    grammar.py     GrammarManager: grammars compiled off the loop, token masks, matchers
    overlap.py     ForwardWorker: forwards on a worker thread (overlap scheduling) or inline,
                   and the future map of the tokens still being sampled
    speculative.py SpeculativeDecoder (--speculative-algorithm NGRAM): drafts, the verify
                   batch (drafts as extra decode rows), acceptance, backoff; ngram.py: the drafts
    profiler.py    SchedulerProfiler: torch.profiler around steps (/start_profile, /stop_profile)
    weight_update.py  WeightUpdateGate: a weight update waits for idle, new requests wait for it
    heartbeat.py   SchedulerHeartbeat: progress and a state summary for the hang watchdog
    requests.py    RequestTable: the requests not yet reported finished: arrival (params
                   normalized, fit check, duplicate rids), finishes between steps (abort, stop
                   string, rejection, deadline) and the routing of retracted requests
    control.py     the input messages' dispatch table; control requests: flush the cache,
                   reload weights, internal state, readiness
    setup.py       the parts built from ServerArgs (model runner, grammars, prefill budgets,
                   the forward worker and the model runner)
    process.py     the ZMQ event loop and the process entry point (imports this module)
    runner_protocol.py   SchedulerModelRunner: what the scheduler may call on the model runner

and the pure pieces: ``schedule_policy.py`` (queue order, budgets, chunk split),
``decode_policy.py`` (new-token ratio, retraction choice), ``srt/managers/request_fit.py`` (can a
request ever fit?), ``req.py`` (Req and its state machine), ``schedule_batch.py`` (ScheduleBatch
-> ForwardBatch).

``Scheduler`` drives the model in-process (tests, benchmarks); ``run_scheduler_process`` is the
entry of the scheduler process (``process.py``, which imports the scheduler, never the reverse).
"""

from srt.managers.scheduler.process import run_scheduler_process
from srt.managers.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "run_scheduler_process"]
