"""Reasoning output for chat completions (`--reasoning-parser`): the text a model writes between
`<think>` and `</think>` goes to the message's `reasoning` field, the rest to `content`.

As vLLM's parsers of the same names (vllm/reasoning/qwen3_reasoning_parser.py,
deepseek_r1_reasoning_parser.py, basic_parsers.py), with one decision taken differently:
whether the output starts inside an open think block is read from the prompt's token ids (its
last `<think>` has no `</think>` after it), not guessed from the output or from the request's
`enable_thinking`. Qwen3.5's template ends the generation prompt with `<think>\\n` when
thinking is on (the output holds only `</think>`) and with an empty `<think>\\n\\n</think>\\n\\n`
when it is off (the output is all answer); the prompt says which, whatever the switch is named
or wherever its default was set. Where this differs from vLLM:

- qwen3, a prompt with no think tag at all (a template that lets the model open the block
  itself, or one with no thinking): only a `<think>` at the very start of the output opens a
  block, and an output without one is all content. vLLM's qwen3 calls such an output all
  reasoning: its non-streaming path unless the request says `enable_thinking: false`, its
  streaming path unless the prompt's last tag is a `</think>`.
- No text is dropped: vLLM drops whatever precedes the output's first `<think>`; here a
  `<think>` that does not open the output (when it starts outside a block) is content.
- qwen3 (as vLLM's, for Qwen3.5, which may call a tool without closing its thinking): a
  `<tool_call>` in the block followed, past whitespace, by `<function` and a whitespace or
  `=` ends the reasoning there; the call is content, for the tool-call parser. As vLLM's
  stream, the first of that and `</think>` ends the block; vLLM's non-streaming path ends it
  at `</think>` when one follows the call, and looks at the first `<tool_call>` only.

deepseek_r1 starts inside unless the prompt's last tag is a `</think>` (R1 may leave out its
opening tag and write only the closing one), as vLLM's. For both: once the block is closed,
the rest of the output is content as written, later tags included (as vLLM's); `<think>` tags
inside the block are dropped. Tags are matched on the text, so a tag split across text deltas
is held back until the next delta decides, and the streamed parts add up to the parts of the
whole text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from deltaserve.http.errors import unsupported
from deltaserve.http.tool_formats import TOOL_CALL, UnreadText

REASONING_PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names for these parsers
THINK = "<think>"
END_THINK = "</think>"

# vLLM's Qwen3ReasoningParser._RE_FUNCTION_OPEN: what makes a <tool_call> in the block a call
_FUNCTION_OPEN = re.compile(r"<function[\s=]")
_FUNCTION_OPEN_LEN = len("<function") + 1
_SPACES = re.compile(r"\s*")

_Phase = Literal["start", "reasoning", "tool_call", "content"]


class DeltaParts(NamedTuple):
    """What one text delta adds to the message's two fields."""

    reasoning: str
    content: str


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A server's parser: its name and the tags' token ids in the model's tokenizer
    (`<tool_call>`'s, if it has one, to count qwen3's reasoning tokens that end at a call)."""

    name: str
    think_id: int
    end_think_id: int
    tool_call_id: int | None = None

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any) -> ReasoningParser:
        """Raises ValueError for an unknown name or a tokenizer without the tags (as vLLM's
        parsers refuse to be built)."""
        if name not in REASONING_PARSERS:
            names = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {names}, got {name!r}")
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (THINK, END_THINK) if tag not in vocab]
        if missing:
            tags = " or ".join(missing)
            raise ValueError(
                f"--reasoning-parser {name}: the model's tokenizer has no {tags} token"
            )
        return cls(name, vocab[THINK], vocab[END_THINK], vocab.get(TOOL_CALL))

    def starts_in_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the output continues a think block the prompt opened: its last `<think>`
        has no `</think>` after it. A prompt with neither tag: only deepseek_r1 assumes it."""
        backwards = list(reversed(prompt_ids))  # list.index runs in C: no Python loop
        open_from_end = _index(backwards, self.think_id)
        close_from_end = _index(backwards, self.end_think_id)
        if open_from_end is None:
            return close_from_end is None and self.name == "deepseek_r1"
        return close_from_end is None or open_from_end < close_from_end

    def splitter(self, starts_in_reasoning: bool) -> ReasoningSplitter:
        return ReasoningSplitter(
            starts_in_reasoning,
            self.think_id,
            self.end_think_id,
            ends_at_tool_call=self.name == "qwen3",
            tool_call_id=self.tool_call_id,
        )


def check_include_reasoning(
    parser: ReasoningParser | None, include_reasoning: bool, logprobs: bool
) -> None:
    """A chat request's `include_reasoning: false`, refused (400) where it cannot hold: vLLM
    ignores it without a parser, and with logprobs it leaves the logprobs out."""
    if include_reasoning:
        return
    if parser is None:
        raise unsupported(
            "include_reasoning",
            "false needs a server started with "
            "--reasoning-parser (without one, the thinking is content)",
        )
    if logprobs:
        raise unsupported(
            "include_reasoning",
            "false with logprobs: the logprobs would show the reasoning's tokens",
        )


def _index(ids: list[int], value: int) -> int | None:
    try:
        return ids.index(value)
    except ValueError:
        return None


