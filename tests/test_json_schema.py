"""engine/json_schema.py: a schema's regex fully matches the JSON texts valid for it and no
others. Python's `re` is the oracle (with re.ASCII: the dialect's \\d \\w \\s), and the
engine's own automaton (engine/regex_automaton.py) must read every regex made here the same."""

from __future__ import annotations

import functools
import json
import re
from fractions import Fraction
from typing import Any

import pytest

from deltaserve.engine.json_schema import ANY_DEPTH, SchemaError, json_object_regex, schema_regex
from deltaserve.engine.regex_automaton import START, ByteAutomaton

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


@functools.lru_cache(maxsize=64)
def automaton_of(regex: str) -> ByteAutomaton:
    return ByteAutomaton(regex)


def matches(regex: str, text: str) -> bool:
    """Python's verdict, checked against the engine's automaton (the dialect read alike)."""
    verdict = re.fullmatch(regex, text, re.ASCII) is not None
    automaton = automaton_of(regex)
    assert automaton.accepting[automaton.step(START, text.encode())] == verdict, (regex[:200], text)
    return verdict


def test_function_parameters():
    regex = schema_regex(TOOL)
    for value in TOOL_VALID:
        for text in spellings(value):
            assert matches(regex, text), text
    for value in TOOL_INVALID:
        for text in spellings(value):
            assert not matches(regex, text), text
    # properties in their declared order only (as xgrammar and outlines write them)
    assert not matches(regex, '{"unit":"celsius","location":"x"}')


def test_whitespace_is_bounded_and_configurable():
    regex = schema_regex(TOOL)
    assert matches(regex, "{" + " " * 20 + '"location":"x",\n\t "unit"\n:\n"celsius"}')
    assert not matches(regex, "{" + " " * 21 + '"location":"x","unit":"celsius"}')
    assert not matches(regex, ' {"location":"x","unit":"celsius"}')  # none around the value
    assert not matches(regex, '{"location":"x","unit":"celsius"}\n')
    assert not matches(regex, '{"location":"x","unit":"celsius"\r}')
    compact = schema_regex(TOOL, whitespace="")
    assert matches(compact, json.dumps(TOOL_VALID[2], separators=(",", ":")))
    assert not matches(compact, json.dumps(TOOL_VALID[2]))
    single = schema_regex(TOOL, whitespace="[ ]?")
    assert matches(single, json.dumps(TOOL_VALID[2])) and not matches(
        single, json.dumps(TOOL_VALID[2], indent=1)
    )


BOUNDS = [  # bounds, and the integers they allow: (lowest, highest), None for none
    ({"minimum": 0, "maximum": 150}, (0, 150)),
    ({"minimum": -5, "maximum": 5}, (-5, 5)),
    ({"minimum": 18}, (18, 10**9)),
    ({"maximum": -7}, (-(10**9), -7)),
    ({"minimum": -250, "maximum": -99}, (-250, -99)),
    ({"minimum": 9, "maximum": 101}, (9, 101)),
    ({"exclusiveMinimum": -1, "exclusiveMaximum": 100}, (0, 99)),
    ({"minimum": 1.5, "maximum": 299.5}, (2, 299)),
    (
        {"minimum": 10, "exclusiveMinimum": True, "maximum": 20, "exclusiveMaximum": True},
        (11, 19),
    ),  # draft 4
    ({"minimum": 10, "exclusiveMinimum": 10}, (11, 10**9)),
    ({"minimum": 7, "maximum": 7}, (7, 7)),
    ({"minimum": 5, "maximum": 4}, None),
    ({}, (-(10**9), 10**9)),
]


@pytest.mark.parametrize("bounds, allowed", BOUNDS)
def test_integer_ranges(bounds, allowed):
    """Every integer in [-300, 300] (and a few malformed numerals) against the bounds."""
    if allowed is None:
        with pytest.raises(SchemaError, match="no JSON value"):
            schema_regex({"type": "integer", **bounds})
        return
    pattern = re.compile(schema_regex({"type": "integer", **bounds}))
    for x in range(-300, 301):
        assert (pattern.fullmatch(str(x)) is not None) == (allowed[0] <= x <= allowed[1]), x
    for text in ("-0", "07", "+7", "7.0", "1e1", ""):
        assert pattern.fullmatch(text) is None, text


