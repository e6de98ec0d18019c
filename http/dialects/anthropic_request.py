"""An Anthropic Messages API request (`POST /v1/messages`) as the chat request that serves it.

`system` becomes a system message; a user message's `tool_result` blocks become tool
messages (before its text, as Anthropic orders them); an assistant message's `thinking`,
`text` and `tool_use` blocks become one assistant turn (its reasoning, content and tool
calls, the input as a JSON text). Tools (`input_schema`) and `tool_choice` (auto, any, tool,
none) map to the chat's, so the chat route's checks and refusals hold here too, and
`cache_control` marks are taken as the hints they are (prefix caching, when on, needs none).
SGLang and vLLM serve the same translation; Claude Code and the `anthropic` SDK speak it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from deltaserve.http.errors import bad_request, unsupported
from deltaserve.http.media_parts import anthropic_image
from deltaserve.http.protocol import TEXT_PART_SEPARATOR
from deltaserve.http.request_body import decode, expect, only

# thinking settings -> the chat template's enable_thinking ("adaptive": the model decides how
# long to think, as Qwen3.5 does when thinking is on; "enabled": within budget_tokens)
_THINKING = {"disabled": False, "adaptive": True, "enabled": True}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
RENAMED = (
    (
        r"\bresponse_format(\.json_schema)?\b",
        "output_config.format",
    ),  # the chat route's names -> ours
    (r"(tools\[\d+\])\.function\.parameters\b", r"\1.input_schema"),
    (r"(tools\[\d+\])\.function\b", r"\1"),
    (r"\btool_choice\.function\b", "tool_choice"),
    (r"\bthinking_budget\b", "thinking.budget_tokens"),
)


class MessagesBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Messages API's fields (unknown ones: request_body.py's policy). The sampling fields
    and the model pass to the chat route, which checks them."""

    model: Any = None
    messages: Any = None  # content blocks: `chat_messages`
    max_tokens: int | None = None  # required, but by count_tokens
    system: Any = None
    stop_sequences: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1)]] | None,
        expect("an array of non-empty strings"),
    ] = None
    stream: bool | None = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    tools: Any = None
    tool_choice: Any = None
    metadata: dict[str, Any] | None = None
    thinking: Any = None
    service_tier: Annotated[
        str | None, only("auto", "standard_only", why="service tiers are not supported")
    ] = None
    cache_control: Any = None  # a hint: prefix caching, when on, needs none
    output_config: Any = None


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    chat: dict[str, Any]  # the chat request body that serves it
    message_id: str
    stream: bool
    stop_sequences: tuple[str, ...]


def parse_messages_request(body: object, *, count_only: bool = False) -> MessagesRequest:
    """`count_only`: /v1/messages/count_tokens's body (no max_tokens)."""
    b = decode(body, MessagesBody)
    chat: dict[str, Any] = {"model": b.model, "temperature": b.temperature, "top_p": b.top_p}
    chat["top_k"] = b.top_k
    chat["messages"] = _system(b.system) + chat_messages(b.messages)
    if not count_only:
        if b.max_tokens is None:  # its range: the chat route's check
            raise bad_request("max_tokens is required", "max_tokens")
        chat["max_tokens"] = b.max_tokens
    stops = b.stop_sequences or []
    if stops:
        chat["stop"] = stops
    chat["stream"] = True  # the formatter reads tool calls as they stream, in both modes
    if b.tools:
        chat["tools"] = _tools(b.tools)
    if b.tool_choice is not None:
        _tool_choice(b.tool_choice, chat)
    thinking = b.thinking
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in _THINKING or thinking.get("display") not in (None, "summarized"):
            raise unsupported(
                "thinking",
                "'disabled', 'enabled' (with budget_tokens) or 'adaptive', shown; "
                "without the field, thinking follows the chat template",
            )
        chat["chat_template_kwargs"] = {"enable_thinking": _THINKING[kind]}
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise bad_request(
                    f"thinking.budget_tokens must be an integer >= 1, got {budget!r}", "thinking"
                )
            chat["thinking_budget"] = budget  # </think> forced once it is spent
    output = b.output_config or {}
    if (
        not isinstance(output, dict)
        or output.get("effort") is not None
        or set(output) - {"effort", "format"}
    ):
        raise unsupported("output_config", "only output_config.format (a JSON schema) is supported")
    if output.get("format") is not None:
        schema_format = output["format"]
        if not isinstance(schema_format, dict) or schema_format.get("type") != "json_schema":
            raise bad_request(
                "output_config.format must be {'type': 'json_schema', 'schema': ...}",
                "output_config.format",
            )
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema_format.get("schema")},
        }
    chat = {k: v for k, v in chat.items() if v is not None}
    return MessagesRequest(chat, f"msg_{uuid.uuid4().hex}", bool(b.stream), tuple(stops))


