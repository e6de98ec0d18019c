"""A Responses API request (`POST /v1/responses`) as the chat request that serves it.

Input items become chat messages: messages by role, a `reasoning` item plus an assistant
`message` plus `function_call` items make one assistant turn (its reasoning, content and
tool calls), a `function_call_output` a tool message; `instructions` a system message first.
Function tools, `tool_choice`, `text.format` and logprobs map to their chat fields, so the
chat route's checks and refusals hold here too (their fields renamed). A stored response
(`store`, the default) is continued with `previous_response_id`: its history and its output
come before the new input, its instructions do not (as OpenAI's). The last RESPONSES_KEPT
stored responses are kept, in memory (vLLM keeps every one).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from deltaserve.http.errors import ApiError, bad_request, renamed_fields, unsupported
from deltaserve.http.protocol import TEXT_PART_SEPARATOR
from deltaserve.http.request_body import decode, only

RESPONSES_KEPT = 1024
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# a chat field an error names -> the Responses field it came from, in its param and message
_RENAMED = (
    (r"\bresponse_format\.json_schema\b", "text.format"),
    (r"\bresponse_format\b", "text.format"),
    (r"\bmax_tokens\b", "max_output_tokens"),
    (r"\bmessages\b", "input"),
    (r"\blogprobs\b", "include"),
    (r"(tools\[\d+\])\.function\b", r"\1"),
    (r"\btool_choice\.function\b", "tool_choice"),
)
_ITEM_KEYS = {  # each input item's fields (others only as null, as an SDK's dump may send them)
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "status", "encrypted_content"},
}
_TEXT_PARTS = {"input_text", "output_text", "text", "reasoning_text", "summary_text"}


class ResponsesBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Responses API's fields (unknown ones: request_body.py's policy)."""

    # the chat route's names and checks (vLLM's extras among them)
    model: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    seed: Any = None
    stop: Any = None
    parallel_tool_calls: Any = None
    chat_template_kwargs: Any = None
    priority: Any = None
    # translated
    input: Any = None  # `input_messages`
    instructions: str | None = None
    max_output_tokens: int | None = None  # the chat route checks it, as max_tokens
    stream: bool | None = None
    tools: Any = None
    tool_choice: Any = None
    text: Any = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    top_logprobs: Any = None
    include: Any = None
    # taken only at their defaults
    background: Annotated[
        bool | None, only(False, why="background responses are not supported")
    ] = None
    truncation: Annotated[
        str | None,
        only("disabled", why="only 'disabled': a prompt longer than the context is refused"),
    ] = None
    reasoning: Annotated[
        Any,
        only(
            why="reasoning settings are not supported; thinking follows the chat template "
            "(chat_template_kwargs, e.g. enable_thinking)"
        ),
    ] = None
    service_tier: Annotated[
        str | None, only("auto", "default", why="service tiers are not supported")
    ] = None
    max_tool_calls: Annotated[Any, only(why="max_tool_calls is not supported")] = None


# the fields passed to the chat route as they are
_PASSED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "priority",
)


@dataclass(frozen=True, slots=True)
class Stored:
    history: list[dict[str, Any]]  # the chat messages before the response's output, no instructions
    response: dict[str, Any]


class ResponseStore:
    """The stored responses, least recently stored dropped past `kept`."""

    def __init__(self, kept: int = RESPONSES_KEPT) -> None:
        self.kept = kept
        self._by_id: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._by_id.get(response_id)

    def put(self, history: list[dict[str, Any]], response: dict[str, Any]) -> None:
        self._by_id[response["id"]] = Stored(history, response)
        while len(self._by_id) > self.kept:
            self._by_id.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._by_id.pop(response_id, None) is not None


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        type="invalid_request_error",
        param=param,
    )


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    chat: dict[str, Any]  # the chat request body that serves it
    history: list[dict[str, Any]]  # its messages but the instructions (kept with the response)
    skeleton: dict[str, Any]  # the response object's fields known before the output
    stream: bool
    store: bool


def parse_responses_request(body: object, store: ResponseStore) -> ResponsesRequest:
    b = decode(body, ResponsesBody)
    stream, keep = bool(b.stream), b.store is not False
    history = _previous(b.previous_response_id, store) + input_messages(b.input)
    chat: dict[str, Any] = {k: v for k in _PASSED if (v := getattr(b, k)) is not None}
    instructions = b.instructions
    chat["messages"] = (
        [{"role": "system", "content": instructions}] if instructions else []
    ) + history
    chat["stream"] = True  # the formatter reads tool calls as they stream, in both modes
    limit = b.max_output_tokens
    if limit is not None:
        chat["max_tokens"] = limit
    tools = _tools(b.tools)
    if tools:
        chat["tools"] = tools
    if b.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(b.tool_choice)
    text = b.text if b.text is not None else {}
    if (
        not isinstance(text, dict)
        or set(text) - {"format", "verbosity"}
        or text.get("verbosity") is not None
    ):
        raise unsupported("text", "only text.format is supported")
    text_format = text.get("format") or {"type": "text"}
    if _response_format(text_format) is not None:
        chat["response_format"] = _response_format(text_format)
    _logprobs(b, chat)
    skeleton = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": instructions,
        "max_output_tokens": limit,
        "max_tool_calls": None,
        "metadata": b.metadata or {},
        "output": [],
        "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
        "previous_response_id": b.previous_response_id,
        "reasoning": None,
        "service_tier": "auto",
        "store": keep,
        "temperature": b.temperature,
        "text": {"format": text_format},
        "tool_choice": b.tool_choice or "auto",
        "tools": b.tools or [],
        "top_logprobs": b.top_logprobs,
        "top_p": b.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": b.user,
    }
    return ResponsesRequest(chat, history, skeleton, stream, keep)


