"""vLLM's `/tokenize` and `/detokenize`: token counts and exact ids for clients (chat UIs,
evals, RL frameworks), without generating.

A `prompt` is tokenized as /v1/completions tokenizes one; `messages` are checked and rendered
as /v1/chat/completions renders them (the same parsing, template, tools and template kwargs);
a large input off the event loop. Outside /v1: no API key guards them, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from deltaserve.engine.events import EngineDeadError
from deltaserve.http import errors
from deltaserve.http.generation import apply_chat_template
from deltaserve.http.protocol import parse_chat_request, token_ids
from deltaserve.http.request_body import decode, read_json
from deltaserve.http.state import STATE, ServerState, json_response

T = TypeVar("T")


class TokenizePromptBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's TokenizeCompletionRequest (its chat_template, media_io_kwargs and
    mm_processor_kwargs are refused as unknown, as the chat route refuses them)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # default: true, as a completion's prompt
    return_token_strs: bool | None = None


class TokenizeChatBody(TokenizePromptBody):
    """vLLM's TokenizeChatRequest: the messages and what renders them, parsed as the chat
    route parses them (`_CHAT_ROUTE_FIELDS`); add_special_tokens' default: false."""

    messages: Any = None
    tools: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None


_CHAT_ROUTE_FIELDS = (
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)


class DetokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[Any]  # token ids, checked by protocol.py's token_ids


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


async def tokenize(request: web.Request) -> web.Response:
    """`{"count", "max_model_len", "tokens", "token_strs"}`; token_strs null unless asked."""
    state = request.app[STATE]
    obj = await read_json(request)
    is_chat = isinstance(obj, dict) and obj.get("messages") is not None
    if is_chat and obj.get("prompt") is not None:
        raise errors.bad_request(
            "give either prompt (a text) or messages (a chat), not both", "messages"
        )
    if is_chat:
        body = decode(obj, TokenizeChatBody)
        ids = await _chat_ids(state, body, size=len(await request.read()))
    else:
        body = decode(obj, TokenizePromptBody)
        ids = await _prompt_ids(state, body)
    strs = (
        await _run(state, lambda tok: tok.convert_ids_to_tokens(ids), len(ids))
        if body.return_token_strs
        else None
    )
    # max_model_len: as /v1/models gives it, what one request can use
    return json_response(
        {
            "count": len(ids),
            "max_model_len": state.engine.longest_sequence,
            "tokens": ids,
            "token_strs": strs,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    """`{"prompt": text}`: the ids decoded with their special tokens, as vLLM's."""
    state = request.app[STATE]
    body = decode(await read_json(request), DetokenizeBody)
    ids = token_ids(body.tokens, "tokens", empty_ok=True)
    vocab = state.engine.model_config.vocab_size  # the bound the engine holds prompt ids to
    for i, t in enumerate(ids):
        if t >= vocab:
            raise errors.bad_request(
                f"tokens[{i}] is {t}, outside the vocabulary [0, {vocab})", "tokens"
            )
    state.model_name(body.model)
    return json_response({"prompt": await _run(state, lambda tok: tok.decode(list(ids)), len(ids))})


async def _prompt_ids(state: ServerState, body: TokenizePromptBody) -> list[int]:
    prompt = body.prompt
    if prompt is None:
        raise errors.bad_request(
            "either prompt (a text) or messages (a chat) is required", "prompt"
        )
    special = body.add_special_tokens is not False
    state.model_name(body.model)
    return await _run(
        state, lambda tok: tok.encode(prompt, add_special_tokens=special), len(prompt)
    )


async def _chat_ids(state: ServerState, body: TokenizeChatBody, size: int) -> list[int]:
    chat = parse_chat_request({key: getattr(body, key) for key in _CHAT_ROUTE_FIELDS})
    special = bool(body.add_special_tokens)
    state.model_name(body.model)
    kwargs = {**state.config.default_chat_template_kwargs, **chat.chat_template_kwargs}
    return await apply_chat_template(
        state.engine,
        chat.messages,
        kwargs,
        size,
        chat_template=state.config.chat_template,
        tools=chat.tools,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        add_special_tokens=special,
    )


async def _run(state: ServerState, fn: Callable[[Any], T], size: int) -> T:
    """`fn(tokenizer)`, in the engine's tokenizer thread when `size` is large."""
    try:
        return await state.engine.run_tokenizer(fn, size)
    except EngineDeadError as exc:
        raise errors.engine_dead(state.engine.dead_reason or str(exc)) from None
