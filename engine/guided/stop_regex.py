"""Stop regexes (SGLang's `stop_regex`): a request ends once its output text holds a match of
any of them, the text kept through the token that completed it (SGLang trims a stop string,
not a regex match).

Each pattern runs as llguidance's matcher of `(?s:.*)(?:pattern)` over the text's UTF-8
bytes as they come (runtime.py's byte tokenizer): the same regex dialect as
guided_regex, in linear time (a lazily built DFA, its states bounded by max_lexer_states),
where searching the text again after every token is quadratic. The compile worker checks
each pattern first (engine/grammar_worker.py); engine/guides.py keeps one matcher per
pattern, which each request's watch copies (the copies share its DFA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llguidance import LLMatcher

from deltaserve.engine.guided.runtime import byte_tokenizer, error_summary, parser_limits


class StopRegexError(ValueError):
    """A stop regex's matcher hit a bound while reading the output (its lexer's states)."""


@dataclass(eq=False, slots=True)
class StopTemplate:
    """A stop regex's matcher, which requests copy (engine/guides.py keeps one per pattern).
    `spent`: a copy hit the lexer's bound in the states they share; the next request gets a
    fresh one."""

    pattern: str
    matcher: LLMatcher
    spent: bool = False


def stop_regex_grammar(pattern: str) -> str:
    """The grammar whose matcher accepts wherever the text so far ends a match of `pattern`;
    ValueError pointing into the pattern as given where it is not a regex."""
    if error := LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(pattern)):
        raise ValueError(error_summary(error))
    return LLMatcher.grammar_from_regex(f"(?s:.*)(?:{pattern})")


def stop_template(pattern: str, max_lexer_states: int) -> StopTemplate:
    """A pattern's matcher for requests to copy (its grammar checked by the worker first: here
    a ValueError only for a pattern that is no regex)."""
    limits = parser_limits(max_lexer_states)
    return StopTemplate(
        pattern, LLMatcher(byte_tokenizer(), stop_regex_grammar(pattern), limits=limits)
    )


class StopRegexWatch:
    """Where each stop regex stands on one output's text; `feed` says which first matched."""

    def __init__(self, templates: Sequence[StopTemplate]) -> None:
        self._matchers = [(t, t.matcher.deep_copy()) for t in templates]

    def feed(self, text: str, counts: bool) -> str | None:
        """Take the next text; the pattern of a match ending in it, where `counts` (past
        min_tokens: as stop strings, a match must end in a later token's text). Raises
        StopRegexError where a matcher went past a bound."""
        data = text.encode()
        for template, matcher in self._matchers:
            for b in data:
                if not matcher.consume_token(b):  # `(?s:.*)` takes any text: only a bound
                    template.spent = True
                    raise StopRegexError(
                        f"stop_regex {template.pattern!r} went past its bound: "
                        f"{error_summary(matcher.get_error())}"
                    )
                if counts and matcher.is_accepting():
                    return template.pattern
        return None


__all__ = [
    "StopRegexError",
    "StopRegexWatch",
    "StopTemplate",
    "stop_regex_grammar",
    "stop_template",
]
