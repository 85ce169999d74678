"""A stand-in for the scheduler's side of LoRA loads and unloads (the tests of the main process's
registry and routes): ``fake_lora_reply`` applies a load or unload to ``loaded`` as the scheduler
would and returns its reply."""

from __future__ import annotations

from srt.managers.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq


def fake_lora_reply(
    req: LoadLoRAAdapterReq | UnloadLoRAAdapterReq, loaded: dict[str, str], busy, users: int = 1
) -> LoRAAdapterReqOutput:
    """A path under /bad is no adapter; an unload of a name in ``busy`` is refused (``users``)."""
    ok, message = True, ""
    if isinstance(req, LoadLoRAAdapterReq):
        if req.lora_path.startswith("/bad"):
            ok, message = False, "no adapter_config.json"
        else:
            loaded[req.lora_name] = req.lora_path
    elif req.lora_name in busy:
        ok, message = False, f"{req.lora_name} is used by {users} request{'s' if users != 1 else ''}"
    else:
        loaded.pop(req.lora_name)
    return LoRAAdapterReqOutput(success=ok, message=message, loaded_adapters=dict(loaded))
