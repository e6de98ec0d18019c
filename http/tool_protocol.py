"""The tool-calling fields of a chat request, checked as vLLM checks them
(vllm/entrypoints/openai/chat_completion/protocol.py `check_tool_usage`,
vllm/entrypoints/chat_utils.py `_postprocess_messages`): `tools`, `tool_choice`,
`parallel_tool_calls`, and the history a client sends back (an assistant's `tool_calls`, a
`role: "tool"` message's `tool_call_id`). Pure, as protocol.py: a value in, the template's
view of it out, or an `ApiError` naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from deltaserve.http.errors import bad_request, unsupported

# What a message of each role may carry beyond role, content and name.
TOOL_MESSAGE_KEYS: dict[str, tuple[str, ...]] = {
    "assistant": ("tool_calls",),
    "tool": ("tool_call_id",),
}
_GUIDED = "needs guided decoding, which deltaserve does not have; use 'auto' or 'none'"


class ToolFields(NamedTuple):
    """`tools`: each as the template sees it in vLLM (its request model's dump: `description`
    and `parameters` null when left out), None when the request has none. `tool_choice` is
    "auto" when tools are given without one (as OpenAI and vLLM default it)."""

    tools: tuple[dict[str, Any], ...] | None
    tool_choice: Literal["none", "auto"]
    parallel_tool_calls: bool


def parse_tool_fields(obj: dict[str, Any]) -> ToolFields:
    tools = _tools(obj.get("tools"))
    choice = obj.get("tool_choice")
    if choice is None:  # null is the default, as OpenAI's (vLLM takes an explicit null as "none")
        choice = "auto" if tools else "none"
    if choice == "required" or isinstance(choice, dict):
        raise unsupported("tool_choice", f"tool_choice {json.dumps(choice)} {_GUIDED}")
    if choice not in ("none", "auto"):
        raise bad_request(f"Invalid value for `tool_choice`: {choice!r}! Only named tools, "
                          '"none", "auto" or "required" are supported.', "tool_choice")  # fmt: skip
    if choice == "auto" and tools is None:  # vLLM's words
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(
            f"parallel_tool_calls must be a boolean, got {_kind(parallel)}", "parallel_tool_calls"
        )
    return ToolFields(tools, choice, parallel is not False)


def _tools(tools: object) -> tuple[dict[str, Any], ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"tools must be an array, got {_kind(tools)}", "tools")
    if not tools:  # vLLM's words (OpenAI refuses it too)
        raise bad_request("`tools` must not be an empty array. Either provide at least one tool "
                          "or omit the field entirely.", "tools")  # fmt: skip
    return tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))


def _tool(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object, got {_kind(tool)}", "tools")
    for key in tool:
        if key not in ("type", "function"):
            raise unsupported(f"{where}.{key}", "a tool carries only type and function")
    if tool.get("type", "function") != "function":
        raise unsupported(
            f"{where}.type", f"only function tools are supported, got {tool['type']!r}"
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object, got {_kind(function)}", "tools")
    name, description, parameters = (function.get(k) for k in ("name", "description", "parameters"))
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name must be a non-empty string", "tools")
    if description is not None and not isinstance(description, str):
        raise bad_request(
            f"{where}.function.description must be a string, got {_kind(description)}", "tools"
        )
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON Schema object, got "
                          f"{_kind(parameters)}", "tools")  # fmt: skip
    out = {"name": name, "description": description, "parameters": parameters}
    for key, value in function.items():
        if key in out:
            continue
        if key != "strict":
            raise unsupported(
                f"{where}.function.{key}",
                "a function carries only name, description, parameters and strict",
            )
        if value is True:
            raise unsupported(
                f"{where}.function.strict", f"strict=true (arguments held to the schema) {_GUIDED}"
            )
        if value is not None and value is not False:
            raise bad_request(
                f"{where}.function.strict must be a boolean, got {_kind(value)}", "tools"
            )
        out[key] = value  # the template sees it, as vLLM passes it
    return {"type": "function", "function": out}


def tool_message_fields(message: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """What the template gets of a history message's tool fields: an assistant's calls with
    each `arguments` JSON text as an object (vLLM's `_postprocess_messages`: tool-use
    templates iterate it), a tool message's `tool_call_id`. Null or [] calls are left out."""
    if role == "tool" and message.get("tool_call_id") is not None:
        call_id = message["tool_call_id"]
        if not isinstance(call_id, str):
            raise bad_request(
                f"{where}.tool_call_id must be a string, got {_kind(call_id)}", "messages"
            )
        return {"tool_call_id": call_id}
    calls = message.get("tool_calls")
    if role != "assistant" or calls in (None, []):
        return {}
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be an array, got {_kind(calls)}", "messages")
    return {
        "tool_calls": [
            _history_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)
        ]
    }


def _history_call(call: object, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise bad_request(f"{where} must be an object, got {_kind(call)}", "messages")
    for key in call:
        if key not in ("id", "type", "function"):
            raise unsupported(f"{where}.{key}", "a tool call carries only id, type and function")
    if not isinstance(call.get("id"), str):
        raise bad_request(f"{where}.id must be a string, got {_kind(call.get('id'))}", "messages")
    if call.get("type", "function") != "function":
        raise unsupported(
            f"{where}.type", f"only function calls are supported, got {call['type']!r}"
        )
    function = call.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object, got {_kind(function)}", "messages")
    for key in function:
        if key not in ("name", "arguments"):
            raise unsupported(
                f"{where}.function.{key}", "a call's function carries only name and arguments"
            )
    if not isinstance(function.get("name"), str):
        raise bad_request(f"{where}.function.name must be a string", "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            raise bad_request(
                f"{where}.function.arguments is not valid JSON: {exc}", "messages"
            ) from None
    elif not arguments:  # null or "": no arguments, as vLLM reads them
        arguments = {}
    if not isinstance(arguments, dict):
        raise bad_request(
            f"{where}.function.arguments must be a JSON object, got {_kind(arguments)}", "messages"
        )
    return {**call, "function": {**function, "arguments": arguments}}


def _kind(value: object) -> str:
    """A value's JSON type, for messages."""
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string",
             list: "array", dict: "object"}  # fmt: skip
    return names.get(type(value), type(value).__name__)
