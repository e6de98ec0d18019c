"""The aiohttp application: the OpenAI core's routes (completions, chat, models, health,
metrics, version) over one engine (engine/interface.py), the middleware, and the route modules
beside the core (dialects/: Anthropic, Responses, SGLang, tokenize, RL/admin) added to it.

Requests flow: read JSON -> parse (protocol.py) -> tokenize (`engine.encode` /
`engine.run_tokenizer`: a large input in the engine's tokenizer thread, so the event loop
keeps serving) -> `engine.generate` per prompt (generation.py) -> events formatted
(responses.py) as one JSON body or as SSE chunks.
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

import deltaserve
from deltaserve.engine.events import EngineDeadError, NoWeightsError
from deltaserve.http import errors
from deltaserve.http.auth import ApiKeys
from deltaserve.http.beam_completions import beam_completions
from deltaserve.http.cors import Cors
from deltaserve.http.dialects import (
    anthropic_routes,
    render_routes,
    responses_routes,
    rl_routes,
    sglang_routes,
    tokenize_routes,
)
from deltaserve.http.errors import ApiError
from deltaserve.http.generation import internal_error, open_chat, open_streams, respond, seeded
from deltaserve.http.metrics import render_metrics
from deltaserve.http.protocol import parse_chat_request, parse_completion_request, truncate_prompt
from deltaserve.http.request_body import read_json
from deltaserve.http.request_guard import RequestGuard
from deltaserve.http.responses import CompletionFormatter
from deltaserve.http.server_config import ServerConfig
from deltaserve.http.state import STATE, ServerState, error_response, json_response

if TYPE_CHECKING:
    from deltaserve.engine.interface import Engine

log = logging.getLogger("deltaserve.http")


def build_app(engine: Engine, config: ServerConfig) -> web.Application:
    """Serve it with `start_server` (or an AppRunner with handler_cancellation=True), so
    that a client's disconnect cancels its requests. The checks, in order: the Host
    (request_guard.py), CORS preflights (no key: a browser sends none, as in vLLM), the
    site a request comes from, the key (auth.py), the body's type; the CORS signal gives
    every response its headers (errors, 401s, SSE streams)."""
    cors = Cors(
        config.allowed_origins,
        config.allowed_methods,
        config.allowed_headers,
        config.allow_credentials,
    )
    guard = RequestGuard(config.allowed_hosts, cors)
    keys = ApiKeys(config.api_key, config.admin_api_key, rl_routes.admin_paths(config))
    app = web.Application(
        client_max_size=config.max_request_bytes,
        middlewares=[
            _error_middleware,
            guard.check_host,
            cors.middleware,
            guard.check_site,
            keys.middleware,
            guard.check_body,
        ],
    )
    app.on_response_prepare.append(cors.on_response_prepare)
    app[STATE] = ServerState(engine, config)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/ping", health)  # SageMaker's, as vLLM's: /health's answer, GET and POST
    app.router.add_post("/ping", health)
    app.router.add_post("/invocations", invocations)  # SageMaker's: a chat or a completion
    tokenize_routes.add_routes(app)  # /tokenize, /detokenize
    responses_routes.add_routes(app)  # /v1/responses
    anthropic_routes.add_routes(app)  # /v1/messages
    sglang_routes.add_routes(app)  # SGLang's /generate, /abort_request, /get_load, ...
    render_routes.add_routes(app)  # vLLM's /v1/chat/completions/render, /v1/completions/render
    rl_routes.add_routes(app, config)  # new weights, pauses, a cache flush, sleep: opt-in
    return app


# ---- middleware --------------------------------------------------------------------------


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except EngineDeadError as exc:  # it died, or shut down, while the route used it
        return error_response(errors.engine_dead(request.app[STATE].engine.dead_reason or str(exc)))
    except NoWeightsError:  # a level-2 sleep came between the route's check and its submission
        return error_response(errors.no_weights())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status
        )
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path}"
            if (
                why := rl_routes.why_not_routed(request.path, request.app[STATE].config)
            ) is not None:
                message += f": {why}"
        elif exc.status == 413:
            limit = request.app[STATE].config.max_request_bytes
            message = f"request body too large: the limit is {limit} bytes"
        return error_response(
            ApiError(exc.status, message, type="invalid_request_error", code=code)
        )
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(internal_error())


# ---- simple routes -----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        state.check_admitting()
    except ApiError as err:
        return error_response(err)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": deltaserve.__version__})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    # max_model_len: what one request can use, fewer positions where the KV cache holds fewer
    cards = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "deltaserve",
            "root": state.engine.config.model,
            "parent": None,
            "max_model_len": state.engine.longest_sequence,
        }
        for name in state.config.served_model_name
    ]
    return json_response({"object": "list", "data": cards})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    front = (
        (
            "deltaserve:stream_overflow_aborts_total",
            "Streamed requests aborted because their client stopped reading "
            "(--max-pending-stream-events).",
            state.stream_overflows,
        ),
    )
    body, content_type = render_metrics(  # as vLLM: the first served name
        state.engine, state.config.served_model_name[0], request.headers.get("Accept"), front
    )
    return web.Response(body=body, headers={"Content-Type": content_type})


# ---- generation routes -------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_completion_request(await read_json(request), state.sampling_defaults)
    model = state.model_name(req.model)
    state.check_admitting()
    if req.beam_search:
        return json_response(await beam_completions(state.engine, req, model))
    params = seeded(req.sampling, state.seeds)
    choices, bound = len(req.prompts) * params.n, state.engine.max_queued_requests
    if (
        choices > bound
    ):  # the queue could never take them all: not a 429 to retry (n alone: the engine's check)
        raise errors.bad_request(
            f"{len(req.prompts)} prompts x n={params.n} = {choices} choices exceed "
            f"max_queued_requests ({bound}); send fewer prompts per request",
            "prompt" if len(req.prompts) > 1 else "n",
        )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = [p if isinstance(p, str) else list(p) for p in req.prompts]
    fit = functools.partial(
        truncate_prompt,
        keep=req.truncate_prompt_tokens,
        max_tokens=params.max_tokens,
        max_model_len=state.engine.max_model_len,
    )
    strings = state.strings.rendering(req.return_tokens_as_token_ids)
    formatter = CompletionFormatter(
        request_id,
        model,
        strings,
        req.sampling.logprobs is not None,
        continuous_usage=req.continuous_usage,
    )
    if req.echo:  # as vLLM's: a text prompt as sent, token ids decoded (after truncation)
        formatter.echo(
            [
                p
                if isinstance(p, str)
                else await state.engine.run_tokenizer(
                    lambda tok, ids=fit(p): tok.decode(ids), len(p)
                )
                for p in prompts
            ],
            params.n,
            params.logprobs,
        )
    streams = await open_streams(
        state,
        prompts,
        [params] * len(prompts),
        request_id,
        fit=fit,
        names=req.param_names,
        priority=req.priority,
    )
    return await respond(request, formatter, streams, params.n, req.stream, req.include_usage)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_chat_request(await read_json(request), state.sampling_defaults)
    formatter, streams = await open_chat(request, req, f"chatcmpl-{uuid.uuid4().hex}")
    return await respond(request, formatter, streams, req.sampling.n, req.stream, req.include_usage)


async def invocations(request: web.Request) -> web.StreamResponse:
    """A body with `messages` is a chat completion, one with `prompt` a completion."""
    body = await read_json(request)  # the handler reads it again: aiohttp keeps the bytes
    if isinstance(body, dict) and body.get("messages") is not None:
        return await chat_completions(request)
    if isinstance(body, dict) and body.get("prompt") is not None:
        return await completions(request)
    raise errors.bad_request(
        "/invocations takes a chat completion (messages) or a completion (prompt) body"
    )
