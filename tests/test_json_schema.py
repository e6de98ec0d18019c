"""JSON schemas as llguidance compiles them (engine/guided/grammar.py): the texts valid for a
schema, in json.dumps' spellings within the bounded blanks, are whole outputs of its grammar,
and texts that break it are not, judged by llguidance's own matcher fed their bytes
(tests/guide_helpers.py). What llguidance decides differently from the regexes the engine
wrote before is named in docs/API.md ("Structured outputs")."""

from __future__ import annotations

import json
from typing import Any

import pytest
from guide_helpers import accepts, compile_error, schema_grammar

from deltaserve.engine.guided.grammar import closed_objects, constraint_grammar

# An OpenAI-style function's parameters: nested object, enum, optional fields, an array of
# objects, integer bounds, anyOf with null.
TOOL = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "options": {
            "type": "object",
            "properties": {
                "detailed": {"type": "boolean"},
                "lang": {
                    "anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}],
                    "default": None,
                },
            },
            "required": ["detailed"],
        },
        "stops": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "hours": {"type": "number", "minimum": 0},
                },
                "required": ["name"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["location", "unit"],
}
TOOL_VALID = [
    {"location": "Paris, FR", "unit": "celsius"},
    {"location": "", "unit": "fahrenheit", "days": 14},
    {"location": 'Oslo "NO" \\ é ☃', "unit": "celsius", "days": 1, "options": {"detailed": False}},
    {"location": "x", "unit": "celsius", "options": {"detailed": True, "lang": None}},
    {
        "location": "x",
        "unit": "celsius",
        "options": {"detailed": True, "lang": "en-GB"},
        "stops": [],
    },
    {
        "location": "x",
        "unit": "celsius",
        "stops": [{"name": "a"}, {"name": "b", "hours": 2.5}, {"name": "c", "hours": 0}],
    },
]
TOOL_INVALID = [
    {"unit": "celsius"},  # missing required
    {"location": "x"},
    {"location": 3, "unit": "celsius"},  # wrong type
    {"location": "x", "unit": "kelvin"},  # bad enum
    {"location": "x", "unit": "celsius", "wind": True},  # extra property
    {"location": "x", "unit": "celsius", "days": 0},  # out of range
    {"location": "x", "unit": "celsius", "days": 15},
    {"location": "x", "unit": "celsius", "days": 2.5},
    {"location": "x", "unit": "celsius", "options": {}},  # nested required
    {"location": "x", "unit": "celsius", "options": {"detailed": True, "lang": "toolong"}},
    {"location": "x", "unit": "celsius", "stops": [{"name": "a"}] * 4},  # too many items
    {"location": "x", "unit": "celsius", "stops": [{"name": "a", "hours": -1}]},
    {"location": "x", "unit": "celsius", "stops": [{"name": "a", "open": True}]},
]


def spellings(value: Any) -> list[str]:
    """`value` as JSON: compact, json.dumps' default separators, pretty-printed."""
    return [
        json.dumps(value, separators=(",", ":")),
        json.dumps(value),
        json.dumps(value, indent=2),
        json.dumps(value, indent="\t", ensure_ascii=False),
    ]


def test_function_parameters():
    grammar = schema_grammar(TOOL)
    for value in TOOL_VALID:
        for text in spellings(value):
            assert accepts(grammar, text), text
    for value in TOOL_INVALID:
        for text in spellings(value):
            assert not accepts(grammar, text), text
    # properties in their declared order only (as xgrammar and outlines write them)
    assert not accepts(grammar, '{"unit":"celsius","location":"x"}')


def test_only_the_listed_properties_unless_the_schema_says():
    """An object that lists properties and says nothing of others allows only those (the
    engine adds additionalProperties: false); one that allows others, or lists none, is a map."""
    listed = schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert accepts(listed, '{"a": 1}') and not accepts(listed, '{"a": 1, "b": 2}')
    open_ = schema_grammar(
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    )
    assert accepts(open_, '{"a": [], "b": 2}') and not accepts(open_, '{"a": [], "b": "2"}')
    assert accepts(schema_grammar({"type": "object"}), '{"b": {"c": [1]}}')
    data = {"enum": [{"properties": 1}], "properties": {"properties": {"type": "integer"}}}
    assert closed_objects(data) == {**data, "additionalProperties": False}  # data and names kept


