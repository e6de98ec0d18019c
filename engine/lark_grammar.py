"""A Lark grammar read into engine/grammar.py's rules, so that the `grammar` vLLM's users send in
Lark's syntax (vLLM converts such a grammar to EBNF for xgrammar) guides as a GBNF one does.

Taken: definitions `name: ...` at the start of a line (rules and TERMINALS alike; a `?` or `!`
before the name and a `.priority` after it are read and dropped), alternatives `|` (on the
following lines too), `-> alias` (dropped), strings `"..."` (and `'...'`, as vLLM takes them; with
`i`: either case), ranges
`"a".."z"`, regexes `/.../` in engine/regex_automaton.py's dialect (no flags), `[...]` and `?`
(optional), `*`, `+`, `~ n` and `~ m..n`, groups `( )`, `//` comments, and `%import common.X`
(also `common.X -> Y` and `common (X, Y)`) of Lark's common terminals below. The root is
`start`, else the first definition (as vLLM's conversion picks it). `%ignore` is read and dropped, as vLLM's conversion drops it: the outputs carry no
ignored text between tokens, so two terminals that only it would part (`WORD WORD` under
`%ignore " "`) run together. Refused, naming line and column: templates, other directives,
imports from elsewhere, regex flags.
"""

from __future__ import annotations

import functools
import re

from deltaserve.engine.grammar import GrammarError, _Parser, _Token, check_references
from deltaserve.engine.regex_automaton import ByteAutomaton, RegexError

LARK_ROOT = "start"  # else the first definition
COMMON = "common."  # the prefix of Lark's common terminals among a grammar's rules
# A definition: at a line's start, [?!]name[.priority] then ':' (not GBNF's '::=').
_DEFINITION = re.compile(r"[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*:(?!:=)")
_DIRECTIVE = re.compile(r"[ \t]*%([A-Za-z_]+)([^\n]*)")
_IMPORT = re.compile(
    r"\s*common\s*(?:\.\s*([A-Z_][A-Z0-9_]*)\s*(?:->\s*([A-Za-z_][A-Za-z0-9_]*))?"
    r"|\(\s*([A-Z_][A-Z0-9_]*(?:\s*,\s*[A-Z_][A-Z0-9_]*)*)\s*,?\s*\))\s*(?://[^\n]*)?"
)
_TOKEN = re.compile(
    r"""
    (?P<blank>[ \t\r\f\v]+|\n|//[^\n]*)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<number>\d+)
  | (?P<punct>[()\[\]|*+?~{},])
""",
    re.VERBOSE,
)

