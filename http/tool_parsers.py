"""Tool calls in chat completions (`--enable-auto-tool-choice --tool-call-parser NAME`): a
choice's content text, read by its format (tool_formats.py), as the calls' names and arguments
and the content before them.

Two entry points, one per response mode, that agree: `parse_tool_calls` reads a whole text;
`ToolCallStream` is fed the text as it arrives and says what to send now: content, then for
each call a first delta with its id and name, then pieces of its arguments. Both drive the
same scanner (tool_formats.py), which decides the same for any split of a text into deltas:
the content the stream sends adds up to the parse's, and each call's argument pieces to its
`arguments` (the ids aside: each call gets a new one, as vLLM's).
`ToolCallReader` applies them to a request's choices for the chat formatter (responses.py),
with vLLM's finish reason and parallel_tool_calls filter.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from deltaserve.http.tool_formats import CallPiece, HermesScanner, Qwen3CoderScanner

# vLLM's names for these parsers (vllm/tool_parsers/__init__.py)
TOOL_CALL_PARSERS: dict[str, type[HermesScanner | Qwen3CoderScanner]] = {
    "hermes": HermesScanner,
    "qwen3_coder": Qwen3CoderScanner,
}


def make_tool_call_id() -> str:
    """As vLLM's `make_tool_call_id` (its default kind)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: `arguments` is its JSON object as text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ParsedOutput(NamedTuple):
    """A whole text: `content` is all of it when there is no call, else the text before the
    first one (maybe "")."""

    content: str
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """What one chunk adds to call `index`: its id and name the first time, then text to
    append to its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        """As OpenAI streams a call: `{index, id, type, function: {name, arguments: ""}}`
        first, then `{index, function: {arguments}}`."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolDelta(NamedTuple):
    """What one text delta adds: content, and the calls' deltas (after the content)."""

    content: str
    tool_calls: tuple[ToolCallDelta, ...]


def parse_tool_calls(parser: str, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedOutput:
    """`text` read in the format of `parser` (a TOOL_CALL_PARSERS name) for the request's
    `tools` (their schemas type qwen3_coder's values)."""
    scanner = TOOL_CALL_PARSERS[parser](tools)
    read, end = scanner.feed(text), scanner.finish()
    deltas = _call_deltas([*read.pieces, *end.pieces])  # one per call: all its pieces
    calls = tuple(ToolCall(d.id or "", d.name or "", d.arguments) for d in deltas)
    return ParsedOutput(read.content + end.content, calls)


class ToolCallStream:
    """One choice's content text as it arrives (`feed`, then `flush` at its end): what its
    scanner decides, as deltas to send. Once a call is sent, no more content is (what
    follows the calls is not content)."""

    def __init__(self, parser: str, tools: Sequence[Mapping[str, Any]]) -> None:
        self._scanner = TOOL_CALL_PARSERS[parser](tools)

    def feed(self, text: str) -> ToolDelta:
        read = self._scanner.feed(text)
        return ToolDelta(read.content, _call_deltas(read.pieces))

    def flush(self, text: str = "") -> ToolDelta:
        """The last text, and the end: what was held back is decided."""
        read, end = self._scanner.feed(text), self._scanner.finish()
        return ToolDelta(read.content + end.content, _call_deltas([*read.pieces, *end.pieces]))


def _call_deltas(pieces: list[CallPiece]) -> tuple[ToolCallDelta, ...]:
    """A delta per call the pieces add to (a call's pieces come together, in call order);
    a call's first carries a new id and its name."""
    calls: list[tuple[CallPiece, list[str]]] = []  # each call's first piece, and all its text
    for piece in pieces:
        if not calls or calls[-1][0].index != piece.index:
            calls.append((piece, []))
        calls[-1][1].append(piece.arguments)
    return tuple(
        ToolCallDelta(first.index, "".join(text))
        if first.name is None
        else ToolCallDelta(first.index, "".join(text), make_tool_call_id(), first.name)
        for first, text in calls
    )


def finish_reason(reason: str, called: bool) -> str:
    """As vLLM's: "tool_calls" when the choice has calls and the model stopped by itself; a
    `length` cut stays "length", so a client tells a call cut short from a whole one."""
    return "tool_calls" if called and reason == "stop" else reason


class ToolCallReader:
    """A chat request's choices read for tool calls (tool_choice "auto"): as they stream
    (`delta`, a ToolCallStream per choice) or whole (`message`). parallel_tool_calls=false
    keeps the first call only, as vLLM's filter does."""

    def __init__(
        self, parser: str, tools: Sequence[Mapping[str, Any]], parallel_tool_calls: bool
    ) -> None:
        self.parser = parser
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls
        self._streams: dict[int, ToolCallStream] = {}  # by choice index
        self._called: set[int] = set()  # choices a call was streamed for

    def delta(self, index: int, content: str, final: bool) -> ToolDelta:
        """Choice `index`'s next content text (`final`: its last): what to send now."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ToolCallStream(self.parser, self.tools)
        read = stream.flush(content) if final else stream.feed(content)
        calls = tuple(d for d in read.tool_calls if self.parallel_tool_calls or d.index == 0)
        if calls:
            self._called.add(index)
        return ToolDelta(read.content, calls)

    def stream_finish_reason(self, index: int, reason: str) -> str:
        return finish_reason(reason, index in self._called)

    def message(
        self, message: dict[str, Any], content: str, reason: str
    ) -> tuple[dict[str, Any], str]:
        """A whole choice: its `message` with the calls read out of its `content` text (the
        content before them, null if none), and its finish reason."""
        parsed = parse_tool_calls(self.parser, content, self.tools)
        calls = parsed.tool_calls if self.parallel_tool_calls else parsed.tool_calls[:1]
        if not calls:
            return message, reason
        message = {
            **message,
            "content": parsed.content or None,
            "tool_calls": [c.to_json() for c in calls],
        }
        return message, finish_reason(reason, True)
