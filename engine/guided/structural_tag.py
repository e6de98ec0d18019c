"""A structural tag (vLLM's and SGLang's `structural_tag`, xgrammar's format) as an llguidance
grammar, as tool calls like `<function=get_weather>{"city": "Paris"}</function>` are
constrained inside free text. llguidance has the parts (lazy lexemes, `%json`, and/not in
terminals) but reads no structural tag of this shape; this module only translates.

Two forms, as both servers take them in `response_format` and as JSON text in
`structured_outputs.structural_tag` / SGLang's `structural_tag`:
- the first: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (and SGLang's
  `at_least_one`), which is xgrammar's `triggered_tags` of tags holding JSON;
- `{"type": "structural_tag", "format": {...}}`: a tree of xgrammar's formats. Taken:
  `const_string`, `json_schema` (style "json"), `grammar`, `regex`, `any_text` (`excludes`),
  `sequence`, `or`, `optional`, `plus`, `star`, `repeat`, `tag` (an end or a list of ends),
  `triggered_tags` and `tags_with_separator` (`at_least_one`, `stop_after_first`). Refused by
  name: token-level formats, `dispatch`, the XML styles, `any_order`, length budgets.

Free text (`any_text`, the text between triggered tags) ends at the first string that may
follow it: its tag's end, the next trigger, or the string that starts the next element of a
sequence (a lazy lexeme: llguidance's lexer takes the longest match otherwise, and would
run past the end). It holds no trigger and no excluded string. Free text that nothing
literal follows is refused unless it ends the output. JSON inside a tag takes the blanks
grammar.py's WHITESPACE allows.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from llguidance import LLMatcher

from deltaserve.engine.guided.gbnf import lark_of
from deltaserve.engine.guided.runtime import error_summary

_REFUSED = {
    "token",
    "exclude_token",
    "any_tokens",
    "token_triggered_tags",
    "token_dispatch",
    "dispatch",
    "qwen_xml_parameter",
}
MAX_REPEAT = 1000  # a repeat's min and max at most (llguidance's rules grow as their log)
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


class StructuralTagError(ValueError):
    pass


def structural_tag_grammar(spec: Any, whitespace: str) -> str:
    """The llguidance grammar of a structural tag (either form), its JSON taking `whitespace`
    between tokens; StructuralTagError naming what is wrong and where."""
    if not isinstance(spec, dict):
        raise StructuralTagError(
            "a structural tag is an object: a format, or structures and triggers"
        )
    lark = _Lark(whitespace)
    if "format" in spec:
        _keys(spec, {"type", "format"}, "the structural tag")
        return lark.grammar(spec["format"], "format")
    _keys(spec, {"type", "structures", "triggers", "at_least_one"}, "the structural tag")
    try:
        return lark.grammar(_legacy(spec), "")
    except StructuralTagError as e:  # named as the first form names them
        message = re.sub(r"^tags\[(\d+)\]\.content\.json_schema", r"structures[\1].schema", str(e))
        raise StructuralTagError(re.sub(r"^tags\[(\d+)\]\.", r"structures[\1].", message)) from None


def _legacy(spec: dict[str, Any]) -> dict[str, Any]:
    """The first form as the triggered_tags format it stands for."""
    triggers = _strings(spec, "triggers", "")  # before the structures, as the first form is read
    structures = spec.get("structures")
    if not isinstance(structures, list) or not structures:
        raise StructuralTagError("structures must be a non-empty list of {begin, schema, end}")
    tags = []
    for i, s in enumerate(structures):
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("begin"), str)
            or not isinstance(s.get("end"), str)
        ):
            raise StructuralTagError(f"structures[{i}] must be an object with string begin and end")
        _keys(s, {"begin", "schema", "end"}, f"structures[{i}]")
        content = {"type": "json_schema", "json_schema": s.get("schema")}  # none: any JSON value
        tags.append({"begin": s["begin"], "content": content, "end": s["end"]})
    return {
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "at_least_one": spec.get("at_least_one", False),
    }


class _Lark:
    """Lark rules written while the format tree is walked. Each `_<kind>` returns the
    expression of its format followed by `tail` (a string expression that must follow it, the
    end of the tag around it; None: nothing, or what the caller appends), folding the tail
    into free text's lazy lexeme where the format ends in free text."""

    def __init__(self, whitespace: str) -> None:
        self.whitespace = whitespace
        self.rules: list[str] = []
        self.subgrammars: list[dict[str, str]] = []
        self.texts: dict[tuple[str, ...], str] = {}  # words -> the terminal of text without them
        self.kinds = {
            "const_string": self._const_string,
            "json_schema": self._json_schema,
            "grammar": self._grammar,
            "regex": self._regex,
            "any_text": self._any_text,
            "sequence": self._sequence,
            "or": self._or,
            "optional": functools.partial(self._repeated, count="?"),
            "plus": functools.partial(self._repeated, count="+"),
            "star": functools.partial(self._repeated, count="*"),
            "repeat": self._repeat,
            "tag": self._tag,
            "triggered_tags": self._triggered_tags,
            "tags_with_separator": self._tags_with_separator,
        }

    def grammar(self, f: Any, at: str) -> str:
        self.rules.insert(0, f"start: {self.compile(f, at, None)}")
        lark = "\n".join(self.rules) + "\n"
        if not self.subgrammars:
            return LLMatcher.grammar_from_lark(lark)
        return json.dumps({"grammars": [{"lark_grammar": lark}, *self.subgrammars]})

    def compile(self, f: Any, at: str, tail: str | None) -> str:
        if not isinstance(f, dict) or not isinstance(f.get("type", "tag"), str):
            raise StructuralTagError(f"{at or 'format'} must be a format object with a type")
        kind = f.get("type", "tag")  # xgrammar takes a typeless object as a tag first
        where = f"{at}." if at else ""
        if kind in _REFUSED:
            raise StructuralTagError(
                f"{where}type {kind!r} is not supported (text-level formats are)"
            )
        if kind not in self.kinds:
            raise StructuralTagError(f"{where}type {kind!r} is not a structural tag format")
        return self.kinds[kind](f, where, tail)

    def _name(self, prefix: str) -> str:
        return f"{prefix}_{len(self.rules) + len(self.subgrammars)}"

    # -- formats ----------------------------------------------------------------------------

    def _const_string(self, f: dict, at: str, tail: str | None) -> str:
        _keys(f, {"type", "value"}, at)
        return _then(_literal(_string(f, "value", at)), tail)

    def _json_schema(self, f: dict, at: str, tail: str | None) -> str:
        _keys(f, {"type", "json_schema", "style", "any_order"}, at)
        if f.get("style", "json") != "json" or f.get("any_order", False) is not False:
            raise StructuralTagError(
                f"{at}style and any_order: only JSON in the schema's order is supported"
            )
        schema = f.get("json_schema")
        schema = {} if schema is None or schema is True else schema
        if not isinstance(schema, dict):
            raise StructuralTagError(f"{at}json_schema: a schema object is needed")
        schema = {"x-guidance": {"whitespace_pattern": self.whitespace}, **schema}
        _check(LLMatcher.grammar_from_json_schema(schema), f"{at}json_schema")
        return _then(f"%json {json.dumps(schema)}", tail)

    def _grammar(self, f: dict, at: str, tail: str | None) -> str:
        _keys(f, {"type", "grammar"}, at)
        try:
            lark = lark_of(_string(f, "grammar", at))
        except ValueError as e:
            raise StructuralTagError(f"{at}grammar: {e}") from None
        _check(LLMatcher.grammar_from_lark(lark), f"{at}grammar")
        name = self._name("g")
        self.subgrammars.append({"name": name, "lark_grammar": lark})
        return _then(f"@{name}", tail)

    def _regex(self, f: dict, at: str, tail: str | None) -> str:
        _keys(f, {"type", "pattern"}, at)
        pattern = _string(f, "pattern", at)
        _check(LLMatcher.grammar_from_regex(pattern), f"{at}pattern")
        return _then(f"/{_slashed(pattern)}/", tail)

    def _any_text(self, f: dict, at: str, tail: str | None) -> str:
        _keys(f, {"type", "excludes", "max_tokens", "max_chars"}, at)
        if f.get("max_tokens") is not None or f.get("max_chars") is not None:
            raise StructuralTagError(f"{at}max_tokens and max_chars are not supported")
        return self._free(_strings(f, "excludes", at, required=False), tail)

    def _sequence(self, f: dict, at: str, tail: str | None) -> str:
        elements = self._elements(f, at)
        parts, i = [], 0
        while i < len(elements):
            last = i == len(elements) - 1
            if not last and _ends_free(elements[i]):  # the next element's string ends its text
                after = tail if i + 2 == len(elements) else None
                lead, rest = self._leading(elements[i + 1], f"{at}elements[{i + 1}]", after)
                parts += [self.compile(elements[i], f"{at}elements[{i}]", lead), rest]
                i += 2
            else:
                parts.append(
                    self.compile(elements[i], f"{at}elements[{i}]", tail if last else None)
                )
                i += 1
        return " ".join(p for p in parts if p)

    def _leading(self, f: Any, at: str, tail: str | None) -> tuple[str, str]:
        """(the string a format starts with, the rest of it, then `tail`): what ends the free
        text before it. A const_string or a tag, whose begin is that string."""
        kind = f.get("type", "tag") if isinstance(f, dict) else None
        if kind == "const_string":
            _keys(f, {"type", "value"}, at)
            lead, rest = _string(f, "value", at), tail or ""
        elif kind == "tag":
            lead, rest = self._tag_parts(f, at + ".", tail)
        else:
            lead = ""
        if not lead:
            raise StructuralTagError(
                f"{at} follows free text, so it must start with a string (a const_string or "
                "a tag with a begin)"
            )
        return _literal(lead), rest

    def _or(self, f: dict, at: str, tail: str | None) -> str:
        options = [
            self.compile(e, f"{at}elements[{i}]", tail) for i, e in enumerate(self._elements(f, at))
        ]
        return f"({' | '.join(options)})"

    def _repeat(self, f: dict, at: str, tail: str | None) -> str:
        low, high = f.get("min"), f.get("max")
        if (
            not _count(low)
            or not (_count(high) and high >= low or high == -1)
            or max(low, high) > MAX_REPEAT
        ):
            raise StructuralTagError(
                f"{at}min and max must be counts up to {MAX_REPEAT}, min <= max (max -1: no bound)"
            )
        return self._repeated(
            f, at, tail, f"{{{low},{'' if high == -1 else high}}}", {"min", "max"}
        )

    def _tag(self, f: dict, at: str, tail: str | None) -> str:
        begin, body = self._tag_parts(f, at, tail)
        return f"{_literal(begin)} {body}" if begin else body

    def _tag_parts(self, f: dict, at: str, tail: str | None) -> tuple[str, str]:
        """(its begin, the rest: content and end, then `tail`)."""
        _keys(f, {"type", "begin", "content", "end"}, at)
        end = f.get("end")
        closing = [end] if isinstance(end, str) else end
        if (
            not isinstance(closing, list)
            or not closing
            or not all(isinstance(e, str) for e in closing)
        ):
            raise StructuralTagError(f"{at}end must be a string or a non-empty list of strings")
        if "" in closing and len(closing) > 1:
            raise StructuralTagError(f"{at}end: an empty end beside others is not supported")
        if "content" not in f:
            raise StructuralTagError(f"{at}content is required")
        ends = [_literal(e) for e in closing if e]
        end_expr = None if not ends else ends[0] if len(ends) == 1 else f"({' | '.join(ends)})"
        body = self.compile(f["content"], f"{at}content", end_expr)
        return _string(f, "begin", at), _then(body, tail)

    def _triggered_tags(self, f: dict, at: str, tail: str | None) -> str:
        _keys(f, {"type", "triggers", "tags", "at_least_one", "stop_after_first", "excludes"}, at)
        triggers = _strings(f, "triggers", at)
        tags = self._tag_list(f, at)
        excludes = _strings(f, "excludes", at, required=False)
        first, only = _flags(f, at)
        whole, after_text = [], []
        for i, tag in enumerate(tags):
            trigger = next((t for t in triggers if tag["begin"].startswith(t)), None)
            if trigger is None:
                raise StructuralTagError(
                    f"{at}tags[{i}].begin {tag['begin']!r} starts with none of the triggers"
                )
            begin, body = self._tag_parts(tag, f"{at}tags[{i}].", None)
            whole.append(f"{_literal(begin)} {body}")
            lead = self._name("trigger")  # free text, up to the first trigger: this one's
            self.rules.append(f"{lead}[lazy]: {self._text(excludes)} {_literal(trigger)}")
            rest = begin[len(trigger) :]
            after_text.append(f"{lead} {_literal(rest)} {body}" if rest else f"{lead} {body}")
        whole_any, after_any = f"({' | '.join(whole)})", f"({' | '.join(after_text)})"
        rest = self._free(triggers + excludes, tail)  # the text after the last tag
        if only:  # the structure ends with its first tag
            return _then(whole_any, tail) if first else f"({rest} | {_then(after_any, tail)})"
        return f"{whole_any} {after_any}* {rest}" if first else f"{after_any}* {rest}"

    def _tags_with_separator(self, f: dict, at: str, tail: str | None) -> str:
        _keys(f, {"type", "tags", "separator", "at_least_one", "stop_after_first"}, at)
        tags = [self._tag(t, f"{at}tags[{i}].", None) for i, t in enumerate(self._tag_list(f, at))]
        one = f"({' | '.join(tags)})"
        separator = _literal(_string(f, "separator", at))
        first, only = _flags(f, at)
        many = one if only else f"{one} ({separator} {one})*"
        return _then(many if first else f"({many})?", tail)

    # -- parts --------------------------------------------------------------------------------

    def _elements(self, f: dict, at: str) -> list[Any]:
        _keys(f, {"type", "elements"}, at)
        elements = f.get("elements")
        if not isinstance(elements, list) or not elements:
            raise StructuralTagError(f"{at}elements must be a non-empty list of formats")
        return elements

    def _repeated(
        self,
        f: dict,
        at: str,
        tail: str | None,
        count: str,
        extra: set[str] = frozenset(),
    ) -> str:
        _keys(f, {"type", "content", *extra}, at)
        if "content" not in f:
            raise StructuralTagError(f"{at}content is required")
        if _ends_free(f["content"]):
            raise StructuralTagError(f"{at}content: free text cannot repeat")
        return _then(f"({self.compile(f['content'], f'{at}content', None)}){count}", tail)

    def _tag_list(self, f: dict, at: str) -> list[dict]:
        tags = f.get("tags")
        if not isinstance(tags, list) or not tags:
            raise StructuralTagError(f"{at}tags must be a non-empty list of tags")
        for i, tag in enumerate(tags):
            if (
                not isinstance(tag, dict)
                or tag.get("type", "tag") != "tag"
                or not isinstance(tag.get("begin"), str)
            ):
                raise StructuralTagError(f"{at}tags[{i}] must be a tag with a string begin")
        return tags

    def _free(self, words: list[str], tail: str | None) -> str:
        """Text holding none of `words`, then `tail`: one lazy lexeme that ends at the first
        `tail`; to the end of the output where there is none."""
        if tail is None:
            return self._text(words)
        name = self._name("text")
        self.rules.append(f"{name}[lazy]: {self._text(words)} {tail}")
        return name

    def _text(self, words: list[str]) -> str:
        """A terminal of any text holding none of `words` (llguidance's and/not, which only
        terminal definitions take), named once per set of words."""
        key = tuple(sorted(set(words)))
        if key not in self.texts:
            name = self.texts[key] = f"TEXT_{len(self.texts)}"
            if not key:
                self.rules.append(f"{name}: /(?s:.*)/")
            else:
                words_regex = "|".join(_regex_literal(w) for w in key)
                self.rules.append(f"{name}: /(?s:.*)/ & ~/(?s:.*)(?:{words_regex})(?s:.*)/")
        return self.texts[key]


