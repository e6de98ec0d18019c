"""Turn engine events into OpenAI response bodies and SSE chunks.

One formatter per endpoint (completions, chat), each with the same four calls used by the
server for both modes: `start` (chunks before any token), `token` (a chunk for one
TokenEvent), `finish` (a chunk for one FinishedEvent), and `response` (the whole body when not
streaming). A `ChoiceState` per choice accumulates text, logprobs and counts. With
`continuous_usage` (vLLM's stream_options.continuous_usage_stats) every choice chunk carries the
choice's usage so far; a completion's `echo` puts each prompt's text before its choices' output
(and, with logprobs, the prompt tokens' entries before the output's). A `PromptLogprobsEvent`
(vLLM's `prompt_logprobs`) becomes vLLM's list: on each completion choice, on the chat response.
Logprobs name tokens through a request's `TokenStrings` (text, or "token_id:{id}").
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from deltaserve.http.errors import ApiError
from deltaserve.http.reasoning import DeltaParts, ReasoningParser, ReasoningSplitter
from deltaserve.http.tool_parsers import ToolCallReader
from deltaserve.http.tool_protocol import ForcedToolCalls

# vLLM clamps -inf logprobs (tokens of zero probability) to a finite number; JSON has no inf.
MIN_LOGPROB = -9999.0
SSE_DONE = b"data: [DONE]\n\n"

_json_encode = msgspec.json.Encoder().encode


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _json_encode(payload) + b"\n\n"


def clamp_logprob(x: float) -> float:
    return x if x >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN to the floor


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """`cached_tokens` > 0: vLLM's prompt_tokens_details (--enable-prompt-tokens-details)."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level alphabet (bytes_to_unicode), which the Qwen
    tokenizer's vocabulary strings are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    printable += list(range(0xAE, 0xFF + 1))
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_DECODER = _byte_decoder()


