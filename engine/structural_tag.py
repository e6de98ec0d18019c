"""A structural tag as one regex of engine/regex_automaton.py's dialect: free text in which
each trigger may appear only as the start of a tagged structure, `begin`, a JSON value of the
structure's schema, `end` (vLLM's and SGLang's `structural_tag`, xgrammar's triggered tags, as
tool calls like `<function=get_weather>{"city": "Paris"}</function>` are written).

The spec is the form both servers take in `response_format` and as JSON text in
`structured_outputs.structural_tag` / SGLang's `structural_tag`:
`{"structures": [{"begin": str, "schema": {...}, "end": str}, ...], "triggers": [str, ...]}`,
and SGLang's `at_least_one` (at least one structure). Each `begin` starts with a trigger, as
xgrammar requires. The output is `F (S F)*`: F the texts holding no trigger (made from the
automaton of the triggers' prefixes, Aho-Corasick's, by state elimination), S any structure.
"""

from __future__ import annotations

from typing import Any

from deltaserve.engine.grammar import _literal
from deltaserve.engine.json_schema import schema_regex

MAX_TRIGGER_CHARS = 256  # the triggers' total length: the free text's automaton has a state per prefix
_SPEC_KEYS = {"structures", "triggers", "at_least_one", "type"}


class StructuralTagError(ValueError):
    pass


def structural_tag_regex(spec: Any, whitespace: str | None = None) -> str:
    """The regex of a structural tag spec (a dict as above); StructuralTagError naming what is
    wrong. `whitespace`: the blanks between JSON tokens, as for a JSON schema."""
    if not isinstance(spec, dict):
        raise StructuralTagError("a structural tag is an object with structures and triggers")
    if "format" in spec:
        raise StructuralTagError("the 'format' form of structural tags is not supported (structures and "
                                 "triggers are)")  # fmt: skip
    if unknown := sorted(set(spec) - _SPEC_KEYS):
        raise StructuralTagError(f"unknown structural tag field {unknown[0]!r}")
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise StructuralTagError("triggers must be a non-empty list of non-empty strings")
    if sum(map(len, triggers)) > MAX_TRIGGER_CHARS:
        raise StructuralTagError(f"the triggers are longer than {MAX_TRIGGER_CHARS} characters together")
    structures = spec.get("structures")
    if not isinstance(structures, list) or not structures:
        raise StructuralTagError("structures must be a non-empty list of {begin, schema, end}")
    at_least_one = spec.get("at_least_one", False)
    if not isinstance(at_least_one, bool):
        raise StructuralTagError("at_least_one must be a boolean")
    tags = [_structure(s, i, triggers, whitespace) for i, s in enumerate(structures)]
    free = text_without(triggers)
    return f"{free}(?:(?:{'|'.join(tags)}){free})" + ("+" if at_least_one else "*")


def _structure(s: Any, i: int, triggers: list[str], whitespace: str | None) -> str:
    where = f"structures[{i}]"
    if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
        raise StructuralTagError(f"{where} must be an object with string begin and end")
    if unknown := sorted(set(s) - {"begin", "schema", "end"}):
        raise StructuralTagError(f"{where}: unknown field {unknown[0]!r}")
    if not any(s["begin"].startswith(t) for t in triggers):
        raise StructuralTagError(f"{where}.begin {s['begin']!r} starts with none of the triggers")
    schema = s.get("schema")
    if schema is None:
        schema = {}  # any JSON value
    try:
        body = schema_regex(schema, whitespace)
    except ValueError as e:
        raise StructuralTagError(f"{where}.schema: {e}") from None
    return _text(s["begin"]) + f"(?:{body})" + _text(s["end"])


def text_without(words: list[str]) -> str:
    """The regex of the texts (newlines included) in which no word of `words` occurs."""
    prefixes = sorted({w[:k] for w in words for k in range(len(w))}, key=lambda p: (len(p), p))
    alphabet = sorted({c for w in words for c in w})

    def after(state: str, c: str) -> str | None:
        """The longest suffix of state + c that begins a word; None where a word ends there."""
        text = state + c
        if any(text.endswith(w) for w in words):
            return None
        return next(text[k:] for k in range(len(text) + 1) if text[k:] in prefixes or k == len(text))

    # edges[p][q]: the class of characters from p to q (the ones outside the words' alphabet
    # lead back to the empty prefix); every state accepts
    edges: dict[str, dict[str, str]] = {}
    for p in prefixes:
        by_target: dict[str, list[str]] = {}
        for c in alphabet:
            if (q := after(p, c)) is not None:
                by_target.setdefault(q, []).append(c)
        elsewhere = [c for c in alphabet if c not in by_target.get("", [])]  # blocked or deeper
        edges[p] = {q: _chars(cs) for q, cs in by_target.items() if q != ""}
        edges[p][""] = "[^" + "".join(_literal(c) for c in elsewhere) + "]" if elsewhere else "[\\s\\S]"
    return _eliminate(edges, prefixes)


def _eliminate(edges: dict[str, dict[str, str]], states: list[str]) -> str:
    """Brzozowski's state elimination: each state's language X_p = ε | Σ a X_q, solved from the
    longest prefix down to the start, "" (Arden: X = A X | B gives X = A* B)."""
    ends = {p: "" for p in states}  # what may follow on the way out of p: ε
    for k in reversed(states[1:]):
        loop = edges[k].pop(k, None)
        star = f"(?:{loop})*" if loop else ""
        for i in edges:
            if i == k or k not in edges[i]:
                continue
            lead = edges[i].pop(k) + star
            for j, a in edges[k].items():
                edges[i][j] = _alt(edges[i].get(j), lead + a)
            ends[i] = _alt(ends[i], lead + ends[k])
        del edges[k]
    loop = edges[""].pop("", None)
    star = f"(?:{loop})*" if loop else ""
    return star + (f"(?:{ends['']})" if ends[""] else "")


def _alt(a: str | None, b: str) -> str:
    if a is None:
        return b
    if a == b:
        return a
    if a == "":
        return f"(?:{b})?"
    if b == "":
        return f"(?:{a})?"
    return f"(?:{a}|{b})"


def _chars(cs: list[str]) -> str:
    return _literal(cs[0]) if len(cs) == 1 else "[" + "".join(_literal(c) for c in cs) + "]"


def _text(s: str) -> str:
    return "".join(_literal(c) for c in s)


__all__ = ["StructuralTagError", "structural_tag_regex", "text_without"]
