"""Multi-LoRA on the request side, without a scheduler or weights: the registry (seeding, the checks,
OpenAI's model names, load and unload against a fake scheduler), ``lora_path`` from the /generate
body and ``Engine.generate`` down to ``TokenizedGenerateReqInput.lora_name``, the tokenizer
manager's IPC for the LoRA requests, the Engine's methods and the data-parallel reply merge."""

from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import pytest

from srt.configs.lora_args import resolve_lora_args
from srt.entrypoints.engine import Engine, generate_request
from srt.managers import io_struct as io
from srt.managers.data_parallel.replies import ReplyMerger, merge_replies
from srt.managers.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.managers.tokenizer.lora_registry import LoRARegistry
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.server_args import PortArgs, ServerArgs
from srt.utils.errors import EngineDeadError, RequestError
from tests.helpers.lora_fakes import fake_lora_reply

SERVED = frozenset({"tiny", "default"})


class FakeScheduler:
    """Answers load / unload requests as the scheduler does: a path under /bad fails to load, an
    adapter in ``busy`` is in use (its unload refused); ``gate`` (set) holds each reply."""

    def __init__(self, loaded: dict[str, str] | None = None, busy: tuple[str, ...] = ()) -> None:
        self.loaded = dict(loaded or {})
        self.busy = busy
        self.sent: list = []
        self.gate: asyncio.Event | None = None

    async def __call__(self, req):
        self.sent.append(req)
        if self.gate is not None:
            await self.gate.wait()
        return fake_lora_reply(req, self.loaded, self.busy)


def registry(busy: tuple[str, ...] = (), **adapters: str) -> tuple[LoRARegistry, FakeScheduler]:
    sched = FakeScheduler(adapters, busy)
    return LoRARegistry(True, [f"{k}={v}" for k, v in adapters.items()], sched), sched


# ---------------------------------------------------------------- registry
def test_registry_is_seeded_from_the_resolved_lora_paths():
    args = ServerArgs(
        lora_paths=["a=/p/a", '{"lora_name": "b", "lora_path": "/p/b", "pinned": true}', "/p/c"]
    )
    resolve_lora_args(args)  # as resolve() leaves them: a list of dicts, LoRA on
    reg = LoRARegistry(args.enable_lora, args.lora_paths)
    assert reg.enabled and reg.adapters == {"a": "/p/a", "b": "/p/b", "/p/c": "/p/c"}
    assert LoRARegistry().adapters == {} and not LoRARegistry().enabled


def test_check_refuses_lora_when_disabled_and_unknown_names_listing_the_loaded():
    off = LoRARegistry(False)
    off.check(None)  # the base model is always fine
    with pytest.raises(RequestError) as e:
        off.check("a")
    assert e.value.status_code == 400 and "--enable-lora" in e.value.message and e.value.param == "lora_path"
    reg, _ = registry(a="/p/a", b="/p/b")
    reg.check_all(["a", None, "b"])
    with pytest.raises(RequestError) as e:
        reg.check("zz", "model")
    assert e.value.param == "model" and "'zz'" in e.value.message and "a, b" in e.value.message
    with pytest.raises(RequestError):
        reg.check("")  # an empty name is not the base model


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (None, (True, None)),
        ("tiny", (True, None)),
        ("default", (True, None)),
        ("a", (True, "a")),  # vLLM: the adapter's own name
        ("tiny:a", (True, "a")),  # SGLang: <served>:<adapter>
        ("tiny: a ", (True, "a")),
        ("tiny:", (True, None)),
        ("tiny:zz", (True, "zz")),  # served, the adapter checked later (400, not 404)
        ("zz", (False, None)),
        ("other:a", (False, None)),
    ],
)
def test_select_reads_sglang_and_vllm_model_names(model, expected):
    reg, _ = registry(a="/p/a")
    assert reg.select(model, SERVED) == expected