# Lark's common.lark terminals, as it defines them (its ESCAPED_STRING by lookbehind: here the
# same strings, a backslash escaping the one character after it).
COMMON_TERMINALS = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+" | "-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e" | "E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+" | "-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+" | "-"] NUMBER
ESCAPED_STRING: "\"" /(?:[^"\\\n]|\\.)*/ "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_" | LETTER) ("_" | LETTER | DIGIT)*
WS_INLINE: (" " | /\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
"""


def looks_like_lark(grammar: str) -> bool:
    """No GBNF rule (`::=`) and a line that starts a Lark definition or directive."""
    return "::=" not in grammar and any(
        _DEFINITION.match(line) or _DIRECTIVE.match(line) for line in grammar.split("\n")
    )


def lark_rules(grammar: str) -> tuple[dict[str, tuple], str]:
    """engine/grammar.py's rules of a Lark grammar and its root; GrammarError naming where."""
    parser = _LarkParser(grammar)
    rules = parser.rules()
    defined = [name for name in rules if name not in parser.imports]
    if not defined:
        raise GrammarError("the Lark grammar defines nothing ('name: ...' at a line's start)")
    root = LARK_ROOT if LARK_ROOT in rules else defined[0]
    if parser.imports:
        rules |= _common_rules()
    check_references(
        rules, lambda ref: f" (import it: %import common.{ref})" * (COMMON + ref in _common_rules())
    )
    return rules, root


@functools.cache
def _common_rules() -> dict[str, tuple]:
    rules = _LarkParser(COMMON_TERMINALS).rules()
    return {COMMON + name: _prefixed(body) for name, body in rules.items()}


def _prefixed(node: tuple) -> tuple:
    kind = node[0]
    if kind == "ref":
        return ("ref", COMMON + node[1])
    if kind in ("seq", "alt"):
        return (kind, tuple(_prefixed(child) for child in node[1]))
    if kind == "repeat":
        return ("repeat", _prefixed(node[1]), *node[2:])
    return node


class _LarkParser(_Parser):
    """GBNF's parser (engine/grammar.py) with Lark's tokens and items."""

    def _tokens(self) -> list[_Token]:
        self.imports: dict[str, str] = {}  # name in the grammar -> common terminal
        out, at = [], 0
        while at < len(self.text):
            if at == 0 or self.text[at - 1] == "\n":
                if m := _DEFINITION.match(self.text, at):
                    out.append(_Token("define", m.group(1), at))
                    at = m.end()
                    continue
                if m := _DIRECTIVE.match(self.text, at):
                    self._directive(m.group(1), m.group(2), m.start(1) - 1)
                    at = m.end()
                    continue
            m = _TOKEN.match(self.text, at)
            if m is None:
                raise self.error(at, f"unexpected {self.text[at]!r}")
            if m.lastgroup != "blank":
                out.append(_Token(m.lastgroup, m.group(), at))
            at = m.end()
        return out

    def _directive(self, name: str, rest: str, at: int) -> None:
        if name == "ignore":
            return  # dropped (the module docstring says why)
        if name != "import":
            raise self.error(
                at, f"the directive %{name} is not supported (%import common.X and %ignore are)"
            )
        m = _IMPORT.fullmatch(rest)
        if m is None:
            raise self.error(
                at, f"%import{rest}: only Lark's common terminals are taken (%import common.X)"
            )
        names = (
            [(m.group(1), m.group(2) or m.group(1))]
            if m.group(1)
            else [(n.strip(), n.strip()) for n in m.group(3).split(",")]
        )
        for terminal, alias in names:
            if COMMON + terminal not in _common_rules():
                raise self.error(
                    at, f"common.{terminal} is not one of Lark's common terminals taken here"
                )
            self.imports[alias] = terminal

    def rules(self) -> dict[str, tuple]:
        rules: dict[str, tuple] = {
            alias: ("ref", COMMON + terminal) for alias, terminal in self.imports.items()
        }
        while (token := self.peek()) is not None:
            if token.kind != "define":
                raise self.error(
                    token.at,
                    f"expected a definition 'name: ...' at a line's start, got {token.text!r}",
                )
            if token.text in rules:
                raise self.error(token.at, f"'{token.text}' is defined twice")
            self.i += 1
            rules[token.text] = self.alternatives()
        return rules

    def sequence(self) -> tuple:
        items = []
        while (
            (token := self.peek()) is not None
            and token.text not in ("|", ")", "]")
            and token.kind != "define"
        ):
            if (
                token.kind == "arrow"
            ):  # an alias names the alternative's tree node: nothing to match
                alias = self.peek(1)
                if alias is None or alias.kind != "name":
                    raise self.error(token.at, "'->' needs an alias name after it")
                self.i += 2
                break
            items.append(self.repeated(self.primary()))
        return items[0] if len(items) == 1 else ("seq", tuple(items))

    def repeated(self, node: tuple) -> tuple:
        while (token := self.peek()) is not None and token.text in ("*", "+", "?", "~"):
            self.i += 1
            if token.text == "~":
                node = ("repeat", node, *self._count(token))
            else:
                node = ("repeat", node, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[token.text])
        return node

    def _count(self, tilde: _Token) -> tuple[int, int]:
        low = self.peek()
        if low is None or low.kind != "number":
            raise self.error(tilde.at, "'~' needs a count: item ~ n or item ~ m..n")
        self.i += 1
        high = low
        if (dots := self.peek()) is not None and dots.kind == "range":
            high = self.peek(1)
            if high is None or high.kind != "number":
                raise self.error(dots.at, "'..' needs the most after it")
            self.i += 2
        if int(high.text) < int(low.text):
            raise self.error(tilde.at, f"~ {low.text}..{high.text}: the most is below the least")
        return int(low.text), int(high.text)

    def primary(self) -> tuple:
        token = self.peek()
        self.i += 1
        if token.kind == "string":
            return self._string(token)
        if token.kind == "regex":
            return self._regex(token)
        if token.kind == "name":
            if (after := self.peek()) is not None and after.text == "{":
                raise self.error(token.at, f"templates ({token.text}{{...}}) are not supported")
            return ("ref", token.text)
        if token.text in ("(", "["):
            node = self.alternatives()
            close = ")" if token.text == "(" else "]"
            if (end := self.peek()) is None or end.text != close:
                raise self.error(token.at, f"this {token.text!r} is never closed")
            self.i += 1
            return node if close == ")" else ("repeat", node, 0, 1)
        raise self.error(token.at, f"unexpected {token.text!r}")

    def _string(self, token: _Token) -> tuple:
        fold = token.text.endswith("i")
        chars = self._characters(token.text[1 : -1 - fold], token.at)
        if (dots := self.peek()) is not None and dots.kind == "range":
            high = self.peek(1)
            if high is None or high.kind != "string" or high.text.endswith("i"):
                raise self.error(dots.at, 'a range is two one-character strings: "a".."z"')
            top = self._characters(high.text[1:-1], high.at)
            if len(chars) != 1 or len(top) != 1 or fold:
                raise self.error(token.at, 'a range is two one-character strings: "a".."z"')
            if top[0][0] < chars[0][0]:
                raise self.error(token.at, "this range is out of order")
            self.i += 2
            return ("chars", ((chars[0][0], top[0][0]),), False)
        text = "".join(chr(code) for code, _ in chars)
        if not fold:
            return ("lit", text)
        return ("seq", tuple(_either_case(c) for c in text))

    def _regex(self, token: _Token) -> tuple:
        body, _, flags = token.text[1:].rpartition("/")
        if flags:
            raise self.error(token.at, f"regex flags (/{body}/{flags}) are not supported")
        try:
            ByteAutomaton(body)  # the dialect's escapes take `\/` as '/'
        except RegexError as e:
            raise self.error(token.at, f"the regex /{body}/: {e}") from None
        return ("regex", body)


def _either_case(c: str) -> tuple:
    lower, upper = c.lower(), c.upper()
    if lower == upper or len(lower) != 1 or len(upper) != 1:
        return ("lit", c)
    return ("chars", ((ord(lower), ord(lower)), (ord(upper), ord(upper))), False)


__all__ = ["lark_rules", "looks_like_lark"]
