"""What the structured-output tests share: a grammar's language judged by llguidance itself
(its matcher fed a text's bytes, engine/guided/runtime.py's byte tokenizer), so a test says
which texts a constraint allows without a model.

Imported as `guide_helpers` (pytest puts tests/ on sys.path; tests/ has no __init__.py).
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from deltaserve.engine.guided.grammar import constraint_grammar
from deltaserve.engine.guided.runtime import byte_tokenizer, error_summary


def accepts(grammar: str, text: str) -> bool:
    """Whether `text` is a whole output the grammar allows."""
    matcher = LLMatcher(byte_tokenizer(), grammar, log_level=0)
    assert not matcher.is_error(), error_summary(matcher.get_error())
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def assert_language(grammar: str, yes: list[str], no: list[str]) -> None:
    """`yes` are whole outputs of the grammar, `no` are not."""
    for text in yes:
        assert accepts(grammar, text), text
    for text in no:
        assert not accepts(grammar, text), text


def prefix_ok(grammar: str, text: str) -> bool:
    """Whether `text` can still become an output the grammar allows."""
    matcher = LLMatcher(byte_tokenizer(), grammar, log_level=0)
    return all(matcher.consume_token(b) for b in text.encode())


def schema_grammar(schema: Any, whitespace: str | None = None) -> str:
    return constraint_grammar("json", json.dumps(schema), whitespace)


def compile_error(kind: str, text: str) -> str:
    """The error compiling a constraint gives, "" where it compiles (as the worker checks it:
    the grammar built)."""
    try:
        grammar = constraint_grammar(kind, text, None)
    except ValueError as exc:
        return str(exc)
    return error_summary(LLMatcher.validate_grammar(grammar))
