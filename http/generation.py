"""A generation's way through the server, shared by every route that generates (the OpenAI
routes in server.py, the Anthropic, Responses and SGLang ones in dialects/): a chat rendered
and submitted (`open_chat`), prompts submitted all or none (`open_streams`), and the engine's
events answered as one JSON body or as SSE chunks (`respond`). The request's streams are
closed in `finally`, so a client that disconnects (aiohttp cancels the handler; the server
must run with `handler_cancellation=True`) or a failed write cancels its requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from deltaserve.engine.events import (
    EngineDeadError,
    ErrorEvent,
    FinishedEvent,
    PromptLogprobsEvent,
    QueueFullError,
    TokenEvent,
)
from deltaserve.engine.media_prompt import MultimodalPrompt
from deltaserve.engine.sampling_params import SEED_MAX, SEED_MIN, ParamError, SamplingParams
from deltaserve.http import errors
from deltaserve.http.beam_completions import beam_chat_choices
from deltaserve.http.errors import ApiError
from deltaserve.http.media_parts import media_sources
from deltaserve.http.protocol import ChatRequest, truncate_prompt
from deltaserve.http.reasoning import check_include_reasoning
from deltaserve.http.responses import ChatFormatter, ChoiceState, CompletionFormatter, usage
from deltaserve.http.server_config import RESERVED_TEMPLATE_KWARGS
from deltaserve.http.state import STATE, ServerState, json_response
from deltaserve.http.structured_output import refuse_in_reasoning
from deltaserve.http.tool_protocol import tool_call_reader

if TYPE_CHECKING:
    from deltaserve.engine.interface import Engine

log = logging.getLogger("deltaserve.http")


class Formatter(Protocol):
    """What `respond` asks of an API's formatter (responses.py's, and each dialect's)."""

    id: str

    def start(self, idx: int, choice: ChoiceState) -> dict[str, Any] | None: ...
    def token(self, idx: int, ev: TokenEvent, choice: ChoiceState) -> dict[str, Any] | None: ...
    def prompt(self, idx: int, ev: PromptLogprobsEvent, choice: ChoiceState) -> None: ...
    def finish(self, idx: int, ev: FinishedEvent, choice: ChoiceState) -> dict[str, Any] | None: ...
    def encode(self, chunk: dict[str, Any]) -> bytes: ...
    def response(self, states: list[ChoiceState], usage: dict[str, Any]) -> dict[str, Any]: ...
    def stream_end(self, usage: dict[str, Any], include_usage: bool) -> bytes: ...
    def stream_error(self, err: ApiError) -> bytes: ...


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
    rendered = await apply_chat_template(
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
            rendered,
            req.truncate_prompt_tokens,
            req.sampling.max_tokens,
            state.engine.max_model_len,
        )
    params = seeded(req.sampling, state.seeds)
    thinks = state.reasoning is not None and state.reasoning.starts_in_reasoning(prompt_ids)
    if req.guided.param and thinks:
        raise refuse_in_reasoning(req.guided)
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
                state.engine, prompt_ids, params, req.length_penalty, request_id, req.param_names
            )
        ]
    streams = await open_streams(
        state,
        [prompt],
        [params],
        request_id,
        names=req.param_names,
        priority=req.priority,
    )
    return formatter, streams


def seeded(params: SamplingParams, seeds: random.Random | None) -> SamplingParams:
    """`params` with the server's next seed (`seeds`: --seed) where the request gives none."""
    if params.seed is not None or seeds is None:
        return params
    return replace(params, seed=seeds.randrange(SEED_MIN, SEED_MAX + 1))


async def apply_chat_template(
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


async def open_streams(
    state: ServerState,
    prompts: list[str | list[int]],
    params: list[SamplingParams],
    request_id: str,
    *,
    names: Mapping[str, str] = {},
    fit: Callable[[list[int]], list[int]] = list,
    priority: int = 0,
    request_ids: Sequence[str] = (),
) -> list[Any]:
    """Submit every prompt, or none: all are tokenized (a large text off the event loop), then
    checked together, before any is submitted, so a refusal opens no stream that would count
    as an abort. A refused parameter is a 400 naming the request's field (`names`: the
    engine's names -> the request's; a chat's prompt is its messages). `fit`: each prompt's
    ids as submitted (truncate_prompt_tokens). `request_ids`: each prompt's engine id, where
    the client named them (else `request_id`, numbered when there are several)."""
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
        if isinstance(exc, ParamError):
            raise errors.refused_param(exc, names) from None
        if isinstance(exc, ValueError):  # no field of its own to name
            raise errors.bad_request(str(exc)) from None
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


async def respond(
    request: web.Request,
    formatter: Formatter,
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
            return json_response(formatter.response(states, usage_json))
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
        await _end_with_error(response, formatter.stream_error(internal_error()))
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


def internal_error() -> ApiError:
    return ApiError(500, "internal server error", type="internal_error", code="internal_error")