def test_a_served_name_with_a_colon_stays_the_base_model():
    reg, _ = registry(a="/p/a")
    assert reg.select("llama3:8b", {"llama3:8b"}) == (True, None)
    assert reg.select("llama3:8b:a", {"llama3:8b"}) == (False, None)  # split at the first colon only


# ---------------------------------------------------------------- load / unload
def test_load_and_unload_follow_the_scheduler():
    reg, sched = registry(a="/p/a")

    async def go():
        out = await reg.load(" b ", "/p/b", pinned=True)
        assert out.success and reg.adapters == {"a": "/p/a", "b": "/p/b"}
        assert sched.sent[-1] == LoadLoRAAdapterReq(lora_name="b", lora_path="/p/b", pinned=True)
        bad = await reg.load("c", "/bad/c")
        assert not bad.success and "adapter_config" in bad.message and "c" not in reg.adapters
        out = await reg.unload("a")
        assert out.success and reg.adapters == {"b": "/p/b"}
        assert sched.sent[-1] == UnloadLoRAAdapterReq(lora_name="a")

    asyncio.run(go())


@pytest.mark.parametrize(
    ("call", "param", "words"),
    [
        (lambda r: r.load("", "/p/x"), "lora_name", "non-empty"),
        (lambda r: r.load("x", ""), "lora_path", "non-empty"),
        (lambda r: r.load("a", "/p/other"), "lora_name", "already loaded"),
        (lambda r: r.unload(""), "lora_name", "non-empty"),
        (lambda r: r.unload("zz"), "lora_name", "unknown LoRA adapter"),
    ],
)
def test_bad_load_and_unload_requests_are_refused_before_sending(call, param, words):
    reg, sched = registry(a="/p/a")
    with pytest.raises(RequestError) as e:
        asyncio.run(call(reg))
    assert e.value.param == param and words in e.value.message
    assert sched.sent == [] and reg.adapters == {"a": "/p/a"}


def test_load_and_unload_need_enable_lora():
    reg = LoRARegistry(False, send=FakeScheduler())
    for coro in (reg.load("a", "/p/a"), reg.unload("a")):
        with pytest.raises(RequestError) as e:
            asyncio.run(coro)
        assert "--enable-lora" in e.value.message


def test_unload_drops_the_name_at_once_and_restores_it_when_refused():
    reg, sched = registry(busy=("a",), a="/p/a")

    async def go():
        sched.gate = asyncio.Event()
        task = asyncio.ensure_future(reg.unload("a"))
        await asyncio.sleep(0)
        with pytest.raises(RequestError):  # new requests naming it are refused meanwhile
            reg.check("a")
        sched.gate.set()
        return await task

    out = asyncio.run(go())
    assert not out.success and "used by 1 request" in out.message
    assert reg.adapters == {"a": "/p/a"}  # kept: the scheduler still holds it
    reg.check("a")


def test_unload_restores_the_name_when_the_request_fails():
    async def dead(req):
        raise EngineDeadError("the scheduler died")

    reg = LoRARegistry(True, ["a=/p/a"], dead)
    with pytest.raises(EngineDeadError):
        asyncio.run(reg.unload("a"))
    assert reg.adapters == {"a": "/p/a"}


def test_load_requests_run_one_at_a_time_and_a_racing_duplicate_is_refused():
    reg, sched = registry()

    async def go():
        sched.gate = asyncio.Event()
        first = asyncio.ensure_future(reg.load("a", "/p/a"))
        second = asyncio.ensure_future(reg.load("a", "/p/a2"))
        await asyncio.sleep(0)
        assert len(sched.sent) == 1  # the second waits for the first's reply
        sched.gate.set()
        assert (await first).success
        with pytest.raises(RequestError, match="already loaded"):
            await second

    asyncio.run(go())
    assert reg.adapters == {"a": "/p/a"} and len(sched.sent) == 1


