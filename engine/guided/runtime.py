"""llguidance as this server runs it: the parser limits, its errors in one line, and the
tokenizer of the 256 bytes that stop regexes (stop_regex.py) and tests feed text through."""

from __future__ import annotations

import functools
import re

from llguidance import LLParserLimits, LLTokenizer, TokenizerWrapper

_ECHO = re.compile(r"^\s*(\d+ \||\^)")  # llguidance's echo of the grammar around an error


def error_summary(message: str) -> str:
    """llguidance's error without its echo of the grammar and parser state: one line."""
    message = message.split("\n<state>", 1)[0].split("\n<grammar>", 1)[0]
    message = message.replace("<non-verbose/>", "")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    kept = [line for line in lines if not _ECHO.match(line)]
    return " ".join(kept)[:800]


def parser_limits(max_lexer_states: int) -> LLParserLimits:
    """llguidance's limits: ours on lexer states, its defaults on the rest (fuel per step,
    Earley items, grammar size), no parser state in error messages."""
    return LLParserLimits(max_lexer_states=max_lexer_states, verbose_errors=False)


@functools.cache
def byte_tokenizer() -> LLTokenizer:
    """A tokenizer of the 256 bytes (and an end token, 256): matchers fed a text's bytes, for
    stop regexes (stop_regex.py) and for checking a grammar's language in tests."""
    return LLTokenizer(TokenizerWrapper(_Bytes()), slices=[])


class _Bytes:
    """llguidance's TokenizerWrapper's view of a byte tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


__all__ = ["byte_tokenizer", "error_summary", "parser_limits"]
