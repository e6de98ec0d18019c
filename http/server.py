"""The aiohttp application: OpenAI-compatible routes over one engine (engine/interface.py).

Requests flow: read JSON -> parse (protocol.py) -> tokenize (`engine.encode` /
`engine.run_tokenizer`: a large input in the engine's tokenizer thread, so the event loop
keeps serving) -> `engine.generate` per prompt -> events formatted (responses.py) as one JSON
body or as SSE chunks. The request's streams are closed in `finally`, so a client that
disconnects (aiohttp cancels the handler; the server must run with
`handler_cancellation=True`) or a failed write cancels its requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

import deltaserve
from deltaserve.engine.events import (
    EngineDeadError,
    ErrorEvent,
    FinishedEvent,
    NoWeightsError,
    PromptLogprobsEvent,
    QueueFullError,
    TokenEvent,
)
from deltaserve.engine.media_prompt import MultimodalPrompt
from deltaserve.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from deltaserve.engine.tokenizer import generation_sampling_defaults
from deltaserve.http import errors
from deltaserve.http.auth import ApiKeys
from deltaserve.http.beam_completions import beam_chat_choices, beam_completions
from deltaserve.http.cors import Cors
from deltaserve.http.errors import ApiError
from deltaserve.http.media_parts import media_sources
from deltaserve.http.metrics import render_metrics
from deltaserve.http.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatRequest,
    SamplingFields,
    parse_chat_request,
    parse_completion_request,
    truncate_prompt,
)
from deltaserve.http.reasoning import ReasoningParser, check_include_reasoning
from deltaserve.http.request_body import read_json
from deltaserve.http.request_guard import RequestGuard
from deltaserve.http.responses import (
    ChatFormatter,
    ChoiceState,
    CompletionFormatter,
    TokenStrings,
    usage,
)
from deltaserve.http.server_config import RESERVED_TEMPLATE_KWARGS, ServerConfig
from deltaserve.http.structured_output import Guided, guided_error, refuse_in_reasoning
from deltaserve.http.tool_protocol import tool_call_reader

if TYPE_CHECKING:
    from deltaserve.engine.interface import Engine
    from deltaserve.http.output_blocks import OutputBlocks
    from deltaserve.http.sglang_output import GenerateFormatter

log = logging.getLogger("deltaserve.http")

_SAMPLING_FIELD_NAMES = frozenset(SamplingFields.__dataclass_fields__)


class ServerState:
    """What the handlers share: the engine, the config, and whether we still admit."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        # logprobs' token strings; a request's return_tokens_as_token_ids: `.rendering`
        self.strings = TokenStrings(engine.tokenizer, config.return_tokens_as_token_ids)
        self.created = int(time.time())
        self.draining = False  # set by the serve command on SIGTERM
        # streamed requests aborted for a client that stopped reading (`_respond`)
        self.stream_overflows = 0
        self.weight_version = (
            "default"  # SGLang's name for the weights served (/update_weights_from_disk)
        )
        # what a request leaves out of temperature, top_p, top_k, min_p, repetition_penalty
        self.sampling_defaults = (
            generation_sampling_defaults(engine.config.model)
            if config.generation_config == "auto"
            else {}
        )
        # the seeds of requests that give none (--seed); None: the engine draws each at random
        self.seeds = None if config.seed is None else random.Random(config.seed)
        # ValueError when the tokenizer lacks the think tags
        self.reasoning = (
            ReasoningParser.for_tokenizer(config.reasoning_parser, engine.tokenizer)
            if config.reasoning_parser is not None
            else None
        )

    def model_name(self, requested: str | None) -> str:
        """The name a response carries: the one requested (refused if not served), else the
        first (as vLLM's)."""
        names = self.config.served_model_name
        if requested is None:
            return names[0]
        if requested not in names:
            raise errors.model_not_found(requested, "', '".join(names))
        return requested

    def check_alive(self) -> None:
        """503 when the engine is dead or the server drains (what an admin route asks)."""
        if self.engine.is_dead:
            raise errors.engine_dead(self.engine.dead_reason)
        if self.draining:
            raise errors.shutting_down()

    def check_admitting(self) -> None:
        """`check_alive`, and 503 while the weights are gone (a level-2 sleep discards
        them until new ones load): what a route that generates, and /health, ask."""
        self.check_alive()
        if self.engine.weights_dropped:
            raise errors.no_weights()


STATE = web.AppKey("deltaserve_state", ServerState)


