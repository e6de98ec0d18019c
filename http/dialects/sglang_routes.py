"""SGLang's native API, for clients written against an SGLang server (its frontend language,
RL frameworks such as slime and AReaL): `POST /generate` (token ids in and out, logprobs,
batches; served by the completion route's machinery, sglang_request.py and sglang_output.py),
`POST /abort_request`, `GET /health_generate`, `GET /get_model_info` and `/get_server_info`
(and SGLang's newer `/model_info`, `/server_info`), and `GET /get_load`, which routers' load
monitors poll (sglang-router's power_of_two and cache_aware's balance; vllm-router's too).
What an RL loop drives besides (weights, pauses): rl_routes.py.

Errors keep this server's shape (`{"error": {"message", ...}}`, SGLang's `error.message`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
from aiohttp import web

import deltaserve
from deltaserve.engine.events import ErrorEvent, FinishedEvent, QueueFullError
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http import errors
from deltaserve.http.dialects.sglang_output import GenerateFormatter
from deltaserve.http.dialects.sglang_request import RENAMED, parse_generate_request
from deltaserve.http.errors import renamed_fields
from deltaserve.http.generation import open_streams, respond, seeded
from deltaserve.http.protocol import parse_completion_request
from deltaserve.http.request_body import decode, read_json
from deltaserve.http.state import STATE, json_response

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default


class AbortBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    rid: str | None = None
    abort_all: bool | None = None


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/health_generate", health_generate)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/get_load", get_load)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_generate_request(await read_json(request))
    with renamed_fields(RENAMED):
        parsed = [
            parse_completion_request(body, state.sampling_defaults, default_max_tokens=None)
            for body in req.bodies
        ]
        state.check_admitting()
        prompts = [
            await state.engine.encode(p) if isinstance(p, str) else list(p)
            for p in (c.prompts[0] for c in parsed)
        ]
        for prompt in prompts:
            if req.return_logprob and req.logprob_start_len >= len(prompt):
                raise errors.bad_request(
                    f"logprob_start_len ({req.logprob_start_len}) must be less than the "
                    f"prompt's length ({len(prompt)} tokens)",
                    "logprob_start_len",
                )
        params = [seeded(completion.sampling, state.seeds) for completion in parsed]
        streams = await open_streams(
            state,
            prompts,
            params,
            req.rids[0],
            request_ids=req.rids,
            names=parsed[0].param_names,
            priority=parsed[0].priority,
        )
    formatter = GenerateFormatter(req, params[0].n, state.strings, lambda: state.weight_version)
    return await respond(request, formatter, streams, params[0].n, req.stream, include_usage=False)


async def abort_request(request: web.Request) -> web.Response:
    """SGLang's: `{"rid"}` cancels that request (and a batch's `{rid}_{i}`), `{"abort_all":
    true}` every request of this server; each answers with its abort. Unknown ids: nothing."""
    engine = request.app[STATE].engine
    body = decode(await read_json(request), AbortBody)
    rid, every = body.rid, bool(body.abort_all)
    for active in engine.request_ids():
        if every or (rid and (active == rid or active.startswith(f"{rid}_"))):
            await engine.abort(active)
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """200 once a one-token request comes back from the model; 503 (with why) if the engine is
    dead, stopping, or the token does not come within HEALTH_GENERATE_TIMEOUT_S."""
    state = request.app[STATE]
    state.check_admitting()
    try:
        stream = state.engine.generate([0], SamplingParams(max_tokens=1, temperature=0.0))
    except QueueFullError as exc:  # as SGLang's: busy is not unhealthy, but no token came
        raise errors.queue_full(str(exc)) from None
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            async for ev in stream:
                if isinstance(ev, ErrorEvent) or (
                    isinstance(ev, FinishedEvent) and ev.reason == "abort"
                ):
                    break
                if isinstance(ev, FinishedEvent):
                    return web.Response(status=200)
    except TimeoutError:
        pass
    finally:
        await stream.aclose()
    raise errors.ApiError(
        503, "the engine did not generate a token", type="service_unavailable", code="unhealthy"
    )


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    config = _checkpoint_config(engine.config.model)
    return json_response(
        {
            "model_path": engine.weights_dir,
            "tokenizer_path": engine.config.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """The settings SGLang's clients read (context length, the token capacity, version), under
    SGLang's names, and each data-parallel replica's load as `internal_states`."""
    state = request.app[STATE]
    engine, load = state.engine, state.engine.load()
    return json_response(
        {
            "model_path": engine.weights_dir,
            "tokenizer_path": engine.config.model,
            "served_model_name": state.config.served_model_name[0],
            "tp_size": engine.config.tp_size,
            "dp_size": len(engine.replica_loads()),
            "context_length": engine.max_model_len,
            "max_running_requests": engine.config.max_num_seqs,
            "max_total_num_tokens": load.num_blocks * engine.config.block_size,
            "max_req_input_len": engine.longest_sequence - 1,
            "page_size": engine.config.block_size,
            "schedule_policy": engine.config.scheduling_policy,
            "weight_version": state.weight_version,
            "internal_states": [
                {
                    "running_requests": r.running,
                    "waiting_queue_size": r.waiting,
                    "engine_state": r.state,
                }
                for r in engine.replica_loads()
            ],  # one per data-parallel replica, as SGLang's
            "version": deltaserve.__version__,
        }
    )


async def get_load(request: web.Request) -> web.Response:
    """One entry per data-parallel replica, as SGLang answers one per DP rank: `num_reqs`
    requests held (running and waiting), `num_waiting_reqs` of them not yet admitted,
    `num_tokens` KV positions in use (blocks held x block size: saved prefixes count, as in
    `/metrics`)."""
    engine = request.app[STATE].engine
    block_size = engine.config.block_size
    return json_response(
        [
            {
                "dp_rank": rank,
                "num_reqs": load.running + load.waiting,
                "num_waiting_reqs": load.waiting,
                "num_tokens": (load.num_blocks - load.free_blocks) * block_size,
            }
            for rank, load in enumerate(engine.replica_loads())
        ]
    )


def _checkpoint_config(model_dir: str) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


__all__ = ["add_routes"]
