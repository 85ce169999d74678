"""The soak's requests and the checks of their outcomes (used by benchmarks/soak.py).

`make_scenarios(n, seed)` draws a seeded mix of requests: route (/generate,
/v1/chat/completions, /v1/completions), streaming or not, n in {1, 2}, 1-8 output tokens, stop
strings, one of a few shared system prompts (prefix sharing) plus a short unique user text, and
an action:

    normal           read the whole response
    disconnect       close the connection mid-response (after a short delay; mid-stream after
                     the first event)
    abort            POST /abort_request with the request's rid after a short delay
    deadline_ok      ``timeout`` of 120 s: must finish normally
    deadline_expire  ``timeout`` of 5-200 ms: finishes normally or times out

`classify_plain(...)` and `classify_stream(...)` turn what the client received into one
`Outcome` kind, or a violation (a malformed body, an error not in OpenAI's shape, a stream
without ``[DONE]`` or with data after it, a choice finished twice or never, ...). They are pure
functions of the status and the bytes (tests/unit/test_soak_workload.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

ROUTES = ("generate", "chat", "completions")
ACTIONS = ("normal", "disconnect", "abort", "deadline_ok", "deadline_expire")
ACTION_WEIGHTS = (0.58, 0.12, 0.10, 0.10, 0.10)
FINISH_TYPES = {"length", "stop", "abort", "timeout"}
STOPS = ([" the"], ["."], ["\n", " and"])
_WORDS = (
    "river stone cloud lamp orange violin harbor maple quiet engine silver garden window "
    "planet copper meadow signal candle basket rocket"
).split()
SYSTEM_PROMPTS = tuple(
    f"You are assistant number {k}. "
    + " ".join(_WORDS[(k * 3 + i) % len(_WORDS)] for i in range(40 + 20 * k))
    for k in range(4)
)


@dataclass(slots=True)
class Scenario:
    idx: int
    route: str
    stream: bool
    n: int
    max_tokens: int
    stop: list[str] | None
    system: int
    user: str
    action: str
    delay_s: float  # disconnect / abort: when
    timeout_s: float | None  # the request's deadline (deadline_* actions)
    rid: str


@dataclass(slots=True)
class Outcome:
    """What one request ended with: ``kind`` is complete / timeout / aborted / disconnected /
    error_<status>; ``violation`` says what was malformed (None when well-formed)."""

    kind: str
    violation: str | None = None
    status: int | None = None


def make_scenarios(n: int, seed: int, deadlines: bool = True) -> list[Scenario]:
    """``n`` seeded scenarios (``deadlines`` False: the deadline actions become normal)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        action = rng.choices(ACTIONS, ACTION_WEIGHTS)[0]
        if not deadlines and action.startswith("deadline"):
            action = "normal"
        timeout = {"deadline_ok": 120.0, "deadline_expire": rng.uniform(0.005, 0.2)}.get(action)
        out.append(
            Scenario(
                idx=i,
                route=rng.choice(ROUTES),
                stream=rng.random() < 0.5,
                n=2 if rng.random() < 0.15 else 1,
                max_tokens=rng.randint(1, 8),
                stop=rng.choice(STOPS) if rng.random() < 0.2 else None,
                system=rng.randrange(len(SYSTEM_PROMPTS)),
                user=f"Request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))),
                action=action,
                delay_s=rng.uniform(0.0, 0.3),
                timeout_s=timeout,
                rid=f"soak-{seed}-{i}",
            )
        )
    return out


def request_of(s: Scenario) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of scenario ``s``."""
    body: dict[str, Any]
    if s.route == "generate":
        params: dict[str, Any] = {"max_new_tokens": s.max_tokens, "n": s.n}
        if s.stop:
            params["stop"] = s.stop
        body = {
            "text": SYSTEM_PROMPTS[s.system] + "\n" + s.user,
            "sampling_params": params,
            "stream": s.stream,
        }
        path = "/generate"
    else:
        body = {"max_tokens": s.max_tokens, "n": s.n, "stream": s.stream}
        if s.stop:
            body["stop"] = s.stop
        if s.route == "chat":
            body["messages"] = [
                {"role": "system", "content": SYSTEM_PROMPTS[s.system]},
                {"role": "user", "content": s.user},
            ]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = SYSTEM_PROMPTS[s.system] + "\n" + s.user
            path = "/v1/completions"
    body["rid"] = s.rid
    if s.timeout_s is not None:
        body["timeout"] = s.timeout_s
    return path, body


# ------------------------------------------------------------------ checks
def error_shape_problem(payload: Any) -> str | None:
    """None when ``payload`` is OpenAI's error object ``{"error": {"message": str, "type": str,
    "code": ...}}``, else what is wrong."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        return f"error body without an 'error' object: {str(payload)[:200]}"
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str) or "code" not in err:
        return f"error object missing message/type/code: {str(err)[:200]}"
    return None