def build_app(engine: Engine, config: ServerConfig) -> web.Application:
    """Serve it with `start_server` (or an AppRunner with handler_cancellation=True), so
    that a client's disconnect cancels its requests. The checks, in order: the Host
    (request_guard.py), CORS preflights (no key: a browser sends none, as in vLLM), the
    site a request comes from, the key (auth.py), the body's type; the CORS signal gives
    every response its headers (errors, 401s, SSE streams)."""
    from deltaserve.http import rl_routes

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
    # route modules that import this one: not at its top
    from deltaserve.http import (
        anthropic_routes,
        responses_routes,
        sglang_routes,
        tokenize_routes,
    )

    tokenize_routes.add_routes(app)  # /tokenize, /detokenize, /ping, /invocations
    responses_routes.add_routes(app)  # /v1/responses
    anthropic_routes.add_routes(app)  # /v1/messages
    sglang_routes.add_routes(app)  # SGLang's /generate, /abort_request, /get_model_info, ...
    rl_routes.add_routes(app, config)  # new weights, pauses, a cache flush, sleep: opt-in
    return app


# ---- middleware --------------------------------------------------------------------------


def _error_response(err: ApiError) -> web.Response:
    return _json(err.body(), err.status)


_json_bytes = msgspec.json.Encoder().encode


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err)
    except EngineDeadError as exc:  # it died, or shut down, while the route used it
        return _error_response(
            errors.engine_dead(request.app[STATE].engine.dead_reason or str(exc))
        )
    except NoWeightsError:  # a level-2 sleep came between the route's check and its submission
        return _error_response(errors.no_weights())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status
        )
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path}"
            from deltaserve.http.rl_routes import why_not_routed  # it imports this module

            if (why := why_not_routed(request.path, request.app[STATE].config)) is not None:
                message += f": {why}"
        elif exc.status == 413:
            limit = request.app[STATE].config.max_request_bytes
            message = f"request body too large: the limit is {limit} bytes"
        return _error_response(
            ApiError(exc.status, message, type="invalid_request_error", code=code)
        )
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(_internal_error())


# ---- simple routes -----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        state.check_admitting()
    except ApiError as err:
        return _error_response(err)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return _json({"version": deltaserve.__version__})


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
    return _json({"object": "list", "data": cards})


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
    req = parse_completion_request(
        await read_json(request), state.sampling_defaults, max_logprobs=state.engine.max_logprobs
    )
    model = state.model_name(req.model)
    state.check_admitting()
    if req.beam_search:
        return _json(await beam_completions(state.engine, req, model))
    max_tokens = req.sampling.max_tokens
    params = _params(
        req.sampling,
        DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs_param="logprobs",
        seeds=state.seeds,
    )
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
    streams = await _open_streams(
        state,
        prompts,
        [params] * len(prompts),
        request_id,
        fit=fit,
        guided=req.sampling.guided,
        priority=req.priority,
    )
    return await _respond(request, formatter, streams, params.n, req.stream, req.include_usage)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_chat_request(
        await read_json(request), state.sampling_defaults, max_logprobs=state.engine.max_logprobs
    )
    formatter, streams = await open_chat(request, req, f"chatcmpl-{uuid.uuid4().hex}")
    return await _respond(
        request, formatter, streams, req.sampling.n, req.stream, req.include_usage
    )