def test_number_bounds():
    """Whole-number bounds: decimals around them; no exponent once bounded."""
    texts = [f"{i}{f}" for i in range(-12, 13) for f in ("", ".0", ".5", ".05", ".999", ".000")] + [
        "-0",
        "-0.5",
    ]
    for low, high in [
        ((0, True), None),
        ((0, False), None),
        ((-3, True), (3, False)),
        (None, (0, True)),
        ((1, False), (10, True)),
        (None, (-2, False)),
    ]:
        schema: dict[str, Any] = {"type": "number"}
        if low:
            schema["minimum" if low[1] else "exclusiveMinimum"] = low[0]
        if high:
            schema["maximum" if high[1] else "exclusiveMaximum"] = high[0]
        pattern = re.compile(schema_regex(schema))
        for text in texts:
            x = Fraction(text)
            want = (low is None or (x >= low[0] if low[1] else x > low[0])) and (
                high is None or (x <= high[0] if high[1] else x < high[0])
            )
            if not text.startswith("-0"):  # never written, though "-0" >= 0: a subset is enough
                assert (pattern.fullmatch(text) is not None) == want, (schema, text)
            assert want or pattern.fullmatch(text) is None, (schema, text)
        assert pattern.fullmatch("1e2") is None
    assert re.fullmatch(schema_regex({"type": "number"}), "-1.5E+10")


def test_strings():
    bounded = schema_regex({"type": "string", "minLength": 2, "maxLength": 3})
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
        assert matches(bounded, text) == ok, text
    pattern = schema_regex({"type": "string", "pattern": r"^[A-Z]{2}-\d{3}$"})
    assert (
        matches(pattern, '"FR-123"')
        and not matches(pattern, '"FR-1234"')
        and not matches(pattern, '"fr-123"')
    )
    anything = schema_regex({"type": "string", "pattern": ".*"})  # only what is written unescaped
    assert (
        matches(anything, '"a b"')
        and not matches(anything, '"a"b"')
        and not matches(anything, '"a\\"')
    )
    formats = {
        "date-time": (
            ["2024-02-29T23:59:59Z", "1999-12-31T00:00:00.5+05:30"],
            ["2024-02-29 23:59:59Z", "2024-13-01T00:00:00Z"],
        ),
        "date": (
            ["2024-02-29", "2000-02-29", "2023-04-30"],
            ["2023-02-29", "1900-02-29", "2023-04-31", "2023-4-01"],
        ),
        "time": (["12:30:00Z", "23:59:59.123-08:00"], ["24:00:00Z", "12:30"]),
        "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
        "email": (
            ["first.last+tag@mail.example.org"],
            ["no-at.example.org", "a@b", "a..b@example.org"],
        ),
        "ipv4": (["192.168.0.1", "255.255.255.255"], ["256.1.1.1", "1.2.3", "01.2.3.4"]),
    }
    for name, (good, bad) in formats.items():
        regex = schema_regex({"type": "string", "format": name})
        assert all(matches(regex, json.dumps(t)) for t in good), name
        assert not any(matches(regex, json.dumps(t)) for t in bad), name


