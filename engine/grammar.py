"""An EBNF grammar as one regex of engine/regex_automaton.py's dialect, so that guided decoding
needs no second engine: GBNF, the dialect of llama.cpp and xgrammar, which vLLM's `grammar`
and SGLang's `ebnf` take.

A grammar whose rules never reach themselves is regular and becomes its exact regex. A
recursive one (nested parentheses, JSON) is bounded: a rule may be open at most MAX_DEPTH
times at once, 4 levels of nesting below the first (as free-form JSON nests 4 containers
here, engine/json_schema.py), so an output never nests deeper, and within that bound every string the grammar derives, and only
those, is allowed. Where the bound cuts a rule's every way out, that rule's alternatives go.

Syntax: rules `name ::= ...` (the grammar's root is `root`), alternatives `|`, sequences,
groups `( )`, string literals `"..."`, character classes `[a-z_]` and `[^...]` (escapes
`\\n \\t \\r \\\\ \\" \\] \\- \\xNN \\uNNNN \\UNNNNNNNN`), `.` (any character), rule references, the
quantifiers `* + ? {m} {m,} {m,n}`, and `#` comments. Anything else (xgrammar's lookahead
assertions among it) is an error naming its line and column. A grammar with no `::=` whose
lines start Lark definitions (`name: ...`) is read as Lark's instead (engine/lark_grammar.py).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.engine.regex_automaton import MAX_CODEPOINT

MAX_DEPTH = 5  # times a rule may be open at once: 4 levels of nesting below the first
MAX_PATTERN_CHARS = 500_000  # the regex a grammar may become
ROOT = "root"
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
_TOKEN = re.compile(
    r"""
    (?P<blank>\s+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.-]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<chars>\[(?:[^\]\\\n]|\\.)*\])
  | (?P<repeat>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<punct>[()|*+?.])
""",
    re.VERBOSE,
)


class GrammarError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str
    text: str
    at: int  # offset in the grammar


def grammar_regex(grammar: str) -> str:
    """The regex of `grammar`'s `root` (recursion bounded to MAX_DEPTH); GrammarError naming
    the problem and where."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError("the grammar is empty")
    from deltaserve.engine.lark_grammar import lark_rules, looks_like_lark

    if looks_like_lark(grammar):
        rules, root = lark_rules(grammar)
    else:
        rules, root = _Parser(grammar).rules(), ROOT
    if root not in rules:
        raise GrammarError(f"the grammar has no '{root}' rule (its rules: {', '.join(rules)})")
    pattern = _Compiler(rules).rule(root)
    if pattern is None:
        raise GrammarError(f"'{root}' derives no string within {MAX_DEPTH} levels of recursion")
    return pattern