async def open_chat(
    request: web.Request, req: ChatRequest, request_id: str
) -> tuple[ChatFormatter, list[Any]]:
    """A parsed chat request rendered, checked and submitted: its formatter and streams (the
    chat route's, and the Responses and Messages APIs' under their translations)."""
    state = request.app[STATE]
    model = state.model_name(req.model)
    check_include_reasoning(state.reasoning, req.include_reasoning, req.logprobs)
    tool_calls = tool_call_reader(
        req.tool_choice,
        req.tools,
        req.parallel_tool_calls,
        state.config.tool_call_parser if state.config.enable_auto_tool_choice else None,
    )
    state.check_admitting()
    template_kwargs = {**state.config.default_chat_template_kwargs, **req.chat_template_kwargs}
    sources = media_sources(req.messages)
    rendered = await _apply_chat_template(
        state.engine,
        req.messages,
        template_kwargs,
        size=len(await request.read()),
        chat_template=state.config.chat_template,
        tools=req.tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        text_only=bool(sources),
    )
    max_tokens = req.sampling.max_tokens
    prompt: list[int] | MultimodalPrompt
    if sources:  # images or video: fetched, preprocessed and placed (engine/media.py)
        if req.truncate_prompt_tokens is not None or req.beam_search:
            raise errors.unsupported(
                "use_beam_search" if req.beam_search else "truncate_prompt_tokens",
                "not with images or video in the messages",
            )
        try:
            prompt = await state.engine.media_prompt(rendered, sources)
        except EngineDeadError as exc:
            raise errors.engine_dead(state.engine.dead_reason or str(exc)) from None
        except ValueError as exc:  # MediaError: names the part
            raise errors.bad_request(str(exc), "messages") from None
        prompt_ids = list(prompt.ids)
    else:
        prompt_ids = prompt = truncate_prompt(
            rendered, req.truncate_prompt_tokens, max_tokens, state.engine.max_model_len
        )
    if max_tokens is None:  # as vLLM: whatever context (or, if smaller, KV cache) the prompt leaves
        max_tokens = max(1, state.engine.longest_sequence - len(prompt_ids))
    params = _params(req.sampling, max_tokens, logprobs_param="top_logprobs", seeds=state.seeds)
    thinks = state.reasoning is not None and state.reasoning.starts_in_reasoning(prompt_ids)
    if req.sampling.guided.param and thinks:
        raise refuse_in_reasoning(req.sampling.guided)
    if params.thinking_budget is not None and not thinks:
        raise errors.bad_request(
            "thinking_budget needs a prompt that opens a think block (--reasoning-parser, "
            "and thinking on in the chat template)",
            "thinking_budget",
        )
    strings = state.strings.rendering(req.return_tokens_as_token_ids)
    formatter = ChatFormatter(
        request_id,
        model,
        strings,
        req.logprobs,
        reasoning=state.reasoning,
        prompt_ids=prompt_ids,
        include_reasoning=req.include_reasoning,
        tool_calls=tool_calls,
        streaming=req.stream,
        continuous_usage=req.continuous_usage,
    )
    if req.beam_search:  # its beams, read as a finished stream's choices
        return formatter, [
            await beam_chat_choices(
                state.engine, prompt_ids, params, req.length_penalty, request_id
            )
        ]
    streams = await _open_streams(
        state,
        [prompt],
        [params],
        request_id,
        prompt_param="messages",
        guided=req.sampling.guided,
        priority=req.priority,
    )
    return formatter, streams


def _params(
    fields: SamplingFields,
    max_tokens: int,
    *,
    logprobs_param: str,
    seeds: random.Random | None = None,
) -> SamplingParams:
    """`seeds`: where a request that gives no seed takes one (--seed)."""
    if fields.seed is None and seeds is not None:
        fields = replace(fields, seed=seeds.randrange(SEED_MIN, SEED_MAX + 1))
    try:
        return fields.to_sampling_params(max_tokens)
    except ValueError as exc:
        raise guided_error(str(exc), fields.guided) or errors.bad_request(
            str(exc), _param_of(str(exc), logprobs_param)
        ) from None


