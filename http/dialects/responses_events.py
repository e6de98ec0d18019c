"""A chat completion's output as the Responses API's: output items, and the stream's events.

Over `OutputBlocks` (output_blocks.py): reasoning becomes a `reasoning` item
(`response.reasoning_text.delta`), text a `message` item with one `output_text` part
(`response.output_text.delta`, with the logprobs of the tokens that added it), each tool call
a `function_call` item (`response.function_call_arguments.delta`). The stream opens with
`response.created` and `response.in_progress` and ends with `response.completed`, or
`response.incomplete` when max_output_tokens cut it (as OpenAI's), every event numbered.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

from deltaserve.http.dialects.output_blocks import CALL, REASONING, OutputBlocks
from deltaserve.http.responses import ChatFormatter, ChoiceState


class ResponsesFormatter(OutputBlocks):
    """`keep` gets the final response object (the store keeps it)."""

    def __init__(
        self, chat: ChatFormatter, skeleton: dict[str, Any], keep: Callable[[dict[str, Any]], None]
    ) -> None:
        super().__init__(chat, skeleton["id"])
        self._skeleton = {**skeleton, "created_at": chat.created, "model": chat.model}
        self._keep = keep
        self._sequence = 0

    def start(self, index: int, state: ChoiceState | None = None) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def stream_end(self, usage_json: dict[str, int], include_usage: bool) -> bytes:
        final = self._final(usage_json)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return self.encode([self._event(kind, response=final)])

    def response(self, states: list[ChoiceState], usage_json: dict[str, int]) -> dict[str, Any]:
        return self._final(usage_json)

    # ---- the items ------------------------------------------------------------------------

    def _open_block(self, kind: str, call_id: str = "", name: str = "") -> list[dict[str, Any]]:
        if kind == CALL:
            return self._add(
                {
                    "id": f"fc_{uuid.uuid4().hex}",
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": call_id,
                    "name": name,
                    "arguments": "",
                }
            )
        if kind == REASONING:
            return self._add(
                {
                    "id": f"rs_{uuid.uuid4().hex}",
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                    "status": "in_progress",
                }
            )
        events = self._add(
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.blocks[-1]["content"].append(part)
        return [
            *events,
            self._event(
                "response.content_part.added",
                **self._at(),
                content_index=0,
                part=copy.deepcopy(part),
            ),
        ]

    def _grow(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        item = self.blocks[-1]
        if kind == CALL:
            item["arguments"] += text
            return [self._event("response.function_call_arguments.delta", **self._at(), delta=text)]
        item["content"][0]["text"] += text
        if kind == REASONING:
            return [
                self._event(
                    "response.reasoning_text.delta", **self._at(), content_index=0, delta=text
                )
            ]
        item["content"][0]["logprobs"] += logprobs
        return [
            self._event(
                "response.output_text.delta",
                **self._at(),
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        ]

    def _close_block(self, kind: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        item = self.blocks[-1]
        item["status"] = "incomplete" if self.reason == "length" else "completed"
        if kind == CALL:
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    **self._at(),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        elif kind == REASONING:
            text = item["content"][0]["text"]
            events = [
                self._event(
                    "response.reasoning_text.done", **self._at(), content_index=0, text=text
                )
            ]
        else:
            part = item["content"][0]
            part["logprobs"] += logprobs
            events = [
                self._event(
                    "response.output_text.done",
                    **self._at(),
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                ),
                self._event(
                    "response.content_part.done",
                    **self._at(),
                    content_index=0,
                    part=copy.deepcopy(part),
                ),
            ]
        return [
            *events,
            self._event(
                "response.output_item.done",
                output_index=len(self.blocks) - 1,
                item=copy.deepcopy(item),
            ),
        ]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(item)
        return [
            self._event(
                "response.output_item.added",
                output_index=len(self.blocks) - 1,
                item=copy.deepcopy(item),
            )
        ]

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.blocks[-1]["id"], "output_index": len(self.blocks) - 1}

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
        final = {
            **self._snapshot(),
            "output": copy.deepcopy(self.blocks),
            "status": "completed",
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": usage["total_tokens"],
            },
        }
        if self.reason == "length":
            final["status"] = "incomplete"
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        self._keep(final)
        return final


__all__ = ["ResponsesFormatter"]