def test_whitespace_is_bounded_and_configurable():
    grammar = schema_grammar(TOOL)
    assert accepts(grammar, "{" + " " * 20 + '"location":"x",\n\t "unit"\n:\n"celsius"}')
    assert not accepts(grammar, "{" + " " * 21 + '"location":"x","unit":"celsius"}')
    assert not accepts(grammar, ' {"location":"x","unit":"celsius"}')  # none around the value
    assert not accepts(grammar, '{"location":"x","unit":"celsius"}\n')
    assert not accepts(grammar, '{"location":"x","unit":"celsius"\r}')
    compact = schema_grammar(TOOL, whitespace="")
    assert accepts(compact, json.dumps(TOOL_VALID[2], separators=(",", ":")))
    assert not accepts(compact, json.dumps(TOOL_VALID[2]))
    single = schema_grammar(TOOL, whitespace="[ ]?")
    assert accepts(single, json.dumps(TOOL_VALID[2])) and not accepts(
        single, json.dumps(TOOL_VALID[2], indent=1)
    )


BOUNDS = [  # bounds, and the integers they allow: (lowest, highest)
    ({"minimum": 0, "maximum": 150}, (0, 150)),
    ({"minimum": -5, "maximum": 5}, (-5, 5)),
    ({"minimum": 18}, (18, 10**9)),
    ({"maximum": -7}, (-(10**9), -7)),
    ({"minimum": -250, "maximum": -99}, (-250, -99)),
    ({"minimum": 9, "maximum": 101}, (9, 101)),
    ({"exclusiveMinimum": -1, "exclusiveMaximum": 100}, (0, 99)),
    ({"minimum": 1.5, "maximum": 299.5}, (2, 299)),
    ({"minimum": 10, "exclusiveMinimum": 10}, (11, 10**9)),
    ({"minimum": 7, "maximum": 7}, (7, 7)),
    ({}, (-(10**9), 10**9)),
]


@pytest.mark.parametrize("bounds, allowed", BOUNDS)
def test_integer_ranges(bounds, allowed):
    """Every integer in [-300, 300] (and a few malformed numerals) against the bounds."""
    grammar = schema_grammar({"type": "integer", **bounds})
    for x in range(-300, 301):
        assert accepts(grammar, str(x)) == (allowed[0] <= x <= allowed[1]), x
    for text in ("07", "+7", "7.0", "1e1", ""):
        assert not accepts(grammar, text), text


def test_number_bounds():
    """Bounds on numbers hold for decimals (bounded numbers take no exponent)."""
    grammar = schema_grammar({"type": "number", "minimum": -3, "exclusiveMaximum": 2.5})
    for text, ok in [
        ("-3", True),
        ("-3.0", True),
        ("-3.5", False),
        ("2.49", True),
        ("2.5", False),
        ("1e1", False),
        ("-0.5", True),
    ]:
        assert accepts(grammar, text) == ok, text
    assert accepts(schema_grammar({"type": "number"}), "-1.5E+10")


def test_strings():
    bounded = schema_grammar({"type": "string", "minLength": 2, "maxLength": 3})
    for text, ok in [
        ('"ab"', True),
        ('"abc"', True),
        ('"a"', False),
        ('"abcd"', False),
        (r'"\n\u00e9"', True),
        (r'"\"\\/"', True),
        ('"é☃"', True),
        (r'"\x"', False),
        ('"a\nb"', False),
        (r'"\u12"', False),
    ]:
        assert accepts(bounded, text) == ok, text
    pattern = schema_grammar({"type": "string", "pattern": r"^[A-Z]{2}-\d{3}$"})
    assert (
        accepts(pattern, '"FR-123"')
        and not accepts(pattern, '"FR-1234"')
        and not accepts(pattern, '"fr-123"')
    )
    formats = {
        "date-time": (["2024-02-29T23:59:59Z"], ["2024-02-29 23:59:59Z", "2024-13-01T00:00:00Z"]),
        "date": (["2024-02-29", "2023-04-30"], ["2023-4-01", "2023-13-01"]),
        "time": (["12:30:00Z"], ["24:00:00Z", "12:30"]),
        "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
        "email": (["first.last+tag@mail.example.org"], ["no-at.example.org"]),
        "ipv4": (["192.168.0.1", "255.255.255.255"], ["256.1.1.1", "1.2.3"]),
    }
    for name, (good, bad) in formats.items():
        grammar = schema_grammar({"type": "string", "format": name})
        assert all(accepts(grammar, json.dumps(t)) for t in good), name
        assert not any(accepts(grammar, json.dumps(t)) for t in bad), name


