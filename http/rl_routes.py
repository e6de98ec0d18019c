"""What an RL loop drives besides generation, in vLLM's and SGLang's spellings: new weights
from a checkpoint folder, pausing and resuming generation around them, forgetting the saved
prompt states, and sleep mode (the GPU memory given to a trainer between rollouts).
AsyncEngine.update_weights, pause, resume, flush_cache, sleep and wake_up do the work
(engine/maintenance.py); every route here but /is_paused and /is_sleeping needs the API key.
An engine that died meanwhile is the server's 503 (its error middleware).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from deltaserve.engine.maintenance import PAUSE_MODES
from deltaserve.http import errors
from deltaserve.http.json_fields import json_object, opt_bool, opt_str
from deltaserve.http.protocol import _refuse_non_defaults, _refuse_unknown
from deltaserve.http.request_body import read_json
from deltaserve.http.server import STATE, _json

# update_weights_from_disk's fields taken only at the value that is how deltaserve works
_UPDATE_DEFAULTS = {
    "load_format": "auto",
    "flush_cache": True,
    "is_async": False,
    "torch_empty_cache": False,
}
_SGLANG_PAUSE_MODES = {"abort": "abort", "in_place": "keep"}  # SGLang's "retract" has no equal here


def add_routes(app: web.Application) -> None:
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)  # SGLang's
    for path in ("/flush_cache", "/reset_prefix_cache"):  # SGLang's, vLLM's
        app.router.add_route("GET", path, flush_cache)
        app.router.add_route("POST", path, flush_cache)
    app.router.add_post("/pause", pause)  # vLLM's
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/pause_generation", pause_generation)  # SGLang's
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/sleep", sleep)  # vLLM's
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/release_memory_occupation", release_memory_occupation)  # SGLang's
    app.router.add_post("/resume_memory_occupation", resume_memory_occupation)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """SGLang's: the same model's weights from `model_path` (AsyncEngine.update_weights),
    between requests; `weight_version` names them in later answers. `{"success", "message",
    "num_paused_requests"}`, 200, or 400 when the folder is not this model's (nothing changed)."""
    state = request.app[STATE]
    body = json_object(await read_json(request))
    _refuse_non_defaults(body, _UPDATE_DEFAULTS)
    _refuse_unknown(
        body, frozenset({"model_path", "abort_all_requests", "weight_version", *_UPDATE_DEFAULTS})
    )
    model_path, version = opt_str(body, "model_path"), opt_str(body, "weight_version")
    if not model_path:
        raise errors.bad_request(
            "model_path is required: a checkpoint folder of the served model", "model_path"
        )
    state.check_admitting()
    try:
        await state.engine.update_weights(
            model_path, abort_running=opt_bool(body, "abort_all_requests", default=False)
        )
    except ValueError as exc:
        return _json({"success": False, "message": str(exc), "num_paused_requests": 0}, 400)
    state.weight_version = version or state.weight_version
    return _json(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    )


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's /flush_cache and vLLM's /reset_prefix_cache: forget the saved prompt states,
    only while no request runs or waits (else 400)."""
    state = request.app[STATE]
    state.check_admitting()
    load = state.engine.load()
    if load.running or load.waiting:
        return web.Response(
            status=400,
            text=f"Flush cache failed: {load.running} requests running and "
            f"{load.waiting} waiting; try again when idle.\n",
        )
    await state.engine.flush_cache()
    return web.Response(status=200, text="Cache flushed.\n")


async def pause(request: web.Request) -> web.Response:
    """vLLM's `POST /pause?mode=abort|wait|keep&clear_cache=true` (AsyncEngine.pause)."""
    query = request.query
    mode = (
        "wait"
        if query.get("wait_for_inflight_requests", "").lower() == "true"
        else query.get("mode", "abort")
    )
    if mode not in PAUSE_MODES:
        raise errors.bad_request(
            f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode"
        )
    clear = query.get("clear_cache", "true").lower()
    if clear not in ("true", "false"):
        raise errors.bad_request(f"clear_cache must be true or false, got {clear!r}", "clear_cache")
    state = request.app[STATE]
    state.check_admitting()
    await state.engine.pause(mode, clear_cache=clear == "true")
    return _json({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return _json({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return _json({"is_paused": request.app[STATE].engine.is_paused})


async def pause_generation(request: web.Request) -> web.Response:
    """SGLang's: `{"mode": "abort"}` (the default) or `"in_place"` (vLLM's "keep")."""
    body = await read_json(request) if request.can_read_body else {}
    if not isinstance(body, dict) or set(body) - {"mode"}:
        raise errors.bad_request("the body must be {'mode': 'abort' | 'in_place'}")
    mode = body.get("mode") or "abort"
    if mode not in _SGLANG_PAUSE_MODES:
        raise errors.unsupported(
            "mode", f"'abort' or 'in_place' (running requests kept where they are), got {mode!r}"
        )
    state = request.app[STATE]
    state.check_admitting()
    await state.engine.pause(_SGLANG_PAUSE_MODES[mode], clear_cache=False)
    return _json({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return _json({"message": "Generation continued successfully.", "status": "ok"})


async def sleep(request: web.Request) -> web.Response:
    """vLLM's `POST /sleep?level=1|2` (AsyncEngine.sleep): 200 once asleep."""
    level = request.query.get("level", "1")
    if level not in ("1", "2"):
        raise errors.bad_request(
            f"level must be 1 (weights kept on the host) or 2 (dropped), got {level!r}", "level"
        )
    await _maintain_or_400(request, lambda engine: engine.sleep(int(level)), "level")
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    """vLLM's `POST /wake_up[?tags=weights&tags=kv_cache]` (AsyncEngine.wake_up)."""
    await _maintain_or_400(
        request, lambda engine: engine.wake_up(request.query.getall("tags", None)), "tags"
    )
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    return _json({"is_sleeping": request.app[STATE].engine.is_sleeping})


async def release_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's: `{"tags": [...]}` (weights and kv_cache together, the default) -> sleep level 1."""
    tags = await _sglang_tags(request)
    if tags is not None and set(tags) != {"weights", "kv_cache"}:
        raise errors.unsupported(
            "tags", "weights and the KV cache are released together (omit tags)"
        )
    await _maintain_or_400(request, lambda engine: engine.sleep(1), None)
    return _json({"success": True, "message": "Succeeded to release memory occupation."})


async def resume_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's: `{"tags": ["weights"]}`, then `["kv_cache"]`, or both at once (the default)."""
    tags = await _sglang_tags(request)
    await _maintain_or_400(request, lambda engine: engine.wake_up(tags), "tags")
    return _json({"success": True, "message": "Succeeded to resume memory occupation."})


async def _sglang_tags(request: web.Request) -> list[str] | None:
    body = json_object(await read_json(request)) if request.can_read_body else {}
    _refuse_unknown(body, frozenset({"tags"}))
    tags = body.get("tags")
    if tags is not None and (
        not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)
    ):
        raise errors.bad_request("tags must be a list of strings", "tags")
    return tags


async def _maintain_or_400(
    request: web.Request, call: Callable[[Any], Awaitable[None]], param: str | None
) -> None:
    """`call(engine)`; its ValueError (a tag unknown, asleep already, ...) is a 400 naming `param`."""
    state = request.app[STATE]
    state.check_admitting()
    try:
        await call(state.engine)
    except ValueError as exc:
        raise errors.bad_request(str(exc), param) from None


__all__ = ["add_routes"]