def test_enum_const_and_types():
    regex = schema_regex({"enum": ["a b", 1, None, True, [1, {"k": "v"}], {}, "é"]})
    for value in ("a b", 1, None, True, [1, {"k": "v"}], {}):
        assert all(matches(regex, t) for t in spellings(value)), value
    assert matches(regex, '"é"') and not matches(
        regex, r'"\u00e9"'
    )  # as json.dumps(ensure_ascii=False)
    for text in ('"a"', "1.0", "false", "[1]", '"A B"'):
        assert not matches(regex, text), text
    typed = schema_regex({"type": "string", "enum": ["x", 2, "y"]})  # values the type allows
    assert matches(typed, '"y"') and not matches(typed, "2")
    assert schema_regex({"const": 'say "hi"'}) == r"\"say \\\"hi\\\"\""
    either = schema_regex({"type": ["integer", "null"]})
    assert matches(either, "null") and matches(either, "-3") and not matches(either, '"3"')
    nullable = schema_regex({"type": "string", "nullable": True, "maxLength": 1})
    assert matches(nullable, "null") and matches(nullable, '"a"') and not matches(nullable, '"ab"')


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
    """A recursive $ref is inlined to depth 3: deeper, its array stays empty; an optional
    recursive property is left out, a required one makes its parent impossible."""
    regex = schema_regex(TREE)
    for depth in (1, 2, 3):
        assert all(matches(regex, t) for t in spellings(tree(depth))), depth
    assert not matches(regex, json.dumps(tree(4)))
    linked = {
        "type": "object",
        "properties": {
            "v": {"type": "integer"},
            "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        },
        "required": ["v", "next"],
    }
    chain = {"v": 1, "next": {"v": 2, "next": {"v": 3, "next": None}}}
    regex = schema_regex(linked)
    assert matches(regex, json.dumps(chain)) and not matches(
        regex, json.dumps({"v": 0, "next": chain})
    )
    assert matches(regex, '{"v":1,"next":null}') and not matches(regex, '{"v":1}')
    with pytest.raises(SchemaError, match="no JSON value is valid.*recursive"):
        schema_regex(
            {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]}
        )
    pointer = {
        "definitions": {"a/b": {"type": "integer", "maximum": 3}},
        "type": "array",
        "items": {"$ref": "#/definitions/a~1b"},
    }
    regex = schema_regex(pointer)
    assert matches(regex, "[1, 2, 3]") and not matches(regex, "[4]")


def test_optional_properties_stay_small():
    """However many properties are optional, each value's regex is written a few times (not
    once per subset), and the nesting stays shallow enough for the engine's parser."""
    n = 40
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"const": f"v{i}"} for i in range(n)},
        "required": [f"p{i}" for i in range(n) if i % 7 == 3],
    }
    regex = schema_regex(schema, whitespace="")
    assert all(regex.count(f'"v{i}\\"') <= 3 for i in range(n))
    for keep in (range(0, n, 7), range(3, n, 7), range(n)):
        present = {*keep, *(i for i in range(n) if i % 7 == 3)}
        assert matches(
            regex, json.dumps({f"p{i}": f"v{i}" for i in sorted(present)}, separators=(",", ":"))
        )
    assert not matches(regex, '{"p0":"v0"}')  # the required ones missing
    assert not matches(
        regex, '{"p3":"v3","p0":"v0","p10":"v10","p17":"v17","p24":"v24","p31":"v31","p38":"v38"}'
    )
    optional = schema_regex(
        {"type": "object", "properties": {f"p{i}": {"const": i} for i in range(300)}}, ""
    )
    assert (
        len(optional) < 100 * 300
        and matches(optional, "{}")
        and matches(optional, '{"p7":7,"p299":299}')
    )
    assert not matches(optional, '{"p7":7,"p7":7}') and not matches(optional, '{"p8":8,"p7":7}')


def test_arrays_and_merging():
    pair = schema_regex(
        {"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}], "items": False}
    )
    assert (
        matches(pair, '[1.5, "x"]')
        and not matches(pair, "[1.5]")
        and not matches(pair, '[1, "x", 2]')
    )
    counted = schema_regex(
        {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}
    )
    assert [matches(counted, json.dumps([True] * k)) for k in range(5)] == [
        False,
        False,
        True,
        True,
        False,
    ]
    merged = schema_regex(
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"a": {"minimum": 0}, "b": {"type": "string"}}, "required": ["b"]},
            ]
        }
    )
    assert matches(merged, '{"a": 1, "b": ""}') and not matches(merged, '{"a": -1, "b": ""}')
    tagged = {
        "type": "object",
        "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["kind"],
        "oneOf": [
            {"properties": {"kind": {"const": "a"}}},
            {"properties": {"kind": {"const": "b"}}, "required": ["n"]},
        ],
    }
    regex = schema_regex(tagged)
    assert matches(regex, '{"kind": "a"}') and matches(regex, '{"kind": "b", "n": 2}')
    assert not matches(regex, '{"kind": "b"}') and not matches(regex, '{"kind": "c"}')
    free = schema_regex(
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2}
    )
    assert (
        matches(free, '{"x": 1, "y": 2}')
        and not matches(free, '{"x": 1, "y": 2, "z": 3}')
        and not matches(free, '{"x": "1"}')
    )