class ReasoningSplitter:
    """One choice's output, split as it arrives. `feed` takes each text delta (and the token it
    came with, for the count), `flush` ends the text; both return the reasoning and content
    text to send now. The tags are never sent. Phases: "start" (outside a block, nothing
    decided: a `<think>` here opens one), "reasoning", "tool_call" (with `ends_at_tool_call`:
    a `<tool_call>` in the block, until what follows says whether it is a call), "content"
    (the rest, as written). The text is read from where the last delta left off, and only a
    cut tag (or a `<tool_call>` and the whitespace after it) is held, so a delta costs its own
    length.

    Invariant: the parts returned by any sequence of feeds, then a flush, add up to those of
    one feed of the whole text, then a flush."""

    def __init__(
        self,
        starts_in_reasoning: bool,
        think_id: int,
        end_think_id: int,
        ends_at_tool_call: bool = False,
        tool_call_id: int | None = None,
    ) -> None:
        self._phase: _Phase = "reasoning" if starts_in_reasoning else "start"
        self._unread = UnreadText()
        self._ends = (END_THINK, THINK, TOOL_CALL) if ends_at_tool_call else (END_THINK, THINK)
        self._opening: list[str] = []  # a <tool_call> in the block, and whitespace after it
        self._tool_calls_read = 0  # <tool_call> tags the text met in the block
        self._token_phase: _Phase = self._phase
        self._think_id = think_id
        self._end_think_id = end_think_id
        self._tool_call_id = tool_call_id
        self._counts_at_tool_call: list[int] = []  # reasoning_tokens at each <tool_call> token
        self.reasoning_tokens = 0  # usage's completion_tokens_details.reasoning_tokens

    def feed(self, text: str, token_id: int | None = None) -> DeltaParts:
        if token_id is not None:
            self._count(token_id)
        unread = self._unread
        if unread.pos == len(unread.text):
            if self._phase == "content":
                return DeltaParts("", text)
            if self._phase == "reasoning" and "<" not in text:  # every tag starts with "<"
                return DeltaParts(text, "")
        unread.add(text)
        reasoning: list[str] = []
        content: list[str] = []
        while unread.pos < len(unread.text):
            if self._phase == "content":
                content.append(unread.take(len(unread.text)))
            elif self._phase == "start":
                if unread.text.startswith(THINK, unread.pos):
                    unread.take(unread.pos + len(THINK))
                    self._phase = "reasoning"
                elif THINK.startswith(unread.text[unread.pos :]):
                    break  # "<thi": the next delta decides
                else:
                    self._phase = "content"
            elif self._phase == "tool_call":
                if not self._read_tool_call(reasoning, content):
                    break
            else:
                at, tag = unread.next(self._ends)
                if tag is None:
                    reasoning.append(unread.rest(self._ends, final=False))
                    break
                reasoning.append(unread.take(at))
                unread.take(at + len(tag))
                if tag == END_THINK:
                    self._phase = "content"
                elif tag == TOOL_CALL:
                    self._phase = "tool_call"
                    self._opening = [TOOL_CALL]
                    self._tool_calls_read += 1
                # a <think> inside the block: dropped
        return DeltaParts("".join(reasoning), "".join(content))

    def flush(self) -> DeltaParts:
        """The end of the output: text held back is not a tag after all (nor a call)."""
        held = "".join(self._opening) + self._unread.take(len(self._unread.text))
        self._opening = []
        if self._phase == "tool_call":
            self._phase = "reasoning"
        return DeltaParts(held, "") if self._phase == "reasoning" else DeltaParts("", held)

    def _read_tool_call(self, reasoning: list[str], content: list[str]) -> bool:
        """After a `<tool_call>` in the block: whitespace, then `<function` and a whitespace or
        `=` make it a call, and the content starts at it; anything else is reasoning. False
        while the text fed so far does not say."""
        unread = self._unread
        self._opening.append(unread.take(_SPACES.match(unread.text, unread.pos).end()))
        head = unread.text[unread.pos : unread.pos + _FUNCTION_OPEN_LEN]
        if _FUNCTION_OPEN.match(head):
            content.extend(self._opening)
            self._phase = "content"
            self._end_tokens_at_tool_call()
        elif len(head) < _FUNCTION_OPEN_LEN and "<function".startswith(head):
            return False
        else:
            reasoning.extend(self._opening)
            self._phase = "reasoning"
        self._opening = []
        return True

    def _count(self, token_id: int) -> None:
        """The reasoning tokens, by the tags' ids (the tags themselves not counted), in the
        phases the text goes through (vLLM counts the tokens inside the block the same way)."""
        if self._token_phase == "start":
            self._token_phase = "reasoning" if token_id == self._think_id else "content"
        elif self._token_phase == "reasoning":
            if token_id == self._end_think_id:
                self._token_phase = "content"
            elif token_id != self._think_id:
                if token_id == self._tool_call_id:
                    self._counts_at_tool_call.append(self.reasoning_tokens)
                self.reasoning_tokens += 1

    def _end_tokens_at_tool_call(self) -> None:
        """The text ended the block at its latest `<tool_call>`: the tokens from that tag's on
        are the call's, not reasoning (the text comes with its token or later, so the count
        holds them already)."""
        called_at = self._tool_calls_read - 1
        if called_at < len(self._counts_at_tool_call):
            self.reasoning_tokens = self._counts_at_tool_call[called_at]
        self._token_phase = "content"
