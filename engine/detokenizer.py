"""Incremental detokenization with stop strings.

Token-to-text follows vLLM's incremental detokenizer (`detokenize_incrementally`, prefix and
read offsets), written anew: decode a short window ending at the newest token and the same
window without it; the difference is the new text. While the window's text ends in U+FFFD the
newest bytes may be half a UTF-8 character (byte-level BPE splits characters across tokens),
so nothing is emitted until a later token completes it; a U+FFFD in the middle is a real
invalid sequence and is emitted.

Stop strings are matched on the text (so across token boundaries, as vLLM's
`check_stop_strings`): the stop string and everything after it is never emitted, and at most
len(longest stop) - 1 characters are withheld while a stop string could still be completing.
With `include_stop_str` the text ends after the stop string instead, and nothing is withheld.
As vLLM's detokenizer, stop strings are looked for only once more than `min_tokens` tokens
were added, and only where they end in the text of those later tokens (a stop string that
began earlier still counts). Stop regexes (SGLang's) are watched on the same text by
engine/guided/stop_regex.py (their matchers, compiled by the engine: `stop_regex_templates`); their
match is kept, and one past its bound raises StopRegexError from `add`.

`skip_special_tokens=False` keeps special tokens' text. vLLM's `spaces_between_special_tokens`
needs no counterpart: a fast (Rust) tokenizer's decode puts no space between special tokens,
and Qwen's is one (vLLM's fast detokenizer and transformers' fast decode ignore the flag too).

Unlike vLLM we decode no prompt tokens as left context: Qwen's byte-level BPE needs none (no
SentencePiece space rules, no clean-up), and without it the deltas always add up to exactly
`decode(output_ids)`, even when the prompt ends inside a UTF-8 character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deltaserve.engine.guided.stop_regex import StopRegexWatch, StopTemplate

if TYPE_CHECKING:
    from deltaserve.engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One choice's output text. `add` takes each generated token that contributes text,
    `flush` ends it; both return the text delta to emit now. After a stop string matched,
    `stop_matched` names it and further calls return ""."""

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
        min_tokens: int = 0,
        stop_regex: Sequence[StopTemplate] = (),
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_fn = backend.decode if backend is not None else tokenizer.decode
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._stops = tuple(stop)
        self._include_stop = include_stop_str
        # vLLM's stop_buffer_length: what a stop string still completing could take back
        longest = max((len(s) for s in self._stops), default=1)
        self._hold_chars = 0 if include_stop_str else longest - 1
        self._min_tokens = min_tokens
        self.text = ""  # all output text decoded so far (cut at a stop string)
        self._num_emitted_chars = 0
        self.stop_matched: str | None = None
        self._regexes = StopRegexWatch(stop_regex) if stop_regex else None

    @classmethod
    def for_params(cls, tokenizer: Any, params: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer of one choice with these sampling parameters."""
        return cls(
            tokenizer,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
            params.min_tokens,
            params.stop_regex_templates,
        )

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        if self.stop_matched is not None:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT):
            return ""  # maybe half a character: wait for the next token
        if len(new_text) <= len(prefix_text):
            # No text (a skipped special token, an id past the tokenizer's): the window still
            # ends on a whole character, so restart it after this token. Otherwise a run of
            # them (ignore_eos after <|im_end|>) made every add decode the whole run: O(n^2).
            self._prefix_offset = self._read_offset = len(self._ids)
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._append(new_text[len(prefix_text) :], final=False)

    def flush(self) -> str:
        """End of generation: emit everything still withheld (an unfinished character too)."""
        if self.stop_matched is not None:
            return ""
        delta = ""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._append(delta, final=True)

    def _append(self, delta: str, final: bool) -> str:
        old_len = len(self.text)
        self.text += delta
        if self._stops and delta and len(self._ids) > self._min_tokens:
            # A match must end inside `delta`: earlier text held none (or came from the first
            # min_tokens tokens, where none counts).
            hits = [(self.text.find(s, max(0, old_len - len(s) + 1)), s) for s in self._stops]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, stop = min(hits)
                self.text = self.text[: pos + len(stop)] if self._include_stop else self.text[:pos]
                self.stop_matched = stop
                final = True
        if self._regexes is not None and self.stop_matched is None and delta:
            # the text through the token whose text completed a match stays (SGLang's)
            if (
                pattern := self._regexes.feed(delta, len(self._ids) > self._min_tokens)
            ) is not None:
                self.stop_matched = pattern
                final = True
        end = len(self.text) if final else len(self.text) - self._hold_chars
        if end <= self._num_emitted_chars:
            return ""
        out = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return out
