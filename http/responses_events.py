"""A chat completion's output as the Responses API's: output items, and the stream's events.

The chat formatter does the work (reasoning split, tool calls read as they stream, logprobs);
`ResponsesFormatter` turns each of its chunks into Responses events and keeps the output
items they build, in both modes (so a response and its stream's final one are the same):
reasoning text becomes a `reasoning` item (`response.reasoning_text.delta`), content a
`message` item with one `output_text` part (`response.output_text.delta`), each tool call a
`function_call` item (`response.function_call_arguments.delta`). An item is done when the
next begins or the output ends; the stream opens with `response.created` and
`response.in_progress` and ends with `response.completed`, or `response.incomplete` when
max_output_tokens cut it (as OpenAI's). A token's logprobs go with the message text its
token adds; a reasoning token's are dropped, as OpenAI gives logprobs for output text only.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from deltaserve.http.responses import ChatFormatter, ChoiceState

_encode = msgspec.json.Encoder().encode


class ResponsesFormatter:
    """The interface of `_respond`'s formatters (server.py), over a `ChatFormatter`; a
    stream's chunks are lists of events. `keep` gets the final response object."""

    def __init__(self, chat: ChatFormatter, skeleton: dict[str, Any], keep: Callable[[dict[str, Any]], None]) -> None:
        self.chat = chat
        self.id = skeleton["id"]
        self._skeleton = {**skeleton, "created_at": chat.created, "model": chat.model}
        self._keep = keep
        self._sequence = 0
        self.output: list[dict[str, Any]] = []  # the items, the last one open until `_close`
        self._open = False
        self._call_index: int | None = None  # the chat index of the open function_call item
        self._logprobs: list[dict[str, Any]] = []  # entries whose token's text is not placed yet
        self._reason: str | None = None

    # ---- what _respond calls -------------------------------------------------------------

    def start(self, index: int, state: ChoiceState | None = None) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]  # fmt: skip

    def token(self, index: int, ev: Any, state: ChoiceState) -> list[dict[str, Any]]:
        return self._events(self.chat.token(index, ev, state))

    def prompt(self, index: int, ev: Any, state: ChoiceState) -> None:
        """Never called: a Responses request asks for no prompt logprobs."""

    def finish(self, index: int, ev: Any, state: ChoiceState) -> list[dict[str, Any]]:
        chunk = self.chat.finish(index, ev, state)
        self._reason = chunk["choices"][0]["finish_reason"]
        events = self._events(chunk)
        if not any(item["type"] != "reasoning" for item in self.output):  # an answer, if empty
            events += self._close() + self._open_text("message")
        return events + self._close()

    def encode(self, events: list[dict[str, Any]]) -> bytes:
        return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + _encode(e) + b"\n\n" for e in events)

    def stream_end(self, usage_json: dict[str, int], include_usage: bool) -> bytes:
        final = self._final(usage_json)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return self.encode([self._event(kind, response=final)])

    def response(self, states: list[ChoiceState], usage_json: dict[str, int]) -> dict[str, Any]:
        return self._final(usage_json)

    # ---- the items ------------------------------------------------------------------------

    def _events(self, chunk: dict[str, Any] | None) -> list[dict[str, Any]]:
        """A chat chunk's delta as events: its reasoning, then its content, then its calls."""
        if chunk is None:
            return []
        choice = chunk["choices"][0]
        self._logprobs += (choice.get("logprobs") or {}).get("content") or []
        delta, events = choice["delta"], []
        if delta.get("reasoning"):
            self._logprobs.clear()  # the reasoning's tokens: no logprobs in a Responses output
            events += self._text_delta("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._text_delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            if call["index"] != self._call_index:
                events += self._close()
                self._call_index = call["index"]
                item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                        "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}  # fmt: skip
                events += self._add(item)
            piece = call["function"].get("arguments") or ""
            if piece:
                self.output[-1]["arguments"] += piece
                events.append(self._event("response.function_call_arguments.delta", **self._at(), delta=piece))
        return events

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = [] if self._open and self.output[-1]["type"] == kind else self._close() + self._open_text(kind)
        part = self.output[-1]["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return [*events, self._event("response.reasoning_text.delta", **self._at(), content_index=0, delta=text)]
        logprobs, self._logprobs = self._logprobs, []
        part["logprobs"] += logprobs
        return [*events, self._event("response.output_text.delta", **self._at(), content_index=0, delta=text,
                                     logprobs=logprobs)]  # fmt: skip

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        """A reasoning item with its reasoning_text, or a message with one output_text part."""
        if kind == "reasoning":
            return self._add({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})  # fmt: skip
        events = self._add({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                            "status": "in_progress", "content": []})  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output[-1]["content"].append(part)
        return [*events, self._event("response.content_part.added", **self._at(), content_index=0,
                                     part=copy.deepcopy(part))]  # fmt: skip

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = True
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))]

    def _close(self) -> list[dict[str, Any]]:
        """The open item's done events."""
        if not self._open:
            return []
        self._open, self._call_index = False, None
        item = self.output[-1]
        item["status"] = "incomplete" if self._reason == "length" else "completed"
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **self._at(),
                                      name=item["name"], arguments=item["arguments"]))  # fmt: skip
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._event("response.reasoning_text.done", **self._at(), content_index=0, text=text))
        else:
            part = item["content"][0]
            part["logprobs"] += self._logprobs  # tokens that added no text
            self._logprobs = []
            events += [self._event("response.output_text.done", **self._at(), content_index=0, text=part["text"],
                                   logprobs=part["logprobs"]),
                       self._event("response.content_part.done", **self._at(), content_index=0,
                                   part=copy.deepcopy(part))]  # fmt: skip
        return [*events, self._event("response.output_item.done", output_index=len(self.output) - 1,
                                     item=copy.deepcopy(item))]  # fmt: skip

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self._skeleton)

    def _final(self, usage_json: dict[str, int]) -> dict[str, Any]:
        """The response as it ended (kept when stored): max_output_tokens reached is
        "incomplete"."""
        usage = self.chat.usage_chunk(usage_json)["usage"]
        reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        final = {**self._snapshot(), "output": copy.deepcopy(self.output), "status": "completed", "usage": {
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}}  # fmt: skip
        if self._reason == "length":
            final["status"] = "incomplete"
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        self._keep(final)
        return final


__all__ = ["ResponsesFormatter"]