class TokenStrings:
    """Text and raw bytes of single tokens, for logprobs; cached per token id. `as_ids` (vLLM's
    return_tokens_as_token_ids): each token's string in logprobs is "token_id:{id}" instead of
    its text, so that clients keep the token's identity, which decoding loses (a token of part
    of a character, two tokens of the same text)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self.as_ids = as_ids
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def rendering(self, as_ids: bool | None) -> TokenStrings:
        """For one request: its return_tokens_as_token_ids where it gives one, else this one's
        (the server's flag), as vLLM's; a copy shares the caches."""
        if as_ids is None or as_ids == self.as_ids:
            return self
        view = copy.copy(self)
        view.as_ids = as_ids
        return view

    def token(self, token_id: int) -> str:
        """A token's string wherever logprobs name one (completions' tokens and top_logprobs
        keys, chat's token fields): the one place the token-id rule applies."""
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def text(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = self._tokenizer.decode([token_id])
            self._text[token_id] = s
        return s

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in _BYTE_DECODER for c in piece):
                b = [_BYTE_DECODER[c] for c in piece]
            else:  # added/special tokens are stored as plain text
                b = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = b
        return b

    def alternative_bytes(self, token_id: int) -> list[int]:
        """A chat alternative's `bytes`: as vLLM's, those of its string ("token_id:N" under
        `as_ids`); the sampled token's stay its own (`bytes`), as vLLM's do."""
        return list(self.token(token_id).encode()) if self.as_ids else self.bytes(token_id)


def prompt_logprobs_json(
    prompt_ids: Sequence[int], ev: Any, strings: TokenStrings
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then for each one {token id:
    {logprob, rank, decoded_token}} of the token itself and its alternatives (ranks 1..k).
    decoded_token is the text even under return_tokens_as_token_ids, as vLLM's (its engine
    decodes it; the key is the id)."""

    def logprob(token_id: int, lp: float, rank: int) -> dict[str, Any]:
        return {"logprob": clamp_logprob(lp), "rank": rank, "decoded_token": strings.text(token_id)}

    out: list[dict[str, Any] | None] = [None]
    for i, token_id in enumerate(prompt_ids[1:]):
        entry = {str(token_id): logprob(token_id, ev.token_logprobs[i], ev.ranks[i])}
        for rank, (alt, lp) in enumerate(ev.top_logprobs[i], 1):
            entry.setdefault(str(alt), logprob(alt, lp, rank))
        out.append(entry)
    return out


@dataclass(slots=True)
class ChoiceState:
    text: list[str] = field(default_factory=list)
    token_offset: int = 0  # completions' logprobs: the token strings' lengths summed, as vLLM's
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, taken from a saved prefix (prefix caching)
    output_tokens: int = 0  # counted by `token`, then the FinishedEvent's
    logprobs: list[Any] = field(default_factory=list)  # per-token entries in endpoint shape
    logprobs_sent: int = 0  # of `logprobs`, streamed so far (completions)
    prompt_ids: Sequence[int] = ()  # as the engine took them
    prompt_logprobs: Any = None  # the choice's PromptLogprobsEvent, when it asked for one
    # a chat's with a reasoning parser (then `text` is its content)
    reasoning: list[str] = field(default_factory=list)

    def add_text(self, delta: str) -> None:
        if delta:
            self.text.append(delta)

    def add_reasoning(self, delta: str) -> None:
        if delta:
            self.reasoning.append(delta)


class _Formatter:
    """What both endpoints' bodies share: id, object kind, created, model, choices."""

    chunk_object = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        strings: TokenStrings,
        logprobs: bool,
        continuous_usage: bool = False,
    ) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.strings = strings
        self.want_logprobs = logprobs
        self.continuous_usage = continuous_usage

    def _stamp(self, chunk: dict[str, Any] | None, state: ChoiceState) -> dict[str, Any] | None:
        """vLLM's continuous usage: a choice chunk carries its prompt's tokens and the choice's
        tokens so far (no details: those are the final usage's)."""
        if chunk is not None and self.continuous_usage:
            chunk["usage"] = usage(state.prompt_tokens, state.output_tokens)
        return chunk

    def _chunk(self, choices: list[dict[str, Any]], kind: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind or self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self, usage_json: dict[str, int]) -> dict[str, Any]:
        body = self._chunk([])
        body["usage"] = usage_json
        return body

    def encode(self, chunk: dict[str, Any]) -> bytes:
        """A chunk of `start`, `token` or `finish` as the stream sends it."""
        return sse(chunk)

    def stream_end(self, usage_json: dict[str, int], include_usage: bool) -> bytes:
        """What a stream ends with: the usage chunk when asked for, then [DONE]."""
        return (sse(self.usage_chunk(usage_json)) if include_usage else b"") + SSE_DONE

    def stream_error(self, err: ApiError) -> bytes:
        """A failure after the stream began: OpenAI's error body as an event (the openai
        client raises it), then [DONE]."""
        return sse(err.body()) + SSE_DONE

    def prompt(self, index: int, ev: Any, state: ChoiceState) -> None:
        """A PromptLogprobsEvent: kept for the response (a stream has no field for it)."""
        state.prompt_logprobs = ev

    def _prompt_logprobs(self, state: ChoiceState) -> list[dict[str, Any] | None]:
        return prompt_logprobs_json(state.prompt_ids, state.prompt_logprobs, self.strings)


