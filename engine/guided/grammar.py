"""A request's constraint as llguidance's grammar.

vLLM's StructuredOutputsParams takes one of choice, regex, json (a schema), json_object,
grammar and structural_tag; each becomes the grammar llguidance reads: a choice a Lark
alternation of its strings, a regex and a schema as llguidance's own front ends take them, a
GBNF grammar through llguidance's converter to Lark (a Lark one as it is, gbnf.py), a
structural tag what structural_tag.py writes. JSON takes WHITESPACE between its tokens unless
the request says otherwise: llguidance's default (any run of blanks) would let a weak model
write blanks until max_tokens. An object schema that lists `properties` and says nothing of
others allows only those (`closed_objects`; JSON Schema would allow any, and a model that
adds one writes a key it was never told about). The compile worker (engine/grammar_worker.py)
runs this; nothing here is bounded but by the engine's checks before (engine/guides.py) and
the worker's limits.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher

from deltaserve.engine.guided.gbnf import lark_of
from deltaserve.engine.guided.structural_tag import structural_tag_grammar

WHITESPACE = r"[ \t\n]{0,20}"  # blanks between JSON tokens: a newline and a 4-deep indent fit


def constraint_grammar(kind: str, text: str, whitespace: str | None) -> str:
    """The llguidance grammar of one constraint (`text`: the choices as a JSON list, the
    regex, the schema's or structural tag's JSON text, the grammar); ValueError saying what
    is wrong (the caller names the field)."""
    blanks = WHITESPACE if whitespace is None else whitespace
    if kind == "choice":
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(map(json.dumps, json.loads(text)))
        )
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(lark_of(text))
    if kind == "structural_tag":
        return structural_tag_grammar(_json(text, "a structural tag"), blanks)
    schema = '{"type": "object"}' if kind == "json_object" else text
    schema = closed_objects(_json(schema, "a JSON schema"))
    if isinstance(schema, bool):  # true: any value; false: none
        schema = {} if schema else {"not": {}}
    options = (
        {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        if blanks == ""
        else {"whitespace_pattern": blanks}
    )
    options["json_allow_general_unicode_escapes"] = True  # "\u00e9" as json.dumps writes it
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)


def closed_objects(schema: object, close: bool = True) -> object:
    """The schema with `additionalProperties: false` in every object schema that lists
    properties and says nothing of others (a subschema is any value but an enum's, a const's,
    a default's or an example's, which are data). The members of an allOf stay open: closed,
    each would forbid the properties the others list."""
    if isinstance(schema, list):
        return [closed_objects(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> subschemas
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = closed_objects(value, close=key != "allOf")
    if (
        close
        and "properties" in out
        and not {"additionalProperties", "patternProperties"} & out.keys()
    ):
        out["additionalProperties"] = False
    return out


_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "x-guidance"})
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not {what}: {e}") from None


__all__ = ["WHITESPACE", "closed_objects", "constraint_grammar"]