def _ends_free(f: Any) -> bool:
    """Whether a format ends in free text (which only a following string can end)."""
    if not isinstance(f, dict):
        return False
    kind = f.get("type", "tag")
    if kind in ("any_text", "triggered_tags"):
        return True
    if kind == "sequence" and isinstance(f.get("elements"), list) and f["elements"]:
        return _ends_free(f["elements"][-1])
    if kind == "or" and isinstance(f.get("elements"), list):
        return any(_ends_free(e) for e in f["elements"])
    return False


def _then(expr: str, tail: str | None) -> str:
    return expr if tail is None else f"{expr} {tail}"


def _literal(s: str) -> str:
    """A Lark string literal (llguidance reads JSON's escapes)."""
    return json.dumps(s)


def _regex_literal(s: str) -> str:
    """`s` matched as it is, inside a /.../ regex."""
    return "".join(
        "\\" + c if c in _REGEX_META else "\\n" if c == "\n" else "\\r" if c == "\r" else c
        for c in s
    )


def _slashed(pattern: str) -> str:
    """A pattern inside /.../: its unescaped slashes and line breaks escaped."""
    out, escaped = [], False
    for c in pattern:
        if escaped:
            out.append(c)
            escaped = False
        elif c == "\\":
            out.append(c)
            escaped = True
        else:
            out.append("\\/" if c == "/" else "\\n" if c == "\n" else "\\r" if c == "\r" else c)
    return "".join(out)


