"""A chat completion's output as Anthropic's Messages API gives it: content blocks, and the
stream's events.

Over `OutputBlocks` (output_blocks.py): reasoning becomes a `thinking` block, text a `text`
block, each tool call a `tool_use` block (its arguments streamed as `input_json_delta`
pieces, parsed into `input` whole). The stream is `message_start`, then per block
`content_block_start`, its `content_block_delta`s and `content_block_stop`, then
`message_delta` (stop_reason, output tokens) and `message_stop`. Stop reasons: a stop
sequence that matched is "stop_sequence" (naming it), an answer of tool calls "tool_use",
max_tokens "max_tokens", else "end_turn".
"""

from __future__ import annotations

import json
from typing import Any

from deltaserve.http.dialects.output_blocks import CALL, REASONING, OutputBlocks
from deltaserve.http.errors import ApiError
from deltaserve.http.responses import ChatFormatter, ChoiceState

_DELTAS = {REASONING: ("thinking_delta", "thinking"), CALL: ("input_json_delta", "partial_json")}


class MessagesFormatter(OutputBlocks):
    def __init__(
        self, chat: ChatFormatter, message_id: str, stop_sequences: tuple[str, ...]
    ) -> None:
        super().__init__(chat, message_id)
        self._stop_sequences = stop_sequences
        self._arguments = ""  # the open tool_use block's input, as JSON text so far
        self._prompt_tokens = 0

    def start(self, index: int, state: ChoiceState | None = None) -> list[dict[str, Any]]:
        self._prompt_tokens = state.prompt_tokens if state is not None else 0
        message = self._message([], {"input_tokens": self._prompt_tokens, "output_tokens": 0})
        return [{"type": "message_start", "message": message}]

    def stream_end(self, usage_json: dict[str, int], include_usage: bool) -> bytes:
        final = self.response([], usage_json)
        delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
        return self.encode(
            [
                {"type": "message_delta", "delta": delta, "usage": final["usage"]},
                {"type": "message_stop"},
            ]
        )

    def response(self, states: list[ChoiceState], usage_json: dict[str, int]) -> dict[str, Any]:
        usage = {
            "input_tokens": usage_json["prompt_tokens"],
            "output_tokens": usage_json["completion_tokens"],
        }
        cached = (usage_json.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            usage["cache_read_input_tokens"] = cached
        return self._message(self.blocks, usage)

    def stream_error(self, err: ApiError) -> bytes:
        """Anthropic's error event, which the SDK raises."""
        return self.encode([{"type": "error", "error": {"type": err.type, "message": err.message}}])

    def _message(self, content: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        stop = self.stop
        sequence = stop if isinstance(stop, str) and stop in self._stop_sequences else None
        reason = {"length": "max_tokens", "tool_calls": "tool_use"}.get(
            self.reason or "", "end_turn"
        )
        if self.reason is None:
            reason = None
        elif sequence is not None:
            reason = "stop_sequence"
        elif (
            reason == "end_turn" and CALL in self.kinds
        ):  # a named tool's call ends as the engine's "stop"
            reason = "tool_use"
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.chat.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    # ---- the blocks -----------------------------------------------------------------------

    def _open_block(self, kind: str, call_id: str = "", name: str = "") -> list[dict[str, Any]]:
        if kind == CALL:
            block: dict[str, Any] = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
            self._arguments = ""
        elif kind == REASONING:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        self.blocks.append(block)
        return [
            {
                "type": "content_block_start",
                "index": len(self.blocks) - 1,
                "content_block": dict(block),
            }
        ]

    def _grow(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        delta_type, field = _DELTAS.get(kind, ("text_delta", "text"))
        if kind == CALL:
            self._arguments += text
        else:
            self.blocks[-1][field] += text
        return [
            {
                "type": "content_block_delta",
                "index": len(self.blocks) - 1,
                "delta": {"type": delta_type, field: text},
            }
        ]

    def _close_block(self, kind: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if kind == CALL:
            try:
                parsed = json.loads(self._arguments or "{}")
            except ValueError:  # a parser's call cut by max_tokens: the arguments as far as written
                parsed = {}
            self.blocks[-1]["input"] = parsed if isinstance(parsed, dict) else {"value": parsed}
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


__all__ = ["MessagesFormatter"]
