"""A request's structured-output constraint as the one pattern the rank guides it by.

vLLM's StructuredOutputsParams takes one of choice, regex, json (a schema), json_object,
grammar and structural_tag. Each becomes a regex in engine/regex_automaton.py's dialect: a
choice its escaped alternatives, a schema what engine/json_schema.py makes of it, a grammar
what engine/grammar.py does, a structural tag what engine/structural_tag.py does. The pattern is compiled here once, so that what the rank
compiles again can never fail there (a rank's error is fatal to the engine); patterns are
cached, since SamplingParams are rebuilt (`replace`) per choice and a schema is usually sent
many times.
"""

from __future__ import annotations

import functools
import json

from deltaserve.engine.regex_automaton import ByteAutomaton, RegexError, choice_regex

GUIDED_FIELDS = (
    "guided_choice",
    "guided_regex",
    "guided_json",
    "guided_json_object",
    "guided_grammar",
    "guided_structural_tag",
)


def guide_pattern(
    choice: tuple[str, ...],
    regex: str | None,
    schema: str | None,
    json_object: bool,
    whitespace: str | None,
    grammar: str | None = None,
    structural_tag: str | None = None,
) -> str:
    """The pattern of the one constraint given ("" for none); ValueError naming the field."""
    values = (choice, regex, schema, json_object, grammar, structural_tag)
    given = [name for name, v in zip(GUIDED_FIELDS, values, strict=True) if v]
    if len(given) > 1:
        raise ValueError(f"give one structured-output constraint, not {' and '.join(given)}")
    if whitespace is not None and not (schema or json_object):
        raise ValueError("guided_whitespace applies to guided_json and guided_json_object only")
    if not given:
        return ""
    return _compiled(
        given[0], choice or regex or schema or grammar or structural_tag or "", whitespace
    )


@functools.lru_cache(maxsize=256)
def _compiled(field: str, value: str | tuple[str, ...], whitespace: str | None) -> str:
    if whitespace is not None:
        try:
            ByteAutomaton(whitespace)
        except RegexError as e:
            raise ValueError(f"guided_whitespace: {e}") from None
    try:
        if field == "guided_choice":
            pattern = choice_regex(value)
        elif field == "guided_regex":
            pattern = value
        elif field == "guided_grammar":
            from deltaserve.engine.grammar import grammar_regex

            pattern = grammar_regex(value)
        elif field == "guided_structural_tag":
            from deltaserve.engine.structural_tag import structural_tag_regex

            pattern = structural_tag_regex(_json(value, "a structural tag"))
        else:
            from deltaserve.engine.json_schema import json_object_regex, schema_regex

            pattern = (
                schema_regex(_json(value), whitespace)
                if field == "guided_json"
                else json_object_regex(whitespace)
            )
        if ByteAutomaton(pattern).matches_nothing():
            raise ValueError("no output can match it")
    except ValueError as e:  # RegexError, SchemaError and GrammarError among them
        raise ValueError(f"{field}: {e}") from None
    return pattern


def _json(text: str, what: str = "a JSON schema") -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not {what}: {e}") from None
