"""Anthropic's Messages API: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`, served by the chat route's machinery: the request
translated (anthropic_request.py), the output translated back (anthropic_events.py), errors
in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from deltaserve.http.dialects.anthropic_events import MessagesFormatter
from deltaserve.http.dialects.anthropic_request import RENAMED, parse_messages_request
from deltaserve.http.errors import ApiError, renamed_fields
from deltaserve.http.generation import apply_chat_template, open_chat, respond
from deltaserve.http.protocol import parse_chat_request
from deltaserve.http.request_body import read_json
from deltaserve.http.state import STATE, json_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", _anthropic_errors(create_message))
    app.router.add_post("/v1/messages/count_tokens", _anthropic_errors(count_tokens))


def _anthropic_errors(handler: Handler) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return json_response(
                {"type": "error", "error": {"type": err.type, "message": err.message}}, err.status
            )

    return answer


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_messages_request(await read_json(request))
    with renamed_fields(RENAMED):
        chat = parse_chat_request(req.chat, state.sampling_defaults)
        formatter, streams = await open_chat(request, chat, req.message_id)
    messages = MessagesFormatter(formatter, req.message_id, req.stop_sequences)
    return await respond(request, messages, streams, 1, req.stream, include_usage=False)


async def count_tokens(request: web.Request) -> web.Response:
    """`{"input_tokens": N}`: the prompt as /v1/messages would render it."""
    state = request.app[STATE]
    req = parse_messages_request(await read_json(request), count_only=True)
    with renamed_fields(RENAMED):
        chat = parse_chat_request(req.chat, state.sampling_defaults)
    state.model_name(chat.model)
    kwargs = {**state.config.default_chat_template_kwargs, **chat.chat_template_kwargs}
    ids = await apply_chat_template(
        state.engine,
        chat.messages,
        kwargs,
        size=len(await request.read()),
        chat_template=state.config.chat_template,
        tools=chat.tools,
    )
    return json_response({"input_tokens": len(ids)})