# ---------------------------------------------------------------- lora_path on generation requests
def test_generate_body_and_engine_take_lora_path():
    body = json.dumps({"text": ["x", "y"], "lora_path": ["a", None]}).encode()
    singles = GenerateReqInput.from_json(body).expand()
    assert [s.lora_path for s in singles] == ["a", None]
    singles = generate_request(["x", "y", "z"], lora_path="a").expand()
    assert [s.lora_path for s in singles] == ["a", "a", "a"]  # one name for every prompt (no suffix)
    assert generate_request("x").expand()[0].lora_path is None
    assert [s.lora_path for s in generate_request("x", lora_path=["b"]).expand()] == ["b"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"text": ["x", "y"], "lora_path": ["a"]}, "1 entries for 2 prompts"),
        ({"text": "x", "lora_path": ["a", "b"]}, "2 entries for 1 prompts"),
        ({"text": ["x", "y"], "lora_path": 3}, "lora_path"),
    ],
)
def test_lora_path_shape_errors(body, words):
    with pytest.raises(RequestError) as e:
        GenerateReqInput.from_json(json.dumps(body).encode()).expand()
    assert e.value.status_code == 400 and words in e.value.message


class CharTokenizer:
    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) % 200 for c in t] for t in texts]}

    def __len__(self) -> int:
        return 200


class CaptureSocket:
    def __init__(self) -> None:
        self.sent = []

    def send(self, raw: bytes) -> None:
        self.sent.append(io.scheduler_input_decoder.decode(raw))

    def close(self, linger: int = 0) -> None:
        pass


@pytest.fixture
def make_tm():
    made = []

    def make(**kw) -> TokenizerManager:
        info = {"context_len": 100, "max_total_num_tokens": 1000}
        tm = TokenizerManager(ServerArgs(**kw), PortArgs.init_new(), info, CharTokenizer())
        tm.ipc.send_sock.close(linger=0)
        tm.ipc.send_sock = CaptureSocket()
        made.append(tm)
        return tm

    yield make
    for tm in made:
        tm.ipc.close_sockets()
        shutil.rmtree(tm.port_args.ipc_dir, ignore_errors=True)


def _prepare(tm: TokenizerManager, obj: GenerateReqInput):
    async def go():
        await tm.start()
        return await tm.prepare(obj)

    return asyncio.run(go())


def test_prepare_sets_lora_name_per_prompt_and_on_n_copies(make_tm):
    tm = make_tm(enable_lora=True, lora_paths=[{"lora_name": "a", "lora_path": "/p/a"}, "b=/p/b"])
    prep = _prepare(tm, generate_request(["xy", "zw", "uv"], lora_path=["a", None, "b"]))
    assert [r.lora_name for r, _ in prep.reqs] == ["a", "", "b"]
    params = {"n": 2, "max_new_tokens": 2}
    prep = _prepare(tm, generate_request("xy", params, lora_path="b"))
    assert [r.lora_name for r, _ in prep.reqs] == ["b", "b"]
    assert [w.lora_name for w in prep.warmups] == ["b"]  # the shared prefill runs under it too


def test_prepare_refuses_lora_before_sending(make_tm):
    off = make_tm()
    with pytest.raises(RequestError, match="--enable-lora"):
        _prepare(off, generate_request("xy", lora_path="a"))
    assert _prepare(off, generate_request("xy", lora_path=[None])).reqs[0][0].lora_name == ""
    on = make_tm(enable_lora=True, lora_paths=["a=/p/a"])
    with pytest.raises(RequestError) as e:
        _prepare(on, generate_request(["xy", "zw"], lora_path=["a", "nope"]))
    assert "'nope'" in e.value.message and "loaded adapters: a" in e.value.message
    assert off.ipc.send_sock.sent == [] and on.ipc.send_sock.sent == []
    assert on.registry.rid_to_state == {}