# -- parsing: text -> rules of nested tuples ----------------------------------------------------
# ("lit", text) ("chars", ranges, negated) ("ref", name) ("seq", items) ("alt", options)
# ("repeat", node, low, high or None) ("regex", pattern in the automaton's dialect: Lark's)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = self._tokens()
        self.i = 0

    def _tokens(self) -> list[_Token]:
        out, at = [], 0
        while at < len(self.text):
            m = _TOKEN.match(self.text, at)
            if m is None:
                hint = " (GBNF's rules are 'name ::= ...'; a Lark grammar has no '::=')" * (
                    self.text[at] == ":"
                )
                raise self.error(at, f"unexpected {self.text[at]!r}{hint}")
            if m.lastgroup != "blank":
                out.append(_Token(m.lastgroup, m.group(), at))
            at = m.end()
        return out

    def error(self, at: int, what: str) -> GrammarError:
        line = self.text.count("\n", 0, at) + 1
        column = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return GrammarError(f"line {line}, column {column}: {what}")

    def peek(self, offset: int = 0) -> _Token | None:
        j = self.i + offset
        return self.tokens[j] if j < len(self.tokens) else None

    def rules(self) -> dict[str, tuple]:
        rules: dict[str, tuple] = {}
        while (token := self.peek()) is not None:
            after = self.peek(1)
            if token.kind != "name" or after is None or after.kind != "define":
                raise self.error(token.at, f"expected a rule 'name ::= ...', got {token.text!r}")
            if token.text in rules:
                raise self.error(token.at, f"rule '{token.text}' is defined twice")
            self.i += 2
            rules[token.text] = self.alternatives()
        check_references(rules)
        return rules

    def alternatives(self) -> tuple:
        options = [self.sequence()]
        while (token := self.peek()) is not None and token.text == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", tuple(options))

    def sequence(self) -> tuple:
        items = []
        while (token := self.peek()) is not None and token.text not in ("|", ")"):
            if (
                token.kind == "name"
                and (after := self.peek(1)) is not None
                and after.kind == "define"
            ):
                break  # the next rule
            items.append(self.repeated(self.primary()))
        return items[0] if len(items) == 1 else ("seq", tuple(items))

    def repeated(self, node: tuple) -> tuple:
        while (token := self.peek()) is not None and (
            token.text in ("*", "+", "?") or token.kind == "repeat"
        ):
            self.i += 1
            if token.kind == "repeat":
                low, comma, high = token.text.strip("{}").replace(" ", "").partition(",")
                bounds = (int(low), int(high) if high else None if comma else int(low))
                if bounds[1] is not None and bounds[1] < bounds[0]:
                    raise self.error(token.at, f"{token.text}: the most is below the least")
            else:
                bounds = {"*": (0, None), "+": (1, None), "?": (0, 1)}[token.text]
            node = ("repeat", node, *bounds)
        return node

    def primary(self) -> tuple:
        token = self.peek()
        self.i += 1
        if token.kind == "string":
            return (
                "lit",
                "".join(chr(code) for code, _ in self._characters(token.text[1:-1], token.at)),
            )
        if token.kind == "chars":
            negated = token.text.startswith("[^")
            return ("chars", self._class(token.text[1 + negated : -1], token.at), negated)
        if token.kind == "name":
            return ("ref", token.text)
        if token.text == ".":
            return ("chars", ((0, MAX_CODEPOINT),), False)
        if token.text == "(":
            node = self.alternatives()
            if (end := self.peek()) is None or end.text != ")":
                raise self.error(token.at, "this '(' is never closed")
            self.i += 1
            return node
        raise self.error(token.at, f"unexpected {token.text!r}")

    def _characters(self, body: str, at: int) -> list[tuple[int, bool]]:
        """Each character of a literal or class body, escapes read: (code point, escaped)."""
        out, j = [], 0
        while j < len(body):
            if body[j] != "\\":
                out.append((ord(body[j]), False))
                j += 1
                continue
            e = body[j + 1]
            width = {"x": 2, "u": 4, "U": 8}.get(e, 0)
            digits = body[j + 2 : j + 2 + width]
            if width and not (
                len(digits) == width
                and all(d in "0123456789abcdefABCDEF" for d in digits)
                and int(digits, 16) <= MAX_CODEPOINT
            ):
                raise self.error(at, f"\\{e} needs {width} hex digits of a code point")
            if not width and e.isalnum() and e not in _ESCAPES:
                raise self.error(at, f"the escape \\{e} is not GBNF's")
            out.append((int(digits, 16) if width else ord(_ESCAPES.get(e, e)), True))
            j += 2 + width
        return out

    def _class(self, body: str, at: int) -> tuple[tuple[int, int], ...]:
        """A class body's ranges: `a-z` spans; an escaped, first or last `-` is itself."""
        items, ranges, k = self._characters(body, at), [], 0
        while k < len(items):
            low = items[k][0]
            if k + 2 < len(items) and items[k + 1] == (ord("-"), False):
                high = items[k + 2][0]
                if high < low:
                    raise self.error(
                        at, f"the class range {chr(low)!r}-{chr(high)!r} is out of order"
                    )
                ranges.append((low, high))
                k += 3
            else:
                ranges.append((low, low))
                k += 1
        if not ranges:
            raise self.error(at, "an empty character class")
        return tuple(ranges)