@contextmanager
def renamed_errors() -> Iterator[None]:
    """The chat route's refusals, naming the Responses fields they came from."""
    try:
        with renamed_fields(_RENAMED):
            yield
    except ApiError as err:
        if err.param and err.param.startswith("input["):
            err.param = "input"  # a chat message's index is not its input item's
        raise


# ---- input items -> chat messages ----------------------------------------------------------


def input_messages(value: object, where: str = "input") -> list[dict[str, Any]]:
    """The chat messages of `input`: a text (one user message) or a list of items."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or an array of items", "input")
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn the items are building
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{at} must be an object", "input")
        kind = item.get("type", "message")
        if kind not in _ITEM_KEYS:
            raise unsupported("input", f"{at}: items of type '{kind}' are not supported")
        for key, v in item.items():
            if key not in _ITEM_KEYS[kind] and v is not None:
                raise bad_request(f"{at}: unknown field '{key}' for a {kind} item", "input")
        if kind == "message" and item.get("role") != "assistant":
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise bad_request(
                    f"{at}.role must be user, assistant, system or developer, got {role!r}", "input"
                )
            messages.append({"role": role, "content": _text(item.get("content"), at)})
            turn = None
            continue
        if kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request(f"{at}.call_id must be a string", "input")
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _text(output, at, "output")}
            )
            turn = None
            continue
        if _starts_turn(turn, kind):
            turn = {"role": "assistant", "content": None}
            messages.append(turn)
        if kind == "reasoning":
            turn["reasoning"] = _text(item.get("content") or item.get("summary") or [], at)
        elif kind == "message":
            turn["content"] = _text(item.get("content"), at)
        else:
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (
                isinstance(name, str) and isinstance(arguments, str) and isinstance(call_id, str)
            ):
                raise bad_request(
                    f"{at}: a function_call needs string name, arguments and call_id", "input"
                )
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            turn.setdefault("tool_calls", []).append(call)
    return messages


def _starts_turn(turn: dict[str, Any] | None, kind: str) -> bool:
    """Whether an assistant item begins a new assistant turn: a turn holds reasoning, then
    content, then tool calls, each from its own item."""
    if turn is None:
        return True
    if kind == "reasoning":
        return "reasoning" in turn or turn["content"] is not None or "tool_calls" in turn
    return kind == "message" and (turn["content"] is not None or "tool_calls" in turn)


def _text(content: object, at: str, field: str = "content") -> str:
    """A text, or the text parts of a list of content parts, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at}.{field} must be a string or an array of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise unsupported(
                "input",
                f"{at}.{field}[{j}]: only text parts are supported (the model reads "
                f"text), got {kind!r}",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{at}.{field}[{j}].text must be a string", "input")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)  # as the chat route joins a message's parts


def _previous(response_id: object, store: ResponseStore) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    if not isinstance(response_id, str):
        raise bad_request("previous_response_id must be a string", "previous_response_id")
    stored = store.get(response_id)
    if stored is None:
        raise not_found(response_id, "previous_response_id")
    return stored.history + input_messages(stored.response["output"], "previous response's output")


# ---- the other fields ----------------------------------------------------------------------


def _tools(value: object) -> list[dict[str, Any]]:
    """Function tools, in the chat route's shape (which checks their fields)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools must be an array", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise unsupported(f"tools[{i}].type", "only function tools are supported")
        function = {k: v for k, v in tool.items() if k != "type"}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: object) -> object:
    if isinstance(value, dict):
        if value.get("type") != "function" or set(value) - {"type", "name"}:
            raise unsupported(
                "tool_choice", "only 'none', 'auto', 'required' or {'type': 'function', 'name'}"
            )
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _response_format(text_format: object) -> dict[str, Any] | None:
    if not isinstance(text_format, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = text_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {k: v for k, v in text_format.items() if k != "type"},
        }
    raise unsupported("text.format.type", f"'text', 'json_object' or 'json_schema', got {kind!r}")


def _logprobs(b: ResponsesBody, chat: dict[str, Any]) -> None:
    """Logprobs come back when `include` asks for them, with `top_logprobs` alternatives."""
    include = b.include or []
    if not isinstance(include, list) or any(x != LOGPROBS_INCLUDE for x in include):
        raise unsupported("include", f"only '{LOGPROBS_INCLUDE}' can be included")
    if not include:
        if b.top_logprobs is not None:
            raise bad_request(f"top_logprobs needs include ['{LOGPROBS_INCLUDE}']", "top_logprobs")
        return
    chat["logprobs"] = True
    chat["top_logprobs"] = b.top_logprobs or 0


__all__ = [
    "LOGPROBS_INCLUDE",
    "RESPONSES_KEPT",
    "ResponseStore",
    "ResponsesRequest",
    "input_messages",
    "not_found",
    "parse_responses_request",
    "renamed_errors",
]