def nested(depth: int) -> Any:
    """A value whose containers nest `depth` deep."""
    return 1 if depth == 0 else {"k": nested(depth - 1)} if depth % 2 else [nested(depth - 1), "s"]


def test_any_value_and_json_object():
    """Free-form values nest containers ANY_DEPTH deep; json_object is {"type": "object"}."""
    regex = json_object_regex()
    assert regex == schema_regex({"type": "object"}) and len(regex) < 200_000
    assert matches(
        regex,
        json.dumps({"a": nested(ANY_DEPTH), "b": [], "c": {}, "d": -1.5e3, "e": None}, indent=2),
    )
    assert not matches(regex, json.dumps({"a": nested(ANY_DEPTH + 1)})) and not matches(regex, "[]")
    assert not matches(regex, '{"a": 1,}') and not matches(regex, "{'a': 1}")
    anything = schema_regex(True)
    assert all(
        re.fullmatch(anything, t) for t in ('"x"', "0", "[]", "{}", json.dumps(nested(ANY_DEPTH)))
    )
    assert schema_regex({"description": "any"}) == anything
    compact = json_object_regex("")
    assert re.fullmatch(compact, '{"a":[1]}') and not re.fullmatch(compact, '{"a": [1]}')


@pytest.mark.parametrize(
    "schema, words",
    [
        (
            {"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 2}}},
            "properties.age: 'multipleOf' is not supported",
        ),
        (
            {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "'uniqueItems' is not supported",
        ),
        (
            {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"not": {}}]}},
            "items.anyOf[1]: 'not' is not supported",
        ),
        (
            {"type": "object", "patternProperties": {"^x": {}}},
            "'patternProperties' is not supported",
        ),
        ({"if": {}, "then": {}}, "'if' is not supported"),
        ({"type": "string", "format": "color"}, "format 'color' is not supported"),
        ({"type": "string", "pattern": "a(?=b)"}, "'pattern'"),
        ({"type": "string", "pattern": "a", "maxLength": 3}, "'maxLength' with 'pattern'"),
        ({"type": "string", "maxLength": 1001}, "'maxLength' 1001 is above the limit of 1000"),
        ({"type": "number", "maximum": 0.5}, "'maximum' 0.5: only whole-number bounds"),
        ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, "'minProperties'"),
        ({"$ref": "https://example.com/s.json"}, "only references within the schema"),
        ({"$ref": "#/$defs/missing"}, "points at nothing"),
        ({"allOf": [{"pattern": "a"}, {"pattern": "b"}]}, "two different 'pattern'"),
        ({"type": "strin"}, "unknown type 'strin'"),
        (
            {"anyOf": [{"type": "string"}, {"type": "null"}], "properties": 3},
            "anyOf[0]: 'properties' must be an object",
        ),
        (
            {"allOf": [{"type": "string"}, {"type": "integer"}]},
            "no JSON value is valid for this schema",
        ),
        (False, "no JSON value is valid for this schema"),
        (
            {
                "$defs": {
                    "D30": {},
                    **{
                        f"D{i}": {
                            "type": "array",
                            "prefixItems": [{"$ref": f"#/$defs/D{i + 1}"}] * 2,
                        }
                        for i in range(30)
                    },
                },
                "$ref": "#/$defs/D0",
            },
            "the regex passes 500000 characters",
        ),
    ],
)
def test_refused(schema, words):
    with pytest.raises(SchemaError) as info:
        schema_regex(schema)
    assert words in str(info.value)
