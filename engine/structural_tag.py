"""A structural tag (vLLM's and SGLang's `structural_tag`, xgrammar's format) as one regex of
engine/regex_automaton.py's dialect, as tool calls like
`<function=get_weather>{"city": "Paris"}</function>` are constrained inside free text.

Two forms, as both servers take them in `response_format` and as JSON text in
`structured_outputs.structural_tag` / SGLang's `structural_tag`:
- the first: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (and SGLang's
  `at_least_one`), which is xgrammar's `triggered_tags` of tags holding JSON;
- `{"type": "structural_tag", "format": {...}}`: a tree of xgrammar's formats. Taken:
  `const_string`, `json_schema` (style "json"), `grammar`, `regex`, `any_text` (`excludes`),
  `sequence`, `or`, `optional`, `plus`, `star`, `repeat`, `tag` (an end or a list of ends),
  `triggered_tags` and `tags_with_separator` (`at_least_one`, `stop_after_first`). Refused by
  name: token-level formats, `dispatch`, the XML styles, `any_order`, length budgets.
Free text (`any_text`, the text between triggered tags) holds no trigger, no excluded string
and not the end of the tag around it (engine/free_text.py), as xgrammar stops it there. Each
triggered tag's `begin` starts with a trigger. Where xgrammar enters a tag at the first whole
trigger, this regex takes any split of the text that fits.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from deltaserve.engine.free_text import text_without
from deltaserve.engine.grammar import _literal
from deltaserve.engine.json_schema import schema_regex
from deltaserve.engine.regex_automaton import MAX_REPEAT, ByteAutomaton, RegexError

_REFUSED = {
    "token",
    "exclude_token",
    "any_tokens",
    "token_triggered_tags",
    "token_dispatch",
    "dispatch",
    "qwen_xml_parameter",
}


class StructuralTagError(ValueError):
    pass


def structural_tag_regex(spec: Any) -> str:
    """The regex of a structural tag (either form); StructuralTagError naming what is wrong and
    where."""
    if not isinstance(spec, dict):
        raise StructuralTagError(
            "a structural tag is an object: a format, or structures and triggers"
        )
    formats = _Formats()
    if "format" in spec:
        _keys(spec, {"type", "format"}, "the structural tag")
        return formats.compile(spec["format"], "format", ())
    _keys(spec, {"type", "structures", "triggers", "at_least_one"}, "the structural tag")
    try:
        return formats.compile(_legacy(spec), "", ())
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


class _Formats:
    def __init__(self) -> None:
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

    def compile(self, f: Any, at: str, ends: tuple[str, ...]) -> str:
        """The regex of format `f` (at path `at`); `ends`: the ends of the tag around it, which
        its free text may not hold."""
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
        return self.kinds[kind](f, where, ends)

    def _const_string(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        _keys(f, {"type", "value"}, at)
        return _text(_string(f, "value", at))

    def _json_schema(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        _keys(f, {"type", "json_schema", "style", "any_order"}, at)
        if f.get("style", "json") != "json" or f.get("any_order", False) is not False:
            raise StructuralTagError(
                f"{at}style and any_order: only JSON in the schema's order is supported"
            )
        try:
            return f"(?:{schema_regex({} if f.get('json_schema') is None else f['json_schema'])})"
        except ValueError as e:
            raise StructuralTagError(f"{at}json_schema: {e}") from None

    def _grammar(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        from deltaserve.engine.grammar import grammar_regex

        _keys(f, {"type", "grammar"}, at)
        try:
            return f"(?:{grammar_regex(_string(f, 'grammar', at))})"
        except ValueError as e:
            raise StructuralTagError(f"{at}grammar: {e}") from None

    def _regex(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        _keys(f, {"type", "pattern"}, at)
        pattern = _string(f, "pattern", at)
        try:
            ByteAutomaton(pattern)
        except RegexError as e:
            raise StructuralTagError(f"{at}pattern: {e}") from None
        return f"(?:{pattern})"

    def _any_text(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        _keys(f, {"type", "excludes", "max_tokens", "max_chars"}, at)
        if f.get("max_tokens") is not None or f.get("max_chars") is not None:
            raise StructuralTagError(f"{at}max_tokens and max_chars are not supported")
        return self._free(_strings(f, "excludes", at, required=False) + list(ends), at)

    def _sequence(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        return "".join(self._elements(f, at, ends))

    def _or(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        return f"(?:{'|'.join(self._elements(f, at, ends))})"

    def _repeat(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
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
            f, at, ends, f"{{{low},{'' if high == -1 else high}}}", {"min", "max"}
        )

    def _tag(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        _keys(f, {"type", "begin", "content", "end"}, at)
        end = f.get("end")
        closing = [end] if isinstance(end, str) else end
        if (
            not isinstance(closing, list)
            or not closing
            or not all(isinstance(e, str) for e in closing)
        ):
            raise StructuralTagError(f"{at}end must be a string or a non-empty list of strings")
        if "content" not in f:
            raise StructuralTagError(f"{at}content is required")
        content = self.compile(f["content"], f"{at}content", tuple(e for e in closing if e))
        tail = (
            _text(closing[0]) if len(closing) == 1 else f"(?:{'|'.join(_text(e) for e in closing)})"
        )
        return _text(_string(f, "begin", at)) + content + tail

    def _triggered_tags(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        _keys(f, {"type", "triggers", "tags", "at_least_one", "stop_after_first", "excludes"}, at)
        triggers = _strings(f, "triggers", at)
        tags = self._tags(f, at)
        for i, tag in enumerate(f["tags"]):
            if not any(tag["begin"].startswith(t) for t in triggers):
                raise StructuralTagError(
                    f"{at}tags[{i}].begin {tag['begin']!r} starts with none of the triggers"
                )
        free = self._free(triggers + _strings(f, "excludes", at, required=False) + list(ends), at)
        first, only = _flags(f, at)
        if only:  # the structure ends with its first tag
            return tags if first else f"{free}(?:{tags})?"
        return f"(?:{tags}{free})+" if first else f"{free}(?:{tags}{free})*"

    def _tags_with_separator(self, f: dict, at: str, ends: tuple[str, ...]) -> str:
        _keys(f, {"type", "tags", "separator", "at_least_one", "stop_after_first"}, at)
        tags, separator = self._tags(f, at), _text(_string(f, "separator", at))
        first, only = _flags(f, at)
        many = tags if only else f"{tags}(?:{separator}{tags})*"
        return many if first else f"(?:{many})?"

    # -- parts --------------------------------------------------------------------------------

    def _elements(self, f: dict, at: str, ends: tuple[str, ...]) -> list[str]:
        _keys(f, {"type", "elements"}, at)
        elements = f.get("elements")
        if not isinstance(elements, list) or not elements:
            raise StructuralTagError(f"{at}elements must be a non-empty list of formats")
        return [self.compile(e, f"{at}elements[{i}]", ends) for i, e in enumerate(elements)]

    def _repeated(
        self, f: dict, at: str, ends: tuple[str, ...], count: str, extra: set[str] = frozenset()
    ) -> str:
        _keys(f, {"type", "content", *extra}, at)
        if "content" not in f:
            raise StructuralTagError(f"{at}content is required")
        return f"(?:{self.compile(f['content'], f'{at}content', ends)}){count}"

    def _tags(self, f: dict, at: str) -> str:
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
        return (
            "(?:" + "|".join(self._tag(t, f"{at}tags[{i}].", ()) for i, t in enumerate(tags)) + ")"
        )

    def _free(self, words: list[str], at: str) -> str:
        try:
            return text_without(words)
        except ValueError as e:
            raise StructuralTagError(f"{at}{e}") from None


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


def _text(s: str) -> str:
    return "".join(_literal(c) for c in s)


__all__ = ["StructuralTagError", "structural_tag_regex"]