def _check(grammar: str, at: str) -> None:
    """The part on its own must compile: its error then names where it is."""
    if error := LLMatcher.validate_grammar(grammar):
        raise StructuralTagError(f"{at}: {error_summary(error)}")


def _keys(f: dict, known: set[str], at: str) -> None:
    if unknown := sorted(set(f) - known):
        where = at.rstrip(".") or "the format"
        raise StructuralTagError(f"{where}: unknown field {unknown[0]!r}")


def _string(f: dict, key: str, at: str) -> str:
    if not isinstance(f.get(key), str):
        raise StructuralTagError(f"{at}{key} must be a string")
    return f[key]


def _strings(f: dict, key: str, at: str, required: bool = True) -> list[str]:
    value = f.get(key, None if required else [])
    if (
        not isinstance(value, list)
        or (required and not value)
        or not all(isinstance(s, str) and s for s in value)
    ):
        raise StructuralTagError(
            f"{at}{key} must be a {'non-empty ' * required}list of non-empty strings"
        )
    return list(value)


def _flags(f: dict, at: str) -> tuple[bool, bool]:
    """(at_least_one: no free text before the first tag, stop_after_first: nothing after it)."""
    first, only = f.get("at_least_one", False), f.get("stop_after_first", False)
    if not isinstance(first, bool) or not isinstance(only, bool):
        raise StructuralTagError(f"{at}at_least_one and stop_after_first must be booleans")
    return first, only


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


__all__ = ["StructuralTagError", "structural_tag_grammar"]
