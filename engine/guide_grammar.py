"""A request's constraint as llguidance's grammar, and what llguidance is run with.

vLLM's StructuredOutputsParams takes one of choice, regex, json (a schema), json_object,
grammar and structural_tag; each becomes the grammar llguidance reads: a choice a Lark
alternation of its strings, a regex and a schema as llguidance's own front ends take them, a
GBNF grammar through llguidance's converter to Lark (a Lark one as it is), a structural tag
what engine/structural_tag.py writes. JSON takes WHITESPACE between its tokens unless the
request says otherwise: llguidance's default (any run of blanks) would let a weak model write
blanks until max_tokens. An object schema that lists `properties` and says nothing of others
allows only those (`closed_objects`; JSON Schema would allow any, and a model that adds one
writes a key it was never told about). The compile worker (engine/grammar_worker.py) runs this; nothing
here is bounded but by the engine's checks before (engine/guided.py) and the worker's limits.
"""

from __future__ import annotations

import functools
import json
import re

from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import gbnf_to_lark

WHITESPACE = r"[ \t\n]{0,20}"  # blanks between JSON tokens: a newline and a 4-deep indent fit
_ECHO = re.compile(r"^\s*(\d+ \||\^)")  # llguidance's echo of the grammar around an error
_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)


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
        from deltaserve.engine.structural_tag import structural_tag_grammar

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


def lark_of(grammar: str) -> str:
    """A grammar as Lark: GBNF (llama.cpp's, `root ::= ...`) converted, Lark taken as it is."""
    if "::=" not in grammar:
        return grammar
    try:
        return gbnf_to_lark(_ESCAPE.sub(_unicode_escape, grammar))
    except Exception as exc:  # the converter raises what its parser meets, named or not
        raise ValueError(f"not a GBNF grammar: {exc}") from None


def _unicode_escape(m: re.Match) -> str:
    """GBNF's \\uXXXX and \\UXXXXXXXX as llguidance's converter can pass on (it writes them as
    \\uXX, which its Lark reader refuses): the character itself where that is safe in a
    literal or class, \\xNN below 256; any other escape as it was."""
    escape = m.group(0)
    if escape[1] not in "uU":
        return escape
    c = chr(int(escape[2:], 16))
    if c.isalnum() or (not c.isascii() and c.isprintable()):
        return c
    return f"\\x{ord(c):02x}" if ord(c) < 256 else escape


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
    stop regexes (engine/stop_regex.py) and for checking a grammar's language in tests."""
    return LLTokenizer(TokenizerWrapper(_Bytes()), slices=[])


class _Bytes:
    """llguidance's TokenizerWrapper's view of a byte tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "x-guidance"})
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not {what}: {e}") from None


__all__ = [
    "WHITESPACE",
    "byte_tokenizer",
    "closed_objects",
    "constraint_grammar",
    "error_summary",
    "lark_of",
    "parser_limits",
]