class CompletionFormatter(_Formatter):
    """`/v1/completions`: `text_completion` objects; logprobs in the legacy shape
    (tokens, token_logprobs, top_logprobs as token->logprob dicts, text_offset)."""

    chunk_object = "text_completion"
    _echo: dict[int, str] | None = None  # choice index -> prompt text not sent yet
    _echo_logprobs: int | None = None  # echo's alternatives per prompt token (logprobs)

    def echo(self, prompts: Sequence[str], n: int, logprobs: int | None = None) -> None:
        """vLLM's echo: choice p*n+i starts with prompt p's text, sent with its first event;
        with `logprobs`, its logprobs with the prompt tokens' (from its PromptLogprobsEvent)."""
        self._echo = {p * n + i: text for p, text in enumerate(prompts) for i in range(n)}
        self._echo_logprobs = logprobs

    def prompt(self, index: int, ev: Any, state: ChoiceState) -> None:
        """With echo and logprobs, the prompt tokens' entries go first, as vLLM's: each token
        decoded alone, the first with no logprob, the others with up to `logprobs` + 1
        alternatives (the token itself first); offsets count from the prompt's start."""
        super().prompt(index, ev, state)
        k = self._echo_logprobs
        if k is None:
            return
        for i, token_id in enumerate(state.prompt_ids):
            token, lp, top = self.strings.token(token_id), None, None
            if i:
                lp = clamp_logprob(ev.token_logprobs[i - 1])
                alts = [(alt, alt_lp) for alt, alt_lp in ev.top_logprobs[i - 1] if alt != token_id]
                top = self._top([(token_id, ev.token_logprobs[i - 1]), *alts][: k + 1])
            state.logprobs.append((token, lp, top, state.token_offset))
            state.token_offset += len(token)

    def _echoed(self, index: int, text: str) -> str:
        return text if self._echo is None else self._echo.pop(index, "") + text

    def _entry(self, ev: Any, offset: int) -> tuple[str, float, dict[str, float], int]:
        # OpenAI always includes the sampled token among the alternatives.
        top = self._top([*ev.top_logprobs, (ev.token_id, ev.logprob)])
        return self.strings.token(ev.token_id), clamp_logprob(ev.logprob), top, offset

    def _top(self, pairs: list[tuple[int, float]]) -> dict[str, float]:
        """(token id, logprob) pairs as the legacy shape's dict, in order, each string once."""
        top: dict[str, float] = {}
        for tid, lp in pairs:
            top.setdefault(self.strings.token(tid), clamp_logprob(lp))
        return top

    @staticmethod
    def _logprobs_json(entries: list[Any]) -> dict[str, Any]:
        return {
            "tokens": [e[0] for e in entries],
            "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries],
            "text_offset": [e[3] for e in entries],
        }

    def start(self, index: int, state: ChoiceState | None = None) -> dict[str, Any] | None:
        return None

    def token(self, index: int, ev: Any, state: ChoiceState) -> dict[str, Any] | None:
        state.output_tokens += 1
        if (
            self.want_logprobs
        ):  # offsets by tokens, not by the text sent so far (a stop string holds it back)
            entry = self._entry(ev, state.token_offset)
            state.token_offset += len(entry[0])
            state.logprobs.append(entry)
        text = self._echoed(index, ev.text)
        state.add_text(text)
        entries = state.logprobs[state.logprobs_sent :]  # an echoed prompt's go with the first
        state.logprobs_sent = len(state.logprobs)
        if not entries and not text:
            return None  # nothing to send yet (mid-character or withheld for a stop string)
        logprobs = self._logprobs_json(entries) if entries else None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        return self._stamp(self._chunk([choice]), state)

    def finish(self, index: int, ev: Any, state: ChoiceState) -> dict[str, Any]:
        text = self._echoed(index, ev.text)
        state.add_text(text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": ev.reason,
            "stop_reason": ev.stop_reason,
        }
        return self._stamp(self._chunk([choice]), state)

    def response(self, states: list[ChoiceState], usage_json: dict[str, int]) -> dict[str, Any]:
        choices = []
        for i, s in enumerate(states):
            logprobs = self._logprobs_json(s.logprobs) if self.want_logprobs else None
            choice = {
                "index": i,
                "text": "".join(s.text),
                "logprobs": logprobs,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
            }
            if s.prompt_logprobs is not None:  # vLLM's extra, on each choice (its prompt's)
                choice["prompt_logprobs"] = self._prompt_logprobs(s)
            choices.append(choice)
        body = self._chunk(choices)
        body["usage"] = usage_json
        return body