def _kind_of(finishes: list[str]) -> str:
    if "timeout" in finishes:
        return "timeout"
    if "abort" in finishes:
        return "aborted"
    return "complete"


def _finish_of(route: str, item: dict[str, Any]) -> str | None:
    """The finish type of one /generate output or one OpenAI choice (None while running)."""
    if route == "generate":
        reason = (item.get("meta_info") or {}).get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else None
    return item.get("finish_reason")


def classify_plain(route: str, n: int, status: int, body: bytes) -> Outcome:
    """A non-streaming response: a complete body with ``n`` finished outputs, or an error."""
    try:
        payload = json.loads(body)
    except ValueError:
        return Outcome("malformed", f"status {status}: body is not JSON: {body[:200]!r}", status)
    if status != 200:
        problem = error_shape_problem(payload)
        kind = "timeout" if status == 408 else f"error_{status}"
        return Outcome(kind, problem, status)
    if route == "generate":
        items = payload if isinstance(payload, list) else [payload]
        if n == 1 and isinstance(payload, list):
            return Outcome("malformed", "a list for n=1", status)
        if any(not isinstance(x.get("text"), str) for x in items):
            return Outcome("malformed", "an output without text", status)
    else:
        items = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(items, list):
            return Outcome("malformed", "no choices", status)
        if sorted(c.get("index") for c in items) != list(range(len(items))):
            return Outcome("malformed", f"choice indexes {[c.get('index') for c in items]}", status)
    if len(items) != n:
        return Outcome("malformed", f"{len(items)} outputs for n={n}", status)
    finishes = [_finish_of(route, x) for x in items]
    if any(f not in FINISH_TYPES for f in finishes):
        return Outcome("malformed", f"finish reasons {finishes}", status)
    return Outcome(_kind_of(finishes), None, status)


def parse_sse(raw: bytes) -> tuple[list[Any], bool, str | None]:
    """(events before [DONE], whether [DONE] ended the stream, a problem): every event must be a
    ``data:`` line of JSON, [DONE] exactly once and last."""
    events: list[Any] = []
    done = False
    for block in raw.split(b"\n\n"):
        block = block.strip()
        if not block:
            continue
        if done:
            return events, done, f"data after [DONE]: {block[:100]!r}"
        if not block.startswith(b"data: "):
            return events, done, f"not a data event: {block[:100]!r}"
        data = block[6:]
        if data == b"[DONE]":
            done = True
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            return events, done, f"event is not JSON: {data[:100]!r}"
    return events, done, None


def classify_stream(route: str, n: int, status: int, raw: bytes, complete: bool) -> Outcome:
    """A streaming response. ``complete``: the client read to the end (not an intended
    disconnect). Every choice index must finish exactly once, or an error event end it."""
    if status != 200:
        return classify_plain(route, n, status, raw)
    events, done, problem = parse_sse(raw)
    if problem is not None:
        return Outcome("malformed", problem, status)
    if not complete:
        return Outcome("disconnected", None, status)
    if not done:
        return Outcome("malformed", "the stream ended without [DONE]", status)
    finished: dict[int, str] = {}
    for k, ev in enumerate(events):
        if isinstance(ev, dict) and "error" in ev:
            if k != len(events) - 1:
                return Outcome("malformed", "events after an error event", status)
            problem = error_shape_problem(ev)
            code = ev["error"].get("code") if problem is None else None
            return Outcome(f"stream_error_{code}", problem, status)
        for idx, reason in _stream_items(route, ev):
            if idx in finished:
                return Outcome(
                    "malformed", f"choice {idx} continued after finishing ({finished[idx]})", status
                )
            if reason is not None:
                if reason not in FINISH_TYPES:
                    return Outcome("malformed", f"finish reason {reason!r}", status)
                finished[idx] = reason
    if sorted(finished) != list(range(n)):
        return Outcome("malformed", f"finished choices {sorted(finished)} for n={n}", status)
    return Outcome(_kind_of(list(finished.values())), None, status)


def _stream_items(route: str, ev: Any) -> list[tuple[int, str | None]]:
    """(choice index, finish type or None) of each output in one stream event."""
    if route == "generate":
        return [(int(ev.get("index", 0)), _finish_of(route, ev))]
    return [(int(c.get("index", 0)), c.get("finish_reason")) for c in ev.get("choices") or []]
