"""The tool-calling fields of a chat request, checked as vLLM checks them
(vllm/entrypoints/openai/chat_completion/protocol.py `check_tool_usage`,
vllm/entrypoints/chat_utils.py `_postprocess_messages`): `tools`, `tool_choice`,
`parallel_tool_calls`, and the history a client sends back (an assistant's `tool_calls`).
Pure, as protocol.py: the values its typed body decoded in, the template's view of them out,
or an `ApiError` naming the field (in vLLM's words where vLLM has them).

tool_choice "required" and a named function force calls, as vLLM forces them
(vllm/tool_parsers/utils.py `get_json_schema_from_tools`, and the chat serving layer's reading
of the output): the output is guided to a JSON Schema (`forced_tool_schema`), then read back as
the calls (`ForcedToolCalls`), with no tool-call parser: "required" writes a JSON array of
`{"name", "parameters"}` objects, a named function its arguments alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from deltaserve.http.errors import bad_request, unsupported
from deltaserve.http.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolCallReader,
    ToolDelta,
    finish_reason,
    make_tool_call_id,
)

# vLLM's words for a named tool_choice it cannot read
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
# A function's parameters when it gives none, as vLLM's "required" schema takes them
_NO_PARAMETERS = {"type": "object", "properties": {}}


class NamedTool(NamedTuple):
    """tool_choice `{"type": "function", "function": {"name": ...}}`: that function is called."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedTool


class ToolFields(NamedTuple):
    """`tools`: each as the template sees it in vLLM (its request model's dump: `description`
    and `parameters` null when left out), None when the request has none. `tool_choice` is
    "auto" when tools are given without one (as OpenAI and vLLM default it)."""

    tools: tuple[dict[str, Any], ...] | None
    tool_choice: ToolChoice
    parallel_tool_calls: bool


def parse_tool_fields(tools: object, choice: object, parallel: bool | None) -> ToolFields:
    """A chat's `tools`, `tool_choice` and `parallel_tool_calls` (a boolean, decoded)."""
    tools = _tools(tools)
    if choice is None:  # null is the default, as OpenAI's (vLLM takes an explicit null as "none")
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        choice = _named_tool(choice, tools)
    elif choice not in ("none", "auto", "required"):
        raise bad_request(
            f"Invalid value for `tool_choice`: {choice!r}! Only named tools, "
            '"none", "auto" or "required" are supported.',
            "tool_choice",
        )
    elif choice != "none" and tools is None:  # vLLM's words
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":  # the parser reads free text: nothing holds the arguments to a schema
        for i, tool in enumerate(tools or ()):
            if tool["function"].get("strict"):
                raise unsupported(
                    f"tools[{i}].function.strict",
                    "strict=true (arguments held to the "
                    "schema) needs tool_choice 'required' or a named function, not 'auto'",
                )
    return ToolFields(tools, choice, parallel is not False)


def _named_tool(choice: dict[str, Any], tools: tuple[dict[str, Any], ...] | None) -> NamedTool:
    """A named tool_choice, checked as vLLM's `check_tool_usage` (its words)."""
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    for key in choice:
        if key not in ("type", "function"):
            raise unsupported(
                f"tool_choice.{key}", "a named tool choice carries only type and function"
            )
    if choice.get("type", "function") != "function":
        raise unsupported(
            "tool_choice.type", f"only function tools are supported, got {choice['type']!r}"
        )
    function = choice.get("function")
    if not isinstance(function, dict):
        raise bad_request(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice",
        )
    for key in function:
        if key != "name":
            raise unsupported(
                f"tool_choice.function.{key}", "a named tool choice's function carries only name"
            )
    if "name" not in function:
        raise bad_request(
            f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}", "tool_choice"
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice",
        )
    if all(tool["function"]["name"] != name for tool in tools):
        raise bad_request(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return NamedTool(name)


def _tools(tools: object) -> tuple[dict[str, Any], ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"tools must be an array, got {_kind(tools)}", "tools")
    if not tools:  # vLLM's words (OpenAI refuses it too)
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool "
            "or omit the field entirely.",
            "tools",
        )
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
        raise bad_request(
            f"{where}.function.parameters must be a JSON Schema object, got {_kind(parameters)}",
            "tools",
        )
    out = {"name": name, "description": description, "parameters": parameters}
    for key, value in function.items():
        if key in out:
            continue
        if key != "strict":
            raise unsupported(
                f"{where}.function.{key}",
                "a function carries only name, description, parameters and strict",
            )
        if value is not None and not isinstance(value, bool):
            raise bad_request(
                f"{where}.function.strict must be a boolean, got {_kind(value)}", "tools"
            )
        out[key] = value  # the template sees it, as vLLM passes it
    return {"type": "function", "function": out}