class ChatFormatter(_Formatter):
    """`/v1/chat/completions`: `chat.completion(.chunk)` objects; logprobs in the chat shape
    (content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]).

    With a reasoning parser (reasoning.py), each choice's text goes through its own
    `ReasoningSplitter` (`_parts`), and messages and deltas carry `reasoning` beside `content`
    (vLLM's field names); `include_reasoning=False` leaves the reasoning out.

    With `tool_calls` (tool_choice "auto", or forced), the content part is read for tool calls
    (tool_parsers.py; forced: tool_protocol.py): as it streams when `streaming`, else whole in
    `response`."""

    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        request_id: str,
        model: str,
        strings: TokenStrings,
        logprobs: bool,
        *,
        reasoning: ReasoningParser | None = None,
        prompt_ids: Sequence[int] = (),
        include_reasoning: bool = True,
        tool_calls: ToolCallReader | ForcedToolCalls | None = None,
        streaming: bool = False,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(request_id, model, strings, logprobs, continuous_usage)
        self.tool_calls = tool_calls
        self.streaming = streaming
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning
        self._starts_in_reasoning = bool(reasoning and reasoning.starts_in_reasoning(prompt_ids))
        self._splitters: dict[int, ReasoningSplitter] = {}  # by choice index

    def _parts(self, index: int, text: str, token_id: int | None, final: bool) -> DeltaParts:
        """One event's text as (reasoning, content); all content without a parser."""
        if self.reasoning is None:
            return DeltaParts("", text)
        splitter = self._splitters.get(index)
        if splitter is None:
            splitter = self._splitters[index] = self.reasoning.splitter(self._starts_in_reasoning)
        parts = splitter.feed(text, token_id)
        if final:
            rest = splitter.flush()
            parts = DeltaParts(parts.reasoning + rest.reasoning, parts.content + rest.content)
        return parts

    def _delta(self, parts: DeltaParts) -> dict[str, str]:
        if self.reasoning is None:
            return {"content": parts.content}
        delta = {"reasoning": parts.reasoning} if parts.reasoning and self.include_reasoning else {}
        if parts.content:
            delta["content"] = parts.content
        return delta

    def _delta_with_tools(self, index: int, parts: DeltaParts, final: bool) -> dict[str, Any]:
        """The delta, its content read for tool calls when they stream."""
        if self.tool_calls is None or not self.streaming:
            return self._delta(parts)
        read = self.tool_calls.delta(index, parts.content, final)
        delta: dict[str, Any] = self._delta(DeltaParts(parts.reasoning, read.content))
        if read.tool_calls:
            if not delta.get("content"):
                delta.pop("content", None)
            delta["tool_calls"] = [call.to_json() for call in read.tool_calls]
        return delta

    def _usage(self, usage_json: dict[str, int]) -> dict[str, Any]:
        """As vLLM's with a reasoning parser: the reasoning tokens of all choices."""
        if self.reasoning is None:
            return usage_json
        tokens = sum(s.reasoning_tokens for s in self._splitters.values())
        return {**usage_json, "completion_tokens_details": {"reasoning_tokens": tokens}}

    def usage_chunk(self, usage_json: dict[str, int]) -> dict[str, Any]:
        return super().usage_chunk(self._usage(usage_json))

    def _entry(self, ev: Any) -> dict[str, Any]:
        s = self.strings
        return {
            "token": s.token(ev.token_id),
            "logprob": clamp_logprob(ev.logprob),
            "bytes": s.bytes(ev.token_id),
            "top_logprobs": [
                {
                    "token": s.token(tid),
                    "logprob": clamp_logprob(lp),
                    "bytes": s.alternative_bytes(tid),
                }
                for tid, lp in ev.top_logprobs
            ],
        }

    def start(self, index: int, state: ChoiceState | None = None) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        chunk = self._chunk(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )
        return chunk if state is None else self._stamp(chunk, state)

    def token(self, index: int, ev: Any, state: ChoiceState) -> dict[str, Any] | None:
        state.output_tokens += 1
        entry = self._entry(ev) if self.want_logprobs else None
        parts = self._parts(index, ev.text, ev.token_id, final=False)
        state.add_text(parts.content)
        state.add_reasoning(parts.reasoning)
        delta = self._delta_with_tools(index, parts, final=False)
        if entry is not None:  # one entry per token, its text sent now or later
            state.logprobs.append(entry)
        elif not any(delta.values()):
            return None
        logprobs = {"content": [entry]} if entry is not None else None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return self._stamp(self._chunk([choice]), state)

    def finish(self, index: int, ev: Any, state: ChoiceState) -> dict[str, Any]:
        parts = self._parts(index, ev.text, None, final=True)
        state.add_text(parts.content)
        state.add_reasoning(parts.reasoning)
        delta = {
            key: text
            for key, text in self._delta_with_tools(index, parts, final=True).items()
            if text
        }
        reason = ev.reason
        if self.tool_calls is not None and self.streaming:
            reason = self.tool_calls.stream_finish_reason(index, reason)
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": ev.stop_reason,
        }
        return self._stamp(self._chunk([choice]), state)

    def _message(self, state: ChoiceState) -> dict[str, Any]:
        if self.reasoning is None:
            return {"role": "assistant", "content": "".join(state.text)}
        # as vLLM's: an empty part is null
        reasoning = "".join(state.reasoning) if self.include_reasoning else ""
        content = "".join(state.text)
        return {"role": "assistant", "content": content or None, "reasoning": reasoning or None}

    def response(self, states: list[ChoiceState], usage_json: dict[str, int]) -> dict[str, Any]:
        choices = []
        for i, s in enumerate(states):
            message, reason = self._message(s), s.finish_reason
            if self.tool_calls is not None:  # not streaming: read whole
                message, reason = self.tool_calls.message(message, "".join(s.text), reason)
            logprobs = {"content": s.logprobs} if self.want_logprobs else None
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": s.stop_reason,
                }
            )
        body = self._chunk(choices, "chat.completion")
        body["usage"] = self._usage(usage_json)
        if states and states[0].prompt_logprobs is not None:  # vLLM's extra: one prompt, top-level
            body["prompt_logprobs"] = self._prompt_logprobs(states[0])
        return body