def chat_messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{at} must be an object with role 'user' or 'assistant'", "messages")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(
                f"{at}.content must be a string or an array of content blocks", "messages"
            )
        out += _user(blocks, at) if message["role"] == "user" else [_assistant(blocks, at)]
    return out


def _user(blocks: list[Any], at: str) -> list[dict[str, Any]]:
    """Tool results as tool messages, then the text as one user message."""
    tools, texts, parts = [], [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{at}.content[{j}]", ("text", "image", "tool_result"))
        if kind == "image":
            parts.append(anthropic_image(block, f"{at}.content[{j}]"))
            continue
        if kind == "text":
            texts.append(_string(block, "text", f"{at}.content[{j}]"))
            parts.append({"type": "text", "text": texts[-1]})
            continue
        tool_use_id = _string(block, "tool_use_id", f"{at}.content[{j}]")
        result = block.get("content") or ""
        if not isinstance(result, str):
            result = TEXT_PART_SEPARATOR.join(
                _string(part, "text", f"{at}.content[{j}].content")
                for part in result
                if _kind(part, f"{at}.content[{j}].content", ("text",))
            )
        tools.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
    if len(parts) > len(texts):  # images: the parts, in order, for the template
        return [*tools, {"role": "user", "content": parts}]
    return tools + (
        [{"role": "user", "content": TEXT_PART_SEPARATOR.join(texts)}] if texts or not tools else []
    )


def _assistant(blocks: list[Any], at: str) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    texts, thoughts = [], []
    for j, block in enumerate(blocks):
        where = f"{at}.content[{j}]"
        kind = _kind(block, where, ("text", "thinking", "tool_use"))
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", where))
        else:
            if not isinstance(block.get("input"), dict):
                raise bad_request(f"{where}.input must be an object", "messages")
            arguments = json.dumps(block["input"], ensure_ascii=False)
            call = {
                "id": _string(block, "id", where),
                "type": "function",
                "function": {"name": _string(block, "name", where), "arguments": arguments},
            }
            turn.setdefault("tool_calls", []).append(call)
    if texts:
        turn["content"] = TEXT_PART_SEPARATOR.join(texts)
    if thoughts:
        turn["reasoning"] = TEXT_PART_SEPARATOR.join(thoughts)
    return turn


def _system(value: object) -> list[dict[str, Any]]:
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, list):
        value = TEXT_PART_SEPARATOR.join(
            _string(b, "text", f"system[{i}]")
            for i, b in enumerate(value)
            if _kind(b, f"system[{i}]", ("text",))
        )
    if not isinstance(value, str):
        raise bad_request("system must be a string or an array of text blocks", "system")
    return [{"role": "system", "content": value}]


def _tools(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request("tools must be an array", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            raise unsupported(
                f"tools[{i}].type",
                "only client tools (name, description, input_schema) are supported",
            )
        function = {
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("input_schema"),
        }
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: object, chat: dict[str, Any]) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": value.get("name")}}
    elif kind in _TOOL_CHOICES:
        chat["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise bad_request("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", "tool_choice")
    if value.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _kind(block: object, at: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        raise unsupported(
            _param(at), f"{at}: a {kind!r} block is not supported here (only {', '.join(allowed)})"
        )
    return kind


def _string(block: dict[str, Any], name: str, at: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{at}.{name} must be a string", _param(at))
    return value


def _param(at: str) -> str:
    return "system" if at.startswith("system") else "messages"


__all__ = ["RENAMED", "MessagesRequest", "chat_messages", "parse_messages_request"]
