"""What an RL loop drives besides generation, in vLLM's and SGLang's spellings: new weights
from a checkpoint folder, pausing and resuming generation around them, forgetting the saved
prompt states, and sleep mode (the GPU memory given to a trainer between rollouts).
AsyncEngine.update_weights, pause, resume, flush_cache, sleep and wake_up do the work
(engine/maintenance.py). An engine that died meanwhile is the server's 503 (its error
middleware).

The admin routes: routed only when the server was started with the flag that enables them
(`--enable-admin-routes`, as vLLM's VLLM_SERVER_DEV_MODE; `--enable-sleep-mode` for sleep
mode's, as vLLM's), and then behind the admin key, else the API key (http/auth.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
from aiohttp import web

from deltaserve.engine.maintenance import PAUSE_MODES
from deltaserve.http import errors
from deltaserve.http.request_body import decode, only, read_json
from deltaserve.http.server_config import ServerConfig
from deltaserve.http.state import STATE, json_response


class UpdateWeightsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's update_weights_from_disk; its other fields taken only at the value that is how
    deltaserve works."""

    model_path: str | None = None
    abort_all_requests: bool | None = None
    weight_version: str | None = None
    load_format: Annotated[str | None, only("auto")] = None
    flush_cache: Annotated[bool | None, only(True)] = None
    is_async: Annotated[bool | None, only(False)] = None
    torch_empty_cache: Annotated[bool | None, only(False)] = None


class PauseGenerationBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: str | None = None  # SGLang's "abort" (the default) or "in_place"


class MemoryTagsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tags: list[str] | None = None  # SGLang's: "weights", "kv_cache"


_SGLANG_PAUSE_MODES = {"abort": "abort", "in_place": "keep"}  # SGLang's "retract" has no equal here
Handler = Callable[[web.Request], Awaitable[web.Response]]


def _routed(config: ServerConfig) -> dict[str, tuple[tuple[str, ...], Handler]]:
    return {
        **(_ADMIN_ROUTES if config.enable_admin_routes else {}),
        **(_SLEEP_ROUTES if config.enable_sleep_mode else {}),
    }


def admin_paths(config: ServerConfig) -> frozenset[str]:
    """The paths routed here under `config`: each needs the admin key (http/auth.py)."""
    return frozenset(_routed(config))


def why_not_routed(path: str, config: ServerConfig) -> str | None:
    """For a 404: the flag that would route `path`, when it is one of ours."""
    if path in _ADMIN_ROUTES and not config.enable_admin_routes:
        return "admin routes are off (--enable-admin-routes)"
    if path in _SLEEP_ROUTES and not config.enable_sleep_mode:
        return "sleep mode is off (--enable-sleep-mode)"
    return None


def add_routes(app: web.Application, config: ServerConfig) -> None:
    for path, (methods, handler) in _routed(config).items():
        for method in methods:
            app.router.add_route(method, path, handler)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """SGLang's: the same model's weights from `model_path` (AsyncEngine.update_weights),
    between requests; `weight_version` names them in later answers. `{"success", "message",
    "num_paused_requests"}`, 200, or 400 when the folder is not this model's (nothing changed)."""
    state = request.app[STATE]
    body = decode(await read_json(request), UpdateWeightsBody)
    model_path, version = body.model_path, body.weight_version
    if not model_path:
        raise errors.bad_request(
            "model_path is required: a checkpoint folder of the served model", "model_path"
        )
    root = state.config.allowed_weights_root
    if root is not None and not Path(model_path).resolve().is_relative_to(Path(root).resolve()):
        raise errors.bad_request(
            f"model_path {model_path!r} is outside --allowed-weights-root {root!r} (after "
            "symbolic links are followed): new weights load only from under it",
            "model_path",
        )
    state.check_alive()
    try:
        await state.engine.update_weights(model_path, abort_running=bool(body.abort_all_requests))
    except ValueError as exc:
        return json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, 400)
    state.weight_version = version or state.weight_version
    return json_response(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    )


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's /flush_cache and vLLM's /reset_prefix_cache: forget the saved prompt states,
    only while no request runs or waits (else 400)."""
    state = request.app[STATE]
    state.check_alive()
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
    state.check_alive()
    await state.engine.pause(mode, clear_cache=clear == "true")
    return json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return json_response({"is_paused": request.app[STATE].engine.is_paused})


async def pause_generation(request: web.Request) -> web.Response:
    """SGLang's: `{"mode": "abort"}` (the default) or `"in_place"` (vLLM's "keep")."""
    body = await read_json(request) if request.can_read_body else {}
    mode = decode(body, PauseGenerationBody).mode or "abort"
    if mode not in _SGLANG_PAUSE_MODES:
        raise errors.unsupported(
            "mode", f"'abort' or 'in_place' (running requests kept where they are), got {mode!r}"
        )
    state = request.app[STATE]
    state.check_alive()
    await state.engine.pause(_SGLANG_PAUSE_MODES[mode], clear_cache=False)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


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
    return json_response({"is_sleeping": request.app[STATE].engine.is_sleeping})


async def release_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's: `{"tags": [...]}` (weights and kv_cache together, the default) -> sleep level 1."""
    tags = await _sglang_tags(request)
    if tags is not None and set(tags) != {"weights", "kv_cache"}:
        raise errors.unsupported(
            "tags", "weights and the KV cache are released together (omit tags)"
        )
    await _maintain_or_400(request, lambda engine: engine.sleep(1), None)
    return json_response({"success": True, "message": "Succeeded to release memory occupation."})


async def resume_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's: `{"tags": ["weights"]}`, then `["kv_cache"]`, or both at once (the default)."""
    tags = await _sglang_tags(request)
    await _maintain_or_400(request, lambda engine: engine.wake_up(tags), "tags")
    return json_response({"success": True, "message": "Succeeded to resume memory occupation."})


async def _sglang_tags(request: web.Request) -> list[str] | None:
    body = await read_json(request) if request.can_read_body else {}
    return decode(body, MemoryTagsBody).tags


async def _maintain_or_400(
    request: web.Request, call: Callable[[Any], Awaitable[None]], param: str | None
) -> None:
    """`call(engine)`; its ValueError (a tag unknown,
    asleep already, ...) is a 400 naming `param`."""
    state = request.app[STATE]
    state.check_alive()
    try:
        await call(state.engine)
    except ValueError as exc:
        raise errors.bad_request(str(exc), param) from None


# path -> its methods and handler, each group behind the flag that routes it (add_routes)
_ADMIN_ROUTES = {
    "/update_weights_from_disk": (("POST",), update_weights_from_disk),  # SGLang's
    "/flush_cache": (("GET", "POST"), flush_cache),  # SGLang's
    "/reset_prefix_cache": (("GET", "POST"), flush_cache),  # vLLM's
    "/pause": (("POST",), pause),  # vLLM's
    "/resume": (("POST",), resume),
    "/is_paused": (("GET",), is_paused),
    "/pause_generation": (("POST",), pause_generation),  # SGLang's
    "/continue_generation": (("POST",), continue_generation),
}
_SLEEP_ROUTES = {
    "/sleep": (("POST",), sleep),  # vLLM's
    "/wake_up": (("POST",), wake_up),
    "/is_sleeping": (("GET",), is_sleeping),
    "/release_memory_occupation": (("POST",), release_memory_occupation),  # SGLang's
    "/resume_memory_occupation": (("POST",), resume_memory_occupation),
}

__all__ = ["add_routes", "admin_paths", "why_not_routed"]
