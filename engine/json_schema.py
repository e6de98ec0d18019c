"""A JSON Schema as a regex (engine/regex_automaton.py's dialect) of the JSON texts valid for it.

Structured outputs (vLLM's `response_format` json_schema and json_object, `structured_outputs.
json`) guide a generation by a regex; this turns a schema into one, as outlines'
`build_regex_from_schema` does, with xgrammar's choices (vLLM's default backend) where they
differ. The language is a subset of the schema's valid texts, never more; what a regex cannot
say, or is not implemented, is refused with a SchemaError naming the keyword and where it is
(vLLM refuses what xgrammar does not support: vllm/v1/structured_output/backend_xgrammar.py).

Choices, each a subset of what the schema allows:
- Blanks: `whitespace` after `{ [ , :` and before `} ] , :`, none around the value. The default,
  WHITESPACE, bounds them (xgrammar's any_whitespace does not): a weak model could otherwise
  write blanks until max_tokens; 20 still fit a newline and the indent of JSON nested 4 deep.
- Objects: the `properties` in their declared order (as outlines and xgrammar write them), the
  `required` ones always, no others, whatever `additionalProperties` says (xgrammar allows
  extras unless disable_additional_properties). With no `properties`: a map of any keys to
  `additionalProperties` (any value when true or absent).
- A free-form value (`true`, `{}`, absent `items`) nests containers at most ANY_DEPTH deep;
  json_object_regex() is `{"type": "object"}`'s: an object of free-form values.
- `$ref` (a JSON pointer: `#`, `#/$defs/...`) is inlined, a schema at most REF_DEPTH times
  within itself; past that it has no value: an anyOf drops it, an optional property or further
  array items are left out, a value that needs it has none in turn. A schema that ends with
  no value is refused.
- `enum` and `const` values as json.dumps writes them (no ASCII escapes), `whitespace` between
  the tokens of arrays and objects as everywhere.
- Strings: `pattern` (^ and $ stripped, matched against the whole string) may match only
  characters written unescaped; minLength/maxLength count characters, an escape as one.
- Bounded numbers are written without an exponent, and their bounds must be whole numbers.
- Counts (minLength, maxItems, ...) above MAX_COUNT are refused: the automaton copies a
  counted repeat that many times.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

# the engine's parser reads `pattern`s, so that they mean here what they mean there
from deltaserve.engine import regex_automaton as syntax
from deltaserve.engine.regex_automaton import MAX_REPEAT, RegexError, escape

WHITESPACE = r"[ \t\n]{0,20}"
ANY_DEPTH = 3  # containers in a free-form value nest at most this deep
REF_DEPTH = 3  # a schema is inlined at most this many times within itself (the root counts)
MAX_COUNT = MAX_REPEAT  # the largest minLength, maxLength, minItems, ... taken
MAX_REGEX_CHARS = 500_000  # a larger regex is refused (a schema whose $refs multiply)

CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'  # one character of a string
STRING = f'"{CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_STRING_CHARS = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF))  # written unescaped
_FRACTION, _ZERO_FRACTION, _NONZERO_FRACTION = r"\.[0-9]+", r"\.0+", r"\.[0-9]*[1-9][0-9]*"
_ATOMIC = re.compile(r"\\?.|\[[^\[\]\\]*\]", re.DOTALL)  # a character or plain class: repeated bare

_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_LEAP_DAY = (
    r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29"
)
_DATE = rf"(?:[0-9]{{4}}-{_DAY}|{_LEAP_DAY})"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?\^_`{|}~\-]+"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?"
_HEX = "[0-9a-fA-F]"
# string formats: RFC 3339's date-time, date and time (with an offset), RFC 4122's uuid, a
# simple email (dotted atoms @ a domain name), ipv4
FORMATS = {
    "date-time": rf"{_DATE}T{_TIME}",
    "date": _DATE,
    "time": _TIME,
    "uuid": rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": rf"{_ATOM}(?:\.{_ATOM})*@(?:{_LABEL}\.)+[A-Za-z]{{2,}}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
}

# Keywords that do not constrain, ignored; "x-" extensions too. `discriminator` (OpenAPI's)
# names the property whose const already tells oneOf's branches apart.
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$anchor",
        "$comment",
        "$defs",
        "definitions",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentEncoding",
        "contentMediaType",
        "discriminator",
    }
)
_SCHEMAS = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "additionalItems",
    "unevaluatedItems",
)
# What each type reads: a schema with no `type` is of the types whose keywords it has.
_TYPE_KEYWORDS = {
    "object": (
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "minProperties",
        "maxProperties",
    ),
    "array": (
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "minItems",
        "maxItems",
        "uniqueItems",
    ),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
}
_KEYWORDS = frozenset(
    {
        "$ref",
        "allOf",
        "anyOf",
        "oneOf",
        "enum",
        "const",
        "type",
        "nullable",
        *(k for keys in _TYPE_KEYWORDS.values() for k in keys),
    }
)
_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_LOWER_BOUNDS = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"})
_UPPER_BOUNDS = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"})


class SchemaError(ValueError):
    """A schema this module refuses; the message names where in it ("properties.age: ...")."""


def schema_regex(schema: Mapping[str, Any] | bool, whitespace: str | None = None) -> str:
    """The regex whose full matches are JSON texts valid for `schema` (see the module's doc).
    `whitespace`: the regex of the blanks between tokens (None: WHITESPACE; "": none)."""
    compiler = _Compiler(schema, _blank(whitespace))
    regex = compiler.node(schema, "")
    if regex is None:
        cut = f" (a recursive $ref is inlined at most {REF_DEPTH} deep)" if compiler.cut else ""
        raise SchemaError(f"no JSON value is valid for this schema{cut}")
    return regex


@functools.lru_cache(maxsize=16)
def json_object_regex(whitespace: str | None = None) -> str:
    """Any JSON object (response_format json_object): xgrammar's is `{"type": "object"}`'s too."""
    return _map(_blank(whitespace), _any(_blank(whitespace), ANY_DEPTH), 0, None)


def _blank(whitespace: str | None) -> str:
    whitespace = WHITESPACE if whitespace is None else whitespace
    return f"(?:{whitespace})" if whitespace else ""


def _fail(path: str, message: str) -> SchemaError:
    return SchemaError(f"{path}: {message}" if path else message)


def _at(path: str, *parts: object) -> str:
    return ".".join([path, *map(str, parts)] if path else map(str, parts))


def _alt(options: list[str | None]) -> str | None:
    """The alternation of `options` (None and duplicates dropped); None for none."""
    kept = list(dict.fromkeys(o for o in options if o is not None))
    return None if not kept else kept[0] if len(kept) == 1 else "(?:" + "|".join(kept) + ")"


def _repeat(regex: str, low: int, high: int | None) -> str:
    if high == 0 or low == high == 1:
        return "" if high == 0 else regex
    quantifier = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((low, high))
    quantifier = quantifier or (
        f"{{{low}}}" if low == high else f"{{{low},{'' if high is None else high}}}"
    )
    return f"{regex if regex == CHAR or _ATOMIC.fullmatch(regex) else f'(?:{regex})'}{quantifier}"


def _list(ws: str, open_: str, close: str, item: str | None, low: int, high: int | None) -> str:
    """`open_`, low..high `item`s separated by commas, `close`; no item at all when None."""
    if item is None or high == 0:
        return f"{open_}{ws}{close}"
    body = (
        item + _repeat(f"{ws},{ws}{item}", max(low - 1, 0), None if high is None else high - 1) + ws
    )
    return f"{open_}{ws}{body if low else f'(?:{body})?'}{close}"


def _map(ws: str, value: str | None, low: int, high: int | None) -> str:
    return _list(
        ws, r"\{", r"\}", None if value is None else f"{STRING}{ws}:{ws}{value}", low, high
    )


@functools.lru_cache(maxsize=16)
def _any(ws: str, depth: int) -> str:
    """Any JSON value whose containers nest at most `depth` deep."""
    options = [STRING, NUMBER, "true", "false", "null"]
    if depth:
        inner = _any(ws, depth - 1)
        options += [_map(ws, inner, 0, None), _list(ws, r"\[", r"\]", inner, 0, None)]
    return "(?:" + "|".join(options) + ")"


def _literal(value: Any, ws: str) -> str:
    """The JSON text of `value`, with `ws` between the tokens of its arrays and objects."""
    if isinstance(value, Mapping):
        return _sequence(
            ws,
            r"\{",
            r"\}",
            [f"{escape(_dumps(k))}{ws}:{ws}{_literal(v, ws)}" for k, v in value.items()],
        )
    if isinstance(value, list):
        return _sequence(ws, r"\[", r"\]", [_literal(v, ws) for v in value])
    return escape(_dumps(value))


def _sequence(ws: str, open_: str, close: str, items: list[str]) -> str:
    return f"{open_}{ws}" + f"{ws},{ws}".join(items) + (ws if items else "") + close


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _same_length(low: str, high: str) -> str:
    """The numerals of len(low) digits from low to high (equal lengths, low <= high)."""
    if low == high:
        return low
    if low[0] == high[0]:
        return low[0] + _same_length(low[1:], high[1:])
    rest = len(low) - 1
    any_rest = _repeat("[0-9]", rest, rest)
    first, last, options = int(low[0]), int(high[0]), []
    if low[1:] != "0" * rest:
        options.append(low[0] + _same_length(low[1:], "9" * rest))
        first += 1
    tail = None
    if high[1:] != "9" * rest:
        tail = high[0] + _same_length("0" * rest, high[1:])
        last -= 1
    if first <= last:
        options.append((str(first) if first == last else f"[{first}-{last}]") + any_rest)
    return _alt([*options, tail]) or ""


def _naturals(low: int, high: int | None) -> str | None:
    """The numerals (no leading zeros) of the integers low..high (0 <= low; None: no end)."""
    if high is not None and low > high:
        return None
    options, digits = [], len(str(low))
    while high is None or digits <= len(str(high)):
        top = 10**digits - 1 if high is None else min(high, 10**digits - 1)
        options.append(
            _same_length(str(max(low, 10 ** (digits - 1) if digits > 1 else 0)), str(top))
        )
        if high is None:
            options.append(f"[1-9][0-9]{{{digits},}}")
            break
        digits += 1
    return _alt(options)


def integer_regex(low: int | None, high: int | None) -> str | None:
    """The integers low..high (None: no bound) as JSON writes them; None if there are none."""
    if low is not None and high is not None and low > high:
        return None
    options = []
    if low is None or low < 0:  # the negative ones, by magnitude
        magnitudes = _naturals(
            1 if high is None or high >= 0 else -high, None if low is None else -low
        )
        options.append(f"-{magnitudes}")
    if high is None or high >= 0:
        options.append(_naturals(max(low or 0, 0), high))
    return _alt(options)


def _magnitudes(sign: str, low: int, low_in: bool, high: int | None, high_in: bool) -> str | None:
    """`sign`, then decimals (no exponent) from low to high, each end in or out (0 <= low)."""
    if high is not None and (low > high or (low == high and not (low_in and high_in))):
        return None
    if low == high:
        return f"{sign}{low}(?:{_ZERO_FRACTION})?"
    options = [f"{low}(?:{_FRACTION})?" if low_in else f"{low}{_NONZERO_FRACTION}"]
    middle = _naturals(low + 1, None if high is None else high - 1)
    options.append(None if middle is None else f"{middle}(?:{_FRACTION})?")
    options.append(f"{high}(?:{_ZERO_FRACTION})?" if high is not None and high_in else None)
    return f"{sign}{_alt(options)}"


Bound = tuple[int, bool] | None  # a whole number and whether it is in the range


def number_regex(low: Bound, high: Bound) -> str | None:
    """JSON numbers from low to high (None: no bound): any number when unbounded, else ones
    written without an exponent. None if there are none."""
    if low is None and high is None:
        return NUMBER
    options = []
    if low is None or low[0] < 0:  # x < 0, as -|x|
        near = (-high[0], high[1]) if high is not None and high[0] < 0 else (0, False)
        options.append(
            _magnitudes("-", *near, *((None, False) if low is None else (-low[0], low[1])))
        )
    if high is None or high[0] > 0 or high == (0, True):
        start = low if low is not None and low[0] >= 0 else (0, True)
        options.append(_magnitudes("", *start, *((None, False) if high is None else high)))
    return _alt(options)


def _pattern(pattern: str, path: str) -> str | None:
    """`pattern` (ECMAScript, here in the engine's dialect) as the content of a JSON string:
    anchors stripped, each character class cut to the characters written unescaped."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and (len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))) % 2 == 0:
        pattern = pattern[:-1]  # not an escaped "\$"
    try:
        tree = syntax.parse(pattern)
    except RegexError as e:
        raise _fail(path, f"'pattern' {e}") from None
    return _unescaped(tree)


def _unescaped(node: object) -> str | None:
    if isinstance(node, syntax.Chars):
        ranges = [
            (max(a, c), min(b, d))
            for a, b in node.ranges
            for c, d in _STRING_CHARS
            if max(a, c) <= min(b, d)
        ]
        if not ranges:
            return None
        if ranges[0][0] == ranges[-1][1]:
            return escape(chr(ranges[0][0]))
        return (
            "["
            + "".join(_class_char(a) + (f"-{_class_char(b)}" if b > a else "") for a, b in ranges)
            + "]"
        )
    if isinstance(node, syntax.Concat):
        parts = [_unescaped(p) for p in node.parts]
        return None if None in parts else "".join(parts)  # type: ignore[arg-type]
    if isinstance(node, syntax.Alt):
        return _alt([_unescaped(o) for o in node.options])
    assert isinstance(node, syntax.Repeat)
    inner = _unescaped(node.node)  # nothing to repeat: only none of it
    return ("" if node.low == 0 else None) if inner is None else _repeat(inner, node.low, node.high)


def _class_char(code: int) -> str:
    if 0x20 <= code < 0x7F:
        return "\\" + chr(code) if chr(code) in "\\]^-[" else chr(code)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


class _Compiler:
    """One schema's regex. `expanding` counts, per $ref, how many times it is being inlined on
    the way from the root (itself "#") to the schema at hand; `cut`: some $ref was not."""

    def __init__(self, root: object, ws: str) -> None:
        self.root, self.ws = root, ws
        self.expanding: dict[str, int] = {"#": 1}
        self.cut = False

    def node(self, schema: object, path: str) -> str | None:
        """`schema`'s regex; None when no value is valid for it (as far as written here)."""
        if isinstance(schema, bool):
            return _any(self.ws, ANY_DEPTH) if schema else None
        if not isinstance(schema, Mapping):
            raise _fail(path, "a schema must be an object or a boolean")
        if unknown := [
            k
            for k in schema
            if k not in _KEYWORDS and k not in _ANNOTATIONS and not k.startswith("x-")
        ]:
            raise _fail(path, f"{unknown[0]!r} is not supported")
        regex = self._schema(schema, path)
        if regex is not None and len(regex) > MAX_REGEX_CHARS:
            raise _fail(path, f"the regex passes {MAX_REGEX_CHARS} characters")
        return regex

    def _schema(self, s: Mapping[str, Any], path: str) -> str | None:
        if "$ref" in s or "allOf" in s:
            return self._merged(s, path)
        for key in ("anyOf", "oneOf"):  # oneOf's exclusivity is not enforced, as xgrammar's
            if key in s:
                rest, options = _constraints(s, key), []
                for i, branch in enumerate(_array_of(s, key, path)):
                    at = _at(path, f"{key}[{i}]")
                    options.append(self.node(_merge(rest, branch, at) if rest else branch, at))
                return _alt(options)
        for key in ("const", "enum"):
            if key in s:
                return self._values(s, key, path)
        types = s.get("type")
        if types is None:  # of the types whose keywords it has; any value if none
            types = [t for t, keys in _TYPE_KEYWORDS.items() if any(k in s for k in keys)]
            if not types:
                return _any(self.ws, ANY_DEPTH)
        types = _type_list(types, path) + (
            ["null"] if s.get("nullable") is True else []
        )  # nullable: OpenAPI's
        for kind in types:
            if kind not in _TYPES:
                raise _fail(path, f"unknown type {kind!r}")
        return _alt([self._typed(kind, s, path) for kind in dict.fromkeys(types)])

    def _merged(self, s: Mapping[str, Any], path: str) -> str | None:
        """A $ref and allOf with their siblings, as one schema: each reference inlined (counted
        while the result is walked), the parts merged (`_merge`)."""
        parts = [{"$ref": s["$ref"]}] if "$ref" in s else []
        parts += _array_of(s, "allOf", path) if "allOf" in s else []
        merged: Mapping[str, Any] | bool = _constraints(s, "$ref", "allOf")
        alone = not merged and len(parts) == 1  # errors then name the referenced schema's path
        entered: list[str] = []
        try:
            for part in parts:
                where = path
                while isinstance(part, Mapping) and "$ref" in part:
                    ref = part["$ref"]
                    target, where = self._resolve(ref, path)
                    if self.expanding.get(ref, 0) >= REF_DEPTH:
                        self.cut = True
                        return None
                    self.expanding[ref] = self.expanding.get(ref, 0) + 1
                    entered.append(ref)
                    siblings = _constraints(part, "$ref")
                    part = _merge(siblings, target, path) if siblings else target
                merged = _merge(merged, part, path)
            return self.node(merged, where if alone else path)
        finally:
            for ref in entered:
                self.expanding[ref] -= 1

    def _resolve(self, ref: object, path: str) -> tuple[object, str]:
        """The schema a `#...` JSON pointer names, and its path."""
        if not isinstance(ref, str) or (ref != "#" and not ref.startswith("#/")):
            raise _fail(
                path, f"$ref {ref!r}: only references within the schema (#/...) are supported"
            )
        target, where = self.root, ""
        for part in ref[2:].split("/") if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, Mapping) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise _fail(path, f"$ref {ref!r} points at nothing")
            where = _at(where, part)
        return target, where

    def _values(self, s: Mapping[str, Any], key: str, path: str) -> str | None:
        """const or enum: the values also valid for the schema's other keywords."""
        values = [s[key]] if key == "const" else _array_of(s, key, path)
        try:
            texts = [_dumps(v) for v in values]
        except (TypeError, ValueError) as e:
            raise _fail(path, f"{key!r} holds a value that is not JSON: {e}") from None
        if rest := _constraints(s, key):
            valid = re.compile(
                self.node(rest, path) or "(?!)", re.ASCII
            )  # (?!): Python's, nothing matches
            values = [v for v, text in zip(values, texts, strict=True) if valid.fullmatch(text)]
        return _alt([_literal(v, self.ws) for v in values])

    def _typed(self, kind: str, s: Mapping[str, Any], path: str) -> str | None:
        if kind in ("integer", "number"):
            low, high = _bounds(s, path)
            if kind == "integer":
                return integer_regex(
                    None
                    if low is None
                    else math.ceil(low[0])
                    if low[1]
                    else math.floor(low[0]) + 1,
                    None
                    if high is None
                    else math.floor(high[0])
                    if high[1]
                    else math.ceil(high[0]) - 1,
                )
            for value, _, key in filter(None, (low, high)):
                if not (isinstance(value, int) or value.is_integer()):
                    raise _fail(
                        path, f"{key!r} {value}: only whole-number bounds are supported for numbers"
                    )
            return number_regex(*(None if b is None else (int(b[0]), b[1]) for b in (low, high)))
        if kind in ("string", "array", "object"):
            return {"string": self._string, "array": self._array, "object": self._object}[kind](
                s, path
            )
        return "null" if kind == "null" else "(?:true|false)"

    def _string(self, s: Mapping[str, Any], path: str) -> str | None:
        low, high = _count(s, "minLength", path) or 0, _count(s, "maxLength", path)
        shape = "pattern" if "pattern" in s else "format" if "format" in s else None
        clashes = [k for k in ("minLength", "maxLength", "format") if k in s and k != shape]
        if shape and clashes:  # vLLM refuses lengths with these too
            raise _fail(path, f"{clashes[0]!r} with {shape!r} is not supported")
        if shape == "pattern":
            if not isinstance(s["pattern"], str):
                raise _fail(path, "'pattern' must be a string")
            content = _pattern(s["pattern"], path)
            return None if content is None else f'"{content}"'
        if shape == "format":
            if s["format"] not in FORMATS:
                raise _fail(
                    path, f"format {s['format']!r} is not supported (only {', '.join(FORMATS)})"
                )
            return f'"{FORMATS[s["format"]]}"'
        return None if high is not None and low > high else f'"{_repeat(CHAR, low, high)}"'

    def _array(self, s: Mapping[str, Any], path: str) -> str | None:
        low, high = _count(s, "minItems", path) or 0, _count(s, "maxItems", path)
        if s.get("uniqueItems", False) is not False and (high is None or high > 1):
            raise _fail(path, "'uniqueItems' is not supported (a regex cannot compare items)")
        if high is not None and low > high:
            return None
        key, rest_key, prefix = "items", "items", []
        if "prefixItems" in s or isinstance(
            s.get("items"), list
        ):  # 2020-12's tuples, and draft 7's
            key, rest_key = (
                ("prefixItems", "items") if "prefixItems" in s else ("items", "additionalItems")
            )
            prefix = _array_of(s, key, path)[:high]
        items = [self.node(p, _at(path, key, i)) for i, p in enumerate(prefix)]
        more = self.node(
            s[rest_key] if rest_key in s else s.get("unevaluatedItems", True), _at(path, rest_key)
        )
        if None in items or (more is None and low > len(items)):  # the prefix items are all written
            return None
        if not items:
            return _list(self.ws, r"\[", r"\]", more, low, high)
        k = len(items)
        tail = (
            ""
            if more is None
            else _repeat(
                f"{self.ws},{self.ws}{more}", max(low - k, 0), None if high is None else high - k
            )
        )
        return _sequence(self.ws, r"\[", r"\]", [*items[:-1], f"{items[-1]}{tail}"])  # type: ignore[list-item]

    def _object(self, s: Mapping[str, Any], path: str) -> str | None:
        properties, required = _properties(s, path), s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise _fail(path, "'required' must be an array of strings")
        extra = s.get("additionalProperties", s.get("unevaluatedProperties", True))
        low, high = _count(s, "minProperties", path) or 0, _count(s, "maxProperties", path)
        names = list(dict.fromkeys([*properties, *required]))
        if not names:  # a map
            value = self.node(extra, _at(path, "additionalProperties"))
            if (high is not None and low > high) or (value is None and low):
                return None
            return _map(self.ws, value, low, high)
        members = []
        for name in names:
            at = _at(path, "properties" if name in properties else "additionalProperties", name)
            value = self.node(properties.get(name, extra), at)
            if value is None and name in required:
                return None
            if value is not None:
                members.append(
                    (f"{escape(_dumps(name))}{self.ws}:{self.ws}{value}", name in required)
                )
        if low > sum(r for _, r in members) or (high is not None and high < len(members)):
            raise _fail(
                path,
                "'minProperties' and 'maxProperties' are supported only where the listed properties "
                "(the required ones always, no others) satisfy them",
            )
        return _members(self.ws, members)


def _members(ws: str, members: list[tuple[str, bool]]) -> str:
    """An object of `members` (regex, required) in order: the optional ones before the first
    required one by `_some`, each later one with its comma, optional or not."""
    first = next((i for i, (_, required) in enumerate(members) if required), len(members))
    later = "".join(
        _repeat(f"{ws},{ws}{m}", int(required), 1) for m, required in members[first + 1 :]
    )
    if first == len(members):  # all optional
        return (
            rf"\{{{ws}"
            + (f"(?:{_some(ws, [m for m, _ in members])}{ws})?" if members else "")
            + r"\}"
        )
    head = f"(?:{_some(ws, [m for m, _ in members[:first]])}{ws},{ws})?" if first else ""
    return rf"\{{{ws}{head}{members[first][0]}{later}{ws}\}}"


def _some(ws: str, members: list[str]) -> str:
    """At least one of the optional `members`, in order, comma-separated: `some` matches units
    1..j (a member or a run) with one written: 1..j-1 with one and any of j, or j with one. Runs
    of 16 keep the nesting shallow (the engine's parser recurses); a member is written 3 times
    up to 256 members, 4 up to 4096."""
    size = -(-len(members) // 16)
    runs = (
        [[m] for m in members]
        if size == 1
        else [members[i : i + size] for i in range(0, len(members), size)]
    )
    some = None
    for run in runs:
        first = run[0] if len(run) == 1 else _some(ws, run)
        some = (
            first
            if some is None
            else f"(?:{some}{''.join(f'(?:{ws},{ws}{m})?' for m in run)}|{first})"
        )
    return some or ""


def _constraints(s: Mapping[str, Any], *leave_out: str) -> dict[str, Any]:
    """`s` without its annotations and the keys left out."""
    return {
        k: v
        for k, v in s.items()
        if k not in _ANNOTATIONS and k not in leave_out and not k.startswith("x-")
    }


def _array_of(s: Mapping[str, Any], key: str, path: str) -> list[Any]:
    if not isinstance(s[key], list):
        raise _fail(path, f"{key!r} must be an array")
    return s[key]


def _properties(s: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    if not isinstance(s.get("properties", {}), Mapping):
        raise _fail(path, "'properties' must be an object")
    return s.get("properties", {})


def _type_list(types: object, path: str) -> list[str]:
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise _fail(path, "'type' must be a type name or a list of them")
    return types


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and (
        isinstance(value, int) or isinstance(value, float) and math.isfinite(value)
    )


def _count(s: Mapping[str, Any], key: str, path: str) -> int | None:
    """A count keyword's value (None if absent), at most MAX_COUNT."""
    value = s.get(key)
    if value is None:
        return None
    if not _is_number(value) or value < 0 or not (isinstance(value, int) or value.is_integer()):
        raise _fail(path, f"{key!r} must be a non-negative integer")
    if value > MAX_COUNT:
        raise _fail(path, f"{key!r} {value} is above the limit of {MAX_COUNT}")
    return int(value)


def _bounds(s: Mapping[str, Any], path: str) -> tuple[tuple[float, bool, str] | None, ...]:
    """The tightest lower and upper bound: (value, whether it is in the range, its keyword).
    exclusiveMinimum/Maximum as numbers (draft 6 on) or as booleans on minimum/maximum (draft 4)."""
    out = []
    for plain, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        found = []
        for key in (plain, exclusive):
            value = s.get(key)
            if value is None or (key == exclusive and isinstance(value, bool)):
                continue
            if not _is_number(value):
                raise _fail(path, f"{key!r} must be a number")
            found.append((value, key == plain and s.get(exclusive) is not True, key))
        sign = -1 if plain == "minimum" else 1  # the tightest: at equal values, the one left out
        out.append(min(found, key=lambda b: (sign * b[0], b[1]), default=None))
    return out[0], out[1]


def _merge(a: Mapping[str, Any] | bool, b: object, path: str) -> Mapping[str, Any] | bool:
    """The schema of what is valid for both `a` and `b` (allOf), for what this module writes:
    `required` unites, bounds tighten, `type`s intersect, properties meet (one side's property
    with the other's alike-named one, else its additionalProperties); other keywords must agree."""
    if a is False or b is False or b is True:
        return a if b is True else False
    if a is True:
        return b  # type: ignore[return-value]
    if not isinstance(b, Mapping):
        raise _fail(path, "a schema must be an object or a boolean")
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif key in _ANNOTATIONS or out[key] == value or key == "properties":
            continue
        elif (
            key in ("required", "allOf") and isinstance(value, list) and isinstance(out[key], list)
        ):
            out[key] = (
                list(dict.fromkeys([*out[key], *value]))
                if key == "required"
                else [*out[key], *value]
            )
        elif key in _SCHEMAS:
            out[key] = {"allOf": [out[key], value]}
        elif key in _LOWER_BOUNDS | _UPPER_BOUNDS and _is_number(out[key]) and _is_number(value):
            out[key] = (max if key in _LOWER_BOUNDS else min)(out[key], value)
        elif key == "type":
            ta, tb = _type_list(out[key], path), _type_list(value, path)
            out[key] = [t for t in ta if t in tb] + ["integer"] * (
                ("integer" in ta and "number" in tb) or ("number" in ta and "integer" in tb)
            )
            if not out[key]:
                return False
        else:
            raise _fail(
                path,
                f"'allOf' (or a $ref beside other keywords) with two different {key!r} is not supported",
            )
    if (
        "properties" in a or "properties" in b
    ):  # each side's property, else its additionalProperties
        pa, pb = _properties(a, path), _properties(b, path)
        out["properties"] = {
            name: _merge(
                pa.get(name, a.get("additionalProperties", True)),
                pb.get(name, b.get("additionalProperties", True)),
                _at(path, "properties", name),
            )
            for name in dict.fromkeys([*pa, *pb])
        }
    return out
