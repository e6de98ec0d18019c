"""OpenAI's Responses API: `POST /v1/responses` (streamed or not), and `GET` and `DELETE
/v1/responses/{id}` for stored responses. Served by the chat route's machinery: the request
translated (responses_request.py), the output translated back (responses_events.py).
"""

from __future__ import annotations

from aiohttp import web

from deltaserve.http.dialects.responses_events import ResponsesFormatter
from deltaserve.http.dialects.responses_request import (
    ResponseStore,
    not_found,
    parse_responses_request,
    renamed_errors,
)
from deltaserve.http.generation import open_chat, respond
from deltaserve.http.protocol import parse_chat_request
from deltaserve.http.request_body import read_json
from deltaserve.http.state import STATE, json_response

STORE = web.AppKey("deltaserve_responses", ResponseStore)


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)


async def create_response(request: web.Request) -> web.StreamResponse:
    state, store = request.app[STATE], request.app[STORE]
    req = parse_responses_request(await read_json(request), store)
    with renamed_errors():
        chat = parse_chat_request(req.chat, state.sampling_defaults)
        formatter, streams = await open_chat(request, chat, req.skeleton["id"])

    def keep(response: dict) -> None:
        if req.store:
            store.put(req.history, response)

    responses = ResponsesFormatter(formatter, req.skeleton, keep)
    return await respond(request, responses, streams, 1, req.stream, include_usage=False)


async def retrieve_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored = request.app[STORE].get(response_id)
    if stored is None:
        raise not_found(response_id)
    return json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[STORE].delete(response_id):
        raise not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})