def history_tool_calls(calls: list[Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's calls as the template gets them: each `arguments` JSON text as an
    object (vLLM's `_postprocess_messages`: tool-use templates iterate it)."""
    return [_history_call(call, f"{where}[{j}]") for j, call in enumerate(calls)]


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
    names = {
        type(None): "null",
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }
    return names.get(type(value), type(value).__name__)


# ---- forced calls ----------------------------------------------------------------------


def forced_tool_schema(fields: ToolFields) -> dict[str, Any] | None:
    """The JSON Schema a forced tool_choice guides the output to; None for "none" and "auto".
    "required": an array of calls, each `{"name": one of the tools, "parameters": that tool's
    schema}` (name first: `_CallArray` reads it so), at least one, at most one with
    parallel_tool_calls=false (vLLM keeps the first of several; here no others are written).
    The tools' `$defs` (and older `definitions`) move to the top, where their `#/$defs/...`
    references point, as vLLM's `_get_tool_schema_defs` moves `$defs`. A named function: its
    parameters schema."""
    choice, tools = fields.tool_choice, fields.tools or ()
    if isinstance(choice, NamedTool):
        return next(_parameters(t) for t in tools if t["function"]["name"] == choice.name)
    if choice != "required":
        return None
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": []}}
    if not fields.parallel_tool_calls:
        schema["maxItems"] = 1
    for tool in tools:
        parameters = dict(_parameters(tool))
        for key in ("$defs", "definitions"):
            for name, definition in (
                parameters.pop(key) if isinstance(parameters.get(key), dict) else {}
            ).items():
                if (
                    schema.setdefault(key, {}).setdefault(name, definition) != definition
                ):  # vLLM's words
                    raise bad_request(
                        f"Tool definition '{name}' has multiple schemas, which is not supported.",
                        "tools",
                    )
        schema["items"]["anyOf"].append(
            {
                "type": "object",
                "required": ["name", "parameters"],
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": parameters,
                },
            }
        )
    return schema


def tool_call_reader(
    choice: ToolChoice,
    tools: Sequence[Mapping[str, Any]] | None,
    parallel_tool_calls: bool,
    parser: str | None,
) -> ToolCallReader | ForcedToolCalls | None:
    """How a chat's output is read for calls: as a forced choice's guided JSON, or (tool_choice
    "auto") in the format of `parser`, the server's --tool-call-parser when it has
    --enable-auto-tool-choice (else "auto" is refused, in vLLM's words); None: not at all."""
    if choice == "required" or isinstance(choice, NamedTool):
        return ForcedToolCalls(choice)
    if choice != "auto":
        return None
    if parser is None or not tools:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
            "set",
            "tool_choice",
        )
    return ToolCallReader(parser, tools, parallel_tool_calls)


def _parameters(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    return tool["function"]["parameters"] or _NO_PARAMETERS


class ForcedToolCalls:
    """A forced tool_choice's choices read as calls, for the chat formatter (ToolCallReader's
    interface). Named: the whole output is the function's arguments; streamed, its first text
    goes with the call's id and name, the rest as argument pieces. "required": the JSON array,
    read as it arrives (`_CallArray`): a call goes out once its name is whole, then its
    arguments as they come: the text of its "parameters" value as written, in the whole message
    too, so that the pieces add up to it (vLLM's message re-serialises them). content is ""
    (vLLM's); the finish reason "tool_calls" for "required" ended by its grammar, the engine's
    for a named function (as OpenAI and vLLM); a `length` cut stays "length"."""

    def __init__(self, choice: Literal["required"] | NamedTool) -> None:
        self.choice = choice
        self._readers: dict[int, _Arguments | _CallArray] = {}  # by choice index
        self._sent: dict[int, list[int]] = {}  # by choice index: each call's argument text sent

    def _reader(self) -> _Arguments | _CallArray:
        return _Arguments(self.choice.name) if isinstance(self.choice, NamedTool) else _CallArray()

    def delta(self, index: int, content: str, final: bool) -> ToolDelta:
        """Choice `index`'s next content text (`final`: its last): the call pieces to send."""
        if index not in self._readers:
            self._readers[index], self._sent[index] = self._reader(), []
        reader, sent = self._readers[index], self._sent[index]
        reader.feed(content)
        deltas = []
        for i, (name, args) in enumerate(reader.calls):
            if name is None:  # a call's name comes first: only the last one can lack it yet
                break
            if i == len(sent):
                deltas.append(ToolCallDelta(i, args, make_tool_call_id(), name))
                sent.append(len(args))
            elif len(args) > sent[i]:
                deltas.append(ToolCallDelta(i, args[sent[i] :]))
                sent[i] = len(args)
        return ToolDelta("", tuple(deltas))

    def stream_finish_reason(self, index: int, reason: str) -> str:
        return self._reason(reason)

    def message(
        self, message: dict[str, Any], content: str, reason: str
    ) -> tuple[dict[str, Any], str]:
        """A whole choice: `message` with the calls its `content` holds."""
        reader = self._reader()
        reader.feed(content)
        calls = [
            ToolCall(make_tool_call_id(), name, args).to_json()
            for name, args in reader.calls
            if name is not None
        ]
        return {**message, "content": "", "tool_calls": calls}, self._reason(reason)

    def _reason(self, reason: str) -> str:
        return reason if isinstance(self.choice, NamedTool) else finish_reason(reason, True)


class _Arguments:
    """A named function's output: all of it is the one call's arguments."""

    def __init__(self, name: str) -> None:
        self.calls: list[list[Any]] = [[name, ""]]

    def feed(self, text: str) -> None:
        self.calls[0][1] += text


_BLANK = " \t\n\r"


class _CallArray:
    """tool_choice "required"'s output as it arrives: the JSON array of `{"name": ...,
    "parameters": ...}` objects that `forced_tool_schema` guides it to. `calls`: each call's
    name (None until its string is whole) and the text of its parameters value so far, as
    written. A character-level reader of what that grammar writes (valid JSON, cut anywhere
    by max_tokens), not a general JSON parser."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self._depth = 0  # brackets open around the reader, outside the member values
        self._member = ""  # the key of the call's member being read
        self._expect = "key"  # inside a call: "key", "colon", "value" or "next"
        self._reading: str | None = None  # "key" or "value" while one is read
        self._text: list[str] = []  # the key's or value's text read (of this feed, for parameters)
        self._nest = 0  # the value's own brackets open
        self._string = self._escaped = False  # inside a string of the key or value

    def feed(self, text: str) -> None:
        for char in text:
            if self._reading is None or not self._take(char):
                self._structure(char)
        self._flush()

    def _take(self, char: str) -> bool:
        """A character of the key or value being read: False when it ends a number or literal
        (it is then read as structure)."""
        if self._string:
            self._text.append(char)
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._string = False
                if self._nest == 0:
                    self._end()
            return True
        if self._reading == "value" and self._nest == 0 and (char in _BLANK or char in ",}]"):
            self._end()
            return False
        self._text.append(char)
        if char == '"':
            self._string = True
        elif char in "{[":
            self._nest += 1
        elif char in "}]":
            self._nest -= 1
            if self._nest == 0:
                self._end()
        return True

    def _structure(self, char: str) -> None:
        if char in _BLANK:
            return
        if self._depth == 2 and (
            self._expect == "value" or (self._expect == "key" and char == '"')
        ):
            self._reading, self._text, self._nest = self._expect, [], 0
            self._take(char)
        elif char == ":":
            self._expect = "value"
        elif char == ",":
            self._expect = "key"
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:
                self.calls.append([None, ""])
                self._expect = "key"
        elif char in "]}":
            self._depth -= 1

    def _end(self) -> None:
        """The key or value read is whole."""
        text = "".join(self._text)
        if self._reading == "key":
            self._member, self._expect = json.loads(text), "colon"
        else:
            self._flush()
            if self._member == "name":
                self.calls[-1][0] = json.loads(text)
            self._expect = "next"
        self._reading, self._text = None, []

    def _flush(self) -> None:
        """The parameters text read so far goes to its call."""
        if self._reading == "value" and self._member == "parameters" and self._text:
            self.calls[-1][1] += "".join(self._text)
            self._text = []
