"""A chat completion's output as a row of blocks, for the APIs that present it so (OpenAI's
Responses, Anthropic's Messages): reasoning, text and tool calls, each opened, grown and
closed in order, one open at a time.

The chat formatter does the work (the reasoning split, tool calls read as they stream,
logprobs); `OutputBlocks` reads its chunks as they come, in both modes, so a streamed answer
and a whole one are built the same way. Subclasses say how a block opens, grows and closes
in their API, and what the stream and the whole answer look like.
"""

from __future__ import annotations

from typing import Any

import msgspec

from deltaserve.http.errors import ApiError
from deltaserve.http.responses import ChatFormatter, ChoiceState

_encode = msgspec.json.Encoder().encode
REASONING, TEXT, CALL = "reasoning", "text", "call"


class OutputBlocks:
    """The interface of `_respond`'s formatters (server.py), over a `ChatFormatter`; a
    stream's chunks are lists of events, each with its `type`. `blocks` holds each block
    in its API's shape (the last one open until closed), `kinds` what each is."""

    def __init__(self, chat: ChatFormatter, request_id: str) -> None:
        self.chat = chat
        self.id = request_id
        self.blocks: list[dict[str, Any]] = []
        self.kinds: list[str] = []
        self.reason: str | None = None  # the chat's finish_reason, once finished
        self.stop: str | int | None = None  # and its stop_reason (the stop string or token)
        self._open = False
        self._call_index: int | None = None  # the chat index of the open call
        self._logprobs: list[dict[str, Any]] = []  # entries whose token's text is not placed yet

    # ---- what _respond calls (start, stream_end and response: the subclass's) -------------

    def token(self, index: int, ev: Any, state: ChoiceState) -> list[dict[str, Any]]:
        return self._read(self.chat.token(index, ev, state))

    def prompt(self, index: int, ev: Any, state: ChoiceState) -> None:
        """Never called: these APIs ask for no prompt logprobs."""

    def finish(self, index: int, ev: Any, state: ChoiceState) -> list[dict[str, Any]]:
        chunk = self.chat.finish(index, ev, state)
        self.reason, self.stop = (
            chunk["choices"][0]["finish_reason"],
            chunk["choices"][0].get("stop_reason"),
        )
        events = self._read(chunk)
        if all(kind == REASONING for kind in self.kinds):  # an answer, if an empty one
            events += self._close() + self._begin(TEXT)
        return events + self._close()

    def encode(self, events: list[dict[str, Any]]) -> bytes:
        """Server-sent events named by their type, as both APIs send them."""
        return b"".join(
            b"event: " + e["type"].encode() + b"\ndata: " + _encode(e) + b"\n\n" for e in events
        )

    def stream_error(self, err: ApiError) -> bytes:
        """A failure after the stream began: OpenAI's error body, which the openai client
        raises for any event."""
        return b"data: " + _encode(err.body()) + b"\n\n"

    # ---- the blocks -----------------------------------------------------------------------

    def _read(self, chunk: dict[str, Any] | None) -> list[dict[str, Any]]:
        """A chat chunk's delta: its reasoning, then its content, then its calls."""
        if chunk is None:
            return []
        choice = chunk["choices"][0]
        self._logprobs += (choice.get("logprobs") or {}).get("content") or []
        delta, events = choice["delta"], []
        if delta.get("reasoning"):
            self._logprobs.clear()  # the reasoning's tokens: logprobs are the text's only
            events += self._text(REASONING, delta["reasoning"])
        if delta.get("content"):
            events += self._text(TEXT, delta["content"])
        for call in delta.get("tool_calls") or []:
            if call["index"] != self._call_index:
                events += self._close()
                self._call_index = call["index"]
                events += self._begin(CALL, call_id=call["id"], name=call["function"]["name"])
            piece = call["function"].get("arguments") or ""
            if piece:
                events += self._grow(CALL, piece, [])
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = [] if self._open and self.kinds[-1] == kind else self._close() + self._begin(kind)
        logprobs: list[dict[str, Any]] = []
        if kind == TEXT:
            logprobs, self._logprobs = self._logprobs, []
        return events + self._grow(kind, text, logprobs)

    def _begin(self, kind: str, **call: str) -> list[dict[str, Any]]:
        self.kinds.append(kind)
        self._open = True
        return self._open_block(kind, **call)

    def _close(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open, self._call_index = False, None
        logprobs, self._logprobs = self._logprobs, []  # a text's tokens that added no text
        return self._close_block(self.kinds[-1], logprobs)

    # ---- what a subclass says ---------------------------------------------------------------

    def _open_block(self, kind: str, call_id: str = "", name: str = "") -> list[dict[str, Any]]:
        """Append the new block to `blocks`; its opening events."""
        raise NotImplementedError

    def _grow(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add text (a call's: a piece of its arguments) to the open block; its events."""
        raise NotImplementedError

    def _close_block(self, kind: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The open block's closing events."""
        raise NotImplementedError


__all__ = ["CALL", "REASONING", "TEXT", "OutputBlocks"]