def check_references(rules: dict[str, tuple], hint: Callable[[str], str] = lambda ref: "") -> None:
    """GrammarError for the first reference to a rule `rules` does not define (`hint(ref)`
    appended to its message)."""
    for name, body in rules.items():
        for ref in _references(body):
            if ref not in rules:
                raise GrammarError(
                    f"rule '{name}' refers to '{ref}', which is not defined{hint(ref)}"
                )


def _references(node: tuple) -> list[str]:
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind in ("seq", "alt"):
        return [ref for child in node[1] for ref in _references(child)]
    if kind == "repeat":
        return _references(node[1])
    return []


# -- compiling: rules -> regex ------------------------------------------------------------------


class _Compiler:
    def __init__(self, rules: dict[str, tuple]) -> None:
        self.rules = rules
        self.open: Counter[str] = Counter()  # rules being expanded, and how many times each
        self.recursive = sorted(_recursive_rules(rules))
        # a rule's regex depends only on how often each recursive rule is open: made once per state
        self.done: dict[tuple[str, tuple[int, ...]], str | None] = {}

    def rule(self, name: str) -> str | None:
        key = (name, tuple(self.open[r] for r in self.recursive))
        if key not in self.done:
            if self.open[name] >= MAX_DEPTH:
                return None
            self.open[name] += 1
            self.done[key] = self.node(self.rules[name])
            self.open[name] -= 1
        return self.done[key]

    def node(self, node: tuple) -> str | None:
        kind = node[0]
        if kind == "lit":
            pattern = "".join(_literal(c) for c in node[1])
        elif kind == "chars":
            pattern = (
                "["
                + "^" * node[2]
                + "".join(
                    _literal(chr(lo)) if lo == hi else f"{_literal(chr(lo))}-{_literal(chr(hi))}"
                    for lo, hi in node[1]
                )
                + "]"
            )
        elif kind == "regex":
            pattern = f"(?:{node[1]})"
        elif kind == "ref":
            inner = self.rule(node[1])
            pattern = None if inner is None else f"(?:{inner})"
        elif kind == "seq":
            parts = [self.node(child) for child in node[1]]
            pattern = None if None in parts else "".join(parts)
        elif kind == "alt":
            options = [p for p in (self.node(child) for child in node[1]) if p is not None]
            pattern = (
                None
                if not options
                else options[0]
                if len(options) == 1
                else f"(?:{'|'.join(options)})"
            )
        else:  # repeat
            inner, low, high = self.node(node[1]), node[2], node[3]
            if inner is None or inner == "" or high == 0:
                return "" if inner == "" or low == 0 else None
            count = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((low, high))
            count = count or (
                f"{{{low}}}" if low == high else f"{{{low},{'' if high is None else high}}}"
            )
            pattern = f"(?:{inner}){count}"
        if pattern is not None and len(pattern) > MAX_PATTERN_CHARS:
            raise GrammarError(
                f"the grammar grows past {MAX_PATTERN_CHARS} characters of regex with its "
                f"recursion bounded to {MAX_DEPTH} levels; simplify it"
            )
        return pattern


@functools.cache
def _literal(c: str) -> str:
    """One character in the regex dialect: itself, escaped, or by its code point."""
    if c.isascii() and c.isalnum():
        return c
    if c.isascii() and c.isprintable():
        return "\\" + c
    return f"\\U{ord(c):08X}"


def _recursive_rules(rules: dict[str, tuple]) -> set[str]:
    """The rules that can reach themselves through references."""
    reach = {name: set(_references(body)) for name, body in rules.items()}
    changed = True
    while changed:
        changed = False
        for seen in reach.values():
            more = set().union(*(reach[r] for r in seen)) - seen
            if more:
                seen |= more
                changed = True
    return {name for name, seen in reach.items() if name in seen}


__all__ = ["MAX_DEPTH", "GrammarError", "grammar_regex"]