def test_enum_const_and_types():
    grammar = schema_grammar({"enum": ["a b", 1, None, True, [1, {"k": "v"}], {}]})
    for value in ("a b", 1, None, True):
        assert accepts(grammar, json.dumps(value)), value
    for text in ('"a"', "1.0", "false", "[1]", '"A B"'):
        assert not accepts(grammar, text), text
    typed = schema_grammar({"type": "string", "enum": ["x", 2, "y"]})  # values the type allows
    assert accepts(typed, '"y"') and not accepts(typed, "2")
    assert accepts(schema_grammar({"const": 'say "hi"'}), r'"say \"hi\""')
    either = schema_grammar({"type": ["integer", "null"]})
    assert accepts(either, "null") and accepts(either, "-3") and not accepts(either, '"3"')


TREE = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "label": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
            },
            "required": ["label", "children"],
        }
    },
    "$ref": "#/$defs/Node",
}


def tree(depth: int) -> dict[str, Any]:
    return {
        "label": str(depth),
        "children": [tree(depth - 1), tree(depth - 1)] if depth > 1 else [],
    }


def test_recursive_ref():
    """A recursive $ref recurses without a depth bound (llguidance parses a context-free
    grammar: no bound to write into a regex)."""
    grammar = schema_grammar(TREE)
    for depth in (1, 3, 6):
        assert accepts(grammar, json.dumps(tree(depth))), depth
    assert not accepts(grammar, '{"label": "x"}')
    pointer = {
        "definitions": {"a/b": {"type": "integer", "maximum": 3}},
        "type": "array",
        "items": {"$ref": "#/definitions/a~1b"},
    }
    grammar = schema_grammar(pointer)
    assert accepts(grammar, "[1, 2, 3]") and not accepts(grammar, "[4]")


def test_many_optional_properties():
    n = 40
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"const": f"v{i}"} for i in range(n)},
        "required": [f"p{i}" for i in range(n) if i % 7 == 3],
    }
    grammar = schema_grammar(schema, whitespace="")
    for keep in (range(0, n, 7), range(3, n, 7), range(n)):
        present = {*keep, *(i for i in range(n) if i % 7 == 3)}
        text = json.dumps({f"p{i}": f"v{i}" for i in sorted(present)}, separators=(",", ":"))
        assert accepts(grammar, text)
    assert not accepts(grammar, '{"p0":"v0"}')  # the required ones missing


def test_arrays_and_merging():
    pair = schema_grammar(
        {"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}], "items": False}
    )
    # JSON Schema's prefixItems: a shorter array is valid too (the old regexes required all)
    assert accepts(pair, '[1.5, "x"]') and accepts(pair, "[1.5]")
    assert not accepts(pair, '[1, "x", 2]') and not accepts(pair, '["x"]')
    counted = schema_grammar(
        {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}
    )
    assert [accepts(counted, json.dumps([True] * k)) for k in range(5)] == [
        False,
        False,
        True,
        True,
        False,
    ]
    merged = schema_grammar(
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"a": {"minimum": 0}, "b": {"type": "string"}}, "required": ["b"]},
            ]
        }
    )
    assert accepts(merged, '{"a": 1, "b": ""}') and not accepts(merged, '{"a": -1, "b": ""}')


def test_any_value_and_json_object():
    """json_object is {"type": "object"}: any object, nested as deep as the output goes."""
    grammar = constraint_grammar("json_object", "", None)
    deep = {"a": [{"b": [[{"c": [1, -1.5e3, None, "s"]}]]}], "e": {}}
    assert accepts(grammar, json.dumps(deep, indent=2))
    assert not accepts(grammar, "[]") and not accepts(grammar, '{"a": 1,}')
    assert not accepts(grammar, "{'a': 1}")
    anything = constraint_grammar("json", "true", None)
    assert all(accepts(anything, t) for t in ('"x"', "0", "[]", "{}"))
    compact = constraint_grammar("json_object", "", "")
    assert accepts(compact, '{"a":[1]}') and not accepts(compact, '{"a": [1]}')


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "string", "format": "color"}, "Unknown format: color"),
        ({"type": "string", "pattern": "a(?=b)"}, "look-around"),
        ({"$ref": "https://example.com/s.json"}, "https://example.com/s.json"),
        ({"$ref": "#/$defs/missing"}, "'/$defs/missing' does not exist"),
        ({"type": "strin"}, "strin"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "nsatisfiable"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "nsatisfiable"),
    ],
)
def test_refused(schema, words):
    """What llguidance cannot compile is an error saying why (the engine prefixes the field)."""
    assert words in compile_error("json", json.dumps(schema))
