"""Stop regexes (SGLang's `stop_regex`): a request ends once its output text holds a match of
any of them, the text kept through the token that completed it (SGLang trims a stop string,
not a regex match).

Each pattern runs as the automaton of `[\\s\\S]*(?:pattern)` over the text's UTF-8 bytes as
they come (engine/regex_automaton.py's dialect, a lazy DFA): linear in the text, where
searching it again with Python's `re` after every token is quadratic, and a pattern that
backtracks badly could stall the engine's loop.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from deltaserve.engine.regex_automaton import START, ByteAutomaton, RegexError

MAX_STOP_REGEXES = 16


@functools.lru_cache(maxsize=256)
def stop_automaton(pattern: str) -> ByteAutomaton:
    """The automaton that accepts wherever the text so far ends a match of `pattern`;
    ValueError naming it where it is not one of the dialect's or matches the empty text."""
    try:
        ByteAutomaton(pattern)  # its errors point into the pattern as given
    except RegexError as e:
        raise ValueError(f"stop_regex {pattern!r}: {e}") from None
    automaton = ByteAutomaton(f"[\\s\\S]*(?:{pattern})")
    if automaton.accepting[START]:
        raise ValueError(f"stop_regex {pattern!r} matches the empty text: it would stop at once")
    return automaton


class StopRegexWatch:
    """Where each stop regex stands on one output's text; `feed` says which first matched."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self._automata = [(p, stop_automaton(p)) for p in patterns]
        self._states = [START] * len(self._automata)

    def feed(self, text: str, counts: bool) -> str | None:
        """Take the next text; the pattern of a match ending in it, where `counts` (past
        min_tokens: as stop strings, a match must end in a later token's text)."""
        data = text.encode()
        for i, (pattern, automaton) in enumerate(self._automata):
            state = self._states[i]
            for b in data:
                state = automaton.row(state)[b]
                if counts and automaton.accepting[state]:
                    return pattern
            self._states[i] = state  # never DEAD: the `[\s\S]*` before the pattern takes any text
        return None


__all__ = ["MAX_STOP_REGEXES", "StopRegexWatch", "stop_automaton"]