def _param_of(
    message: str, logprobs_param: str = "logprobs", *, prompt_param: str = "prompt"
) -> str | None:
    """The field a SamplingParams/engine ValueError names (its messages start with it)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if first == "logprobs":
        return logprobs_param
    if first in _SAMPLING_FIELD_NAMES or first == "priority":
        return first
    if first.startswith("prompt"):
        return prompt_param
    return None


async def _apply_chat_template(
    engine: Engine,
    messages: Sequence[dict[str, Any]],
    kwargs: dict[str, Any],
    size: int,
    chat_template: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    text_only: bool = False,
) -> Any:
    """The prompt's token ids: the template (`chat_template`, else the tokenizer's) rendered
    with the request's `tools` and tokenized, off the event loop when the request (`size`
    bytes, which bounds what the template sees) is large. The flags: /tokenize's (vLLM's).
    `text_only`: the rendered text, untokenized (images' placeholders are expanded later)."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise errors.unsupported(f"chat_template_kwargs.{key}", "reserved by the server")
    if not chat_template and not getattr(engine.tokenizer, "chat_template", None):
        raise errors.bad_request(
            "the model has no chat template; use /v1/completions, or give "
            "one at start (--chat-template)",
            "messages",
        )

    def render(tokenizer: Any) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(
                list(messages),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                tools=list(tools) if tools else None,
                **kwargs,
            )
        except Exception as exc:  # jinja errors from the template (e.g. role order)
            raise errors.bad_request(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from None
        return text if text_only else tokenizer.encode(text, add_special_tokens=add_special_tokens)

    try:
        return await engine.run_tokenizer(render, size)
    except EngineDeadError as exc:  # it died or shut down meanwhile
        raise errors.engine_dead(engine.dead_reason or str(exc)) from None


async def _open_streams(
    state: ServerState,
    prompts: list[str | list[int]],
    params: list[SamplingParams],
    request_id: str,
    *,
    prompt_param: str = "prompt",
    fit: Callable[[list[int]], list[int]] = list,
    guided: Guided = Guided(),
    priority: int = 0,
    request_ids: Sequence[str] = (),
) -> list[Any]:
    """Submit every prompt, or none: all are tokenized (a large text off the event loop), then
    checked together, before any is submitted, so a refusal opens no stream that would count
    as an abort. An error about the prompt names `prompt_param` (a chat's prompt is its
    messages). `fit`: each prompt's ids as submitted (truncate_prompt_tokens). An error about
    the `guided` constraint names the field it came from. `request_ids`: each prompt's engine
    id, where the client named them (else `request_id`, numbered when there are several)."""
    streams: list[Any] = []
    try:
        # structured outputs and stop regexes compiled (off the loop; each text once)
        params = [await state.engine.prepare(p) for p in params]
        prompts = [
            p
            if isinstance(p, MultimodalPrompt)
            else fit(await state.engine.encode(p) if isinstance(p, str) else p)
            for p in prompts
        ]
        if len(prompts) > 1:  # all or none: no stream opened to be closed (counted an abort)
            state.engine.check(prompts, params, request_id)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = (
                request_ids[i]
                if request_ids
                else request_id
                if len(prompts) == 1
                else f"{request_id}-{i}"
            )
            streams.append(state.engine.generate(prompt, p, request_id=rid, priority=priority))
    except BaseException as exc:
        for s in streams:
            await s.aclose()
        if isinstance(exc, QueueFullError):
            raise errors.queue_full(str(exc)) from None
        if isinstance(exc, EngineDeadError):
            raise errors.engine_dead(state.engine.dead_reason or str(exc)) from None
        if isinstance(exc, ValueError):
            raise guided_error(str(exc), guided) or errors.bad_request(
                str(exc), _param_of(str(exc), prompt_param=prompt_param)
            ) from None
        raise
    return streams


async def _merged(streams: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """Events of several streams as (stream index, event), in arrival order."""
    if len(streams) == 1:
        async for ev in streams[0]:
            yield 0, ev
        return
    # bounded: a consumer that stops reading leaves the events waiting in the streams, whose
    # own bound (limit_pending) then ends them
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue(len(streams))

    async def pump(i: int, stream: Any) -> None:
        try:
            async for ev in stream:
                await queue.put((i, ev, None))
        except Exception as exc:
            await queue.put((i, None, exc))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_count = len(streams)
        while open_count:
            i, ev, exc = await queue.get()
            if exc is not None:
                raise exc
            if ev is None:
                open_count -= 1
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _RequestFailed(Exception):
    """`last_chunk`: what a stream sends before the error (its choice's finish)."""

    def __init__(self, err: ApiError, last_chunk: Any = None) -> None:
        self.err = err
        self.last_chunk = last_chunk


def _terminal_error(state: ServerState, ev: Any) -> ApiError:
    """The error a client sees for an ErrorEvent or an abort that reached it."""
    if state.engine.is_dead:
        return errors.engine_dead(state.engine.dead_reason or getattr(ev, "message", None))
    if isinstance(
        ev, FinishedEvent
    ):  # "abort" reaches a live client on shutdown, /abort_request or /pause
        why = (
            "the server is shutting down"
            if state.draining
            else "asked for (an abort, or a pause in abort mode)"
        )
        return ApiError(
            503, f"the request was aborted: {why}", type="service_unavailable", code="aborted"
        )
    if ev.bound:  # it went past one of its own bounds while generating: a client error
        return ApiError(400, ev.message, type="invalid_request_error", code="bound_exceeded")
    return ApiError(
        500, f"the request failed: {ev.message}", type="internal_error", code="request_failed"
    )


async def _respond(
    request: web.Request,
    formatter: CompletionFormatter | ChatFormatter | OutputBlocks | GenerateFormatter,
    streams: list[Any],
    n: int,
    stream: bool,
    include_usage: bool,
) -> web.StreamResponse:
    state = request.app[STATE]
    states = [
        ChoiceState(prompt_tokens=len(ids), prompt_ids=ids)
        for ids in (streams[i // n].prompt_token_ids for i in range(len(streams) * n))
    ]
    response: web.StreamResponse | None = None
    overflowed = False

    def overflow() -> None:
        """A stream's client read none of its last events: the request is aborted, its
        connection closed (which ends a write waiting on it), counted once."""
        nonlocal overflowed
        if overflowed:
            return
        overflowed = True
        state.stream_overflows += 1
        log.warning(
            "%s: aborted: over %d events per choice waited for a client that does not read",
            formatter.id,
            state.config.max_pending_stream_events,
        )
        if request.transport is not None:
            request.transport.abort()

    try:
        if stream:
            for s in streams:
                s.limit_pending(state.config.max_pending_stream_events * n, overflow)
            response = web.StreamResponse(
                # the charset, as OpenAI and vLLM send it: clients that decode by the header
                # (requests) read text/* without one as Latin-1
                headers={
                    "Content-Type": "text/event-stream; charset=utf-8",
                    "Cache-Control": "no-cache",
                }
            )
            await response.prepare(request)
            for idx in range(len(states)):
                chunk = formatter.start(idx, states[idx])
                if chunk is not None:
                    await response.write(formatter.encode(chunk))
        events = _merged(streams)
        try:
            async for p, ev in events:
                idx = p * n + ev.index
                chunk = _apply(state, formatter, idx, ev, states[idx])
                if response is not None and chunk is not None:
                    await response.write(formatter.encode(chunk))
        finally:
            await events.aclose()
        if overflowed:  # its streams ended early: not a complete answer
            raise ConnectionResetError("aborted: the client stopped reading")
        prompt_tokens = sum(states[p * n].prompt_tokens for p in range(len(streams)))
        cached = sum(states[p * n].cached_tokens for p in range(len(streams)))
        usage_json = usage(
            prompt_tokens,
            sum(s.output_tokens for s in states),
            cached if state.config.enable_prompt_tokens_details else 0,
        )
        if response is None:
            return _json(formatter.response(states, usage_json))
        await response.write(formatter.stream_end(usage_json, include_usage))
        await response.write_eof()
        return response
    except _RequestFailed as failed:
        if response is None:
            raise failed.err from None
        if failed.last_chunk is not None:
            await response.write(formatter.encode(failed.last_chunk))
        await _end_with_error(response, formatter.stream_error(failed.err))
        return response
    except ConnectionResetError:  # the client went away mid-write: cancelled in `finally`
        if response is None:
            raise
        return response
    except Exception:
        if response is None:
            raise
        log.exception("streaming %s failed", formatter.id)
        await _end_with_error(response, formatter.stream_error(_internal_error()))
        return response
    finally:
        for s in streams:  # idempotent; cancels whatever is still running
            await s.aclose()


async def _end_with_error(response: web.StreamResponse, error_events: bytes) -> None:
    """Headers are sent: the error travels as the formatter's SSE event (which the API's
    client raises)."""
    with contextlib.suppress(ConnectionResetError):
        await response.write(error_events)
        await response.write_eof()


def _internal_error() -> ApiError:
    return ApiError(500, "internal server error", type="internal_error", code="internal_error")


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=_json_bytes(body), status=status, content_type="application/json")


def _apply(
    state: ServerState,
    formatter: CompletionFormatter | ChatFormatter,
    idx: int,
    ev: Any,
    choice: ChoiceState,
) -> dict[str, Any] | None:
    if isinstance(ev, TokenEvent):
        return formatter.token(idx, ev, choice)
    if isinstance(ev, PromptLogprobsEvent):  # sent with the choice's first token, if at all
        formatter.prompt(idx, ev, choice)
        return None
    if isinstance(ev, FinishedEvent):
        if ev.reason == "abort" and not getattr(formatter, "finishes_aborts", False):
            raise _RequestFailed(_terminal_error(state, ev))
        choice.finish_reason = ev.reason
        choice.stop_reason = ev.stop_reason
        choice.prompt_tokens = ev.prompt_tokens
        choice.cached_tokens = ev.cached_tokens
        choice.output_tokens = ev.output_tokens
        return formatter.finish(idx, ev, choice)
    if isinstance(ev, ErrorEvent):
        last = None
        if ev.bound and isinstance(formatter, CompletionFormatter | ChatFormatter):
            # the choice ends with finish_reason "error", then the error names the bound
            choice.finish_reason = "error"
            ended = FinishedEvent(ev.index, "error", choice.prompt_tokens, choice.output_tokens, "")
            last = formatter.finish(idx, ended, choice)
        raise _RequestFailed(_terminal_error(state, ev), last)
    raise TypeError(f"unexpected engine event {type(ev).__name__}")