def test_tokenizer_manager_sends_lora_requests_and_matches_their_replies(make_tm):
    tm = make_tm(enable_lora=True, lora_paths=["a=/p/a"])

    async def go():
        await tm.start()
        load = asyncio.ensure_future(tm.lora_registry.load("b", "/p/b"))
        unload = asyncio.ensure_future(tm.lora_registry.unload("a"))
        await asyncio.sleep(0)
        assert tm.ipc.send_sock.sent == [LoadLoRAAdapterReq(lora_name="b", lora_path="/p/b")]
        loaded = {"a": "/p/a", "b": "/p/b"}
        tm.ipc._dispatch(LoRAAdapterReqOutput(success=True, loaded_adapters=loaded))
        first = await load
        await asyncio.sleep(0)
        assert tm.ipc.send_sock.sent[-1] == UnloadLoRAAdapterReq(lora_name="a")
        tm.ipc._dispatch(LoRAAdapterReqOutput(success=True, loaded_adapters={"b": "/p/b"}))
        return first, await unload

    first, second = asyncio.run(go())
    assert first.success and second.success and tm.lora_registry.adapters == {"b": "/p/b"}


def test_a_dead_engine_refuses_lora_requests(make_tm):
    tm = make_tm(enable_lora=True)
    tm.dead = EngineDeadError("gone")
    with pytest.raises(EngineDeadError):
        asyncio.run(tm.lora_registry.load("b", "/p/b"))
    assert tm.ipc.send_sock.sent == []


# ---------------------------------------------------------------- Engine
def _engine(reg: LoRARegistry) -> Engine:
    engine = object.__new__(Engine)  # never started: the registry stands for the tokenizer manager
    engine.tokenizer_manager = SimpleNamespace(lora_registry=reg)
    engine._call = asyncio.run  # type: ignore[method-assign]
    return engine


def test_engine_load_and_unload_return_sglangs_reply_or_raise():
    reg, _ = registry(busy=("a",), a="/p/a")
    engine = _engine(reg)
    out = engine.load_lora_adapter("b", "/p/b")
    assert out == {"success": True, "message": "", "loaded_adapters": {"a": "/p/a", "b": "/p/b"}}
    assert engine.unload_lora_adapter("b")["loaded_adapters"] == {"a": "/p/a"}
    with pytest.raises(RequestError, match="adapter_config") as e:
        engine.load_lora_adapter("c", "/bad/c")
    assert e.value.param == "lora_path"
    with pytest.raises(RequestError, match="used by 1 request"):
        engine.unload_lora_adapter("a")
    with pytest.raises(RequestError, match="already loaded"):
        engine.load_lora_adapter("a", "/p/a")


# ---------------------------------------------------------------- data parallel
def _reply(ok: bool, message: str = "", **adapters: str) -> LoRAAdapterReqOutput:
    return LoRAAdapterReqOutput(success=ok, message=message, loaded_adapters=adapters)


def test_dp_merge_succeeds_only_when_every_group_did_and_keeps_the_common_adapters():
    merged = merge_replies([_reply(True, a="/p/a", b="/p/b"), _reply(True, a="/p/a", b="/p/b")])
    assert merged == _reply(True, a="/p/a", b="/p/b")
    merged = merge_replies([_reply(True, a="/p/a", b="/p/b"), _reply(False, "no such folder", a="/p/a")])
    assert not merged.success and merged.message == "dp0: ; dp1: no such folder"
    assert merged.loaded_adapters == {"a": "/p/a"}  # b is on group 0 only: no request may name it


def test_dp_merger_pairs_load_and_unload_replies_in_order():
    merger = ReplyMerger(2)
    merger.expect(LoadLoRAAdapterReq(lora_name="b", lora_path="/p/b"))
    merger.expect(UnloadLoRAAdapterReq(lora_name="a"))
    assert merger.add(1, _reply(True, a="/p/a", b="/p/b")) == []
    assert merger.add(1, _reply(True, b="/p/b")) == []
    (load,) = merger.add(0, _reply(True, a="/p/a", b="/p/b"))
    assert load.loaded_adapters == {"a": "/p/a", "b": "/p/b"}
    (unload,) = merger.add(0, _reply(True, b="/p/b"))
    assert unload.loaded_adapters == {"b": "/p/b"} and merger.num_pending() == 0
