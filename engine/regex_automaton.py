"""A regular expression as an automaton over bytes, its DFA built lazily.

Structured outputs (a choice, a regex, a JSON schema: engine/json_schema.py turns one into a
regex) constrain what a request may write. Tokens are byte strings, and a token may end
inside a character (byte-level BPE cuts UTF-8 sequences), so the automaton reads bytes: each
character class becomes the UTF-8 byte sequences that spell its characters (the construction
of Russ Cox's RE2 and Rust's regex-syntax `utf8` module), and the rank walks every token's
bytes through it at once (engine/rank/grammar_mask.py). DFA states are sets of NFA nodes,
made only when a walk first reaches them (RE2's lazy DFA): a JSON schema's full DFA can be
large, the part a generation visits is small.

The dialect is Python's `re` syntax, fully matched, minus what a finite automaton cannot do
or a guide should not: literals and escapes (`\\n \\t \\r \\f \\v \\xNN \\uNNNN
\\UNNNNNNNN`, a backslash before any other non-alphanumeric character), `\\d \\w \\s` and
their negations in their ASCII meanings (as ECMAScript, the JSON Schema `pattern` dialect),
`.` (any character but a newline), classes `[...]` and `[^...]`, groups `(...)` and
`(?:...)`, alternation, and greedy `* + ? {m} {m,} {,n} {m,n}`. Anchors, lookaround,
backreferences, lazy or possessive quantifiers, flags and named groups are refused.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: no UTF-8 spells them
# Bounded repeats are expanded into copies; a pattern may not grow the NFA past this.
MAX_NFA_NODES = 400_000
MAX_REPEAT = 1000
DEAD = 0  # the DFA state of no NFA node: nothing more can match
START = 1

_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")
_ASCII_CLASSES = {
    "d": [(0x30, 0x39)],
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "s": [(0x09, 0x0D), (0x20, 0x20)],
}
_CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


class RegexError(ValueError):
    pass


# -- the syntax tree: a set of characters, a sequence, alternatives, a repeat ----------------


@dataclass(frozen=True, slots=True)
class Chars:
    ranges: tuple[tuple[int, int], ...]  # sorted, disjoint code point ranges


@dataclass(frozen=True, slots=True)
class Concat:
    parts: tuple


@dataclass(frozen=True, slots=True)
class Alt:
    options: tuple


@dataclass(frozen=True, slots=True)
class Repeat:
    node: object
    low: int
    high: int | None  # None: unbounded


def _normalise(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out, low = [], 0
    for lo, hi in ranges:
        if lo > low:
            out.append((low, lo - 1))
        low = hi + 1
    if low <= MAX_CODEPOINT:
        out.append((low, MAX_CODEPOINT))
    return tuple(out)


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.s, self.i = pattern, 0

    def error(self, why: str) -> RegexError:
        return RegexError(f"regex {self.s!r} at position {self.i}: {why}")

    def parse(self) -> object:
        node = self.alternation()
        if self.i < len(self.s):
            raise self.error("unbalanced ')'")
        return node

    def alternation(self) -> object:
        options = [self.sequence()]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self) -> object:
        parts = []
        while self.i < len(self.s) and self.s[self.i] not in "|)":
            parts.append(self.repeat())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def repeat(self) -> object:
        node = self.atom()
        bounds = self.quantifier()
        if bounds is None:
            return node
        if self.i < len(self.s) and (self.s[self.i] in "*+?" or _COUNTED.match(self.s, self.i)):
            raise self.error("lazy, possessive or repeated quantifiers are not supported")
        return Repeat(node, *bounds)

    def quantifier(self) -> tuple[int, int | None] | None:
        if self.i >= len(self.s):
            return None
        c = self.s[self.i]
        if c in "*+?":
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        m = _COUNTED.match(self.s, self.i)
        if c != "{" or m is None or not (m.group(1) or m.group(3)):
            return None  # a literal '{', as Python reads it
        self.i = m.end()
        low = int(m.group(1) or 0)
        high = int(m.group(3)) if m.group(3) else (None if m.group(2) else low)
        if high is not None and high < low:
            raise self.error(f"min repeat {low} greater than max repeat {high}")
        if max(low, high or 0) > MAX_REPEAT:
            raise self.error(f"a counted repeat above {MAX_REPEAT} is not supported")
        return low, high

    def atom(self) -> object:
        c = self.s[self.i]
        self.i += 1
        if c == "(":
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.s.startswith("?", self.i):
                raise self.error("only plain '(...)' and '(?:...)' groups are supported")
            node = self.alternation()
            if self.i >= len(self.s) or self.s[self.i] != ")":
                raise self.error("missing ')'")
            self.i += 1
            return node
        if c == "[":
            return self.char_class()
        if c == ".":
            return Chars(((0, 9), (11, MAX_CODEPOINT)))
        if c == "\\":
            return Chars(self.escape())
        if c in "^$":
            raise self.error("anchors are not supported (the whole output is matched)")
        if c in "*+?":
            raise self.error("nothing to repeat")
        return Chars(((ord(c), ord(c)),))

    def escape(self) -> tuple[tuple[int, int], ...]:
        if self.i >= len(self.s):
            raise self.error("a trailing backslash")
        c = self.s[self.i]
        self.i += 1
        if c.lower() in _ASCII_CLASSES:
            ranges = _normalise(_ASCII_CLASSES[c.lower()])
            return _complement(ranges) if c.isupper() else ranges
        if c in _CONTROL_ESCAPES:
            code = ord(_CONTROL_ESCAPES[c])
        elif c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.s[self.i : self.i + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {width} hex digits")
            self.i += width
            code = int(digits, 16)
            if code > MAX_CODEPOINT:
                raise self.error(f"code point {code:#x} is past U+10FFFF")
        elif c.isalnum():
            raise self.error(f"the escape \\{c} is not supported")
        else:
            code = ord(c)
        return ((code, code),)

    def char_class(self) -> Chars:
        negate = self.s.startswith("^", self.i)
        self.i += negate
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.i >= len(self.s):
                raise self.error("missing ']'")
            c = self.s[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            low = self.class_item()
            if (
                self.s.startswith("-", self.i)
                and self.i + 1 < len(self.s)
                and self.s[self.i + 1] != "]"
            ):
                self.i += 1
                high = self.class_item()
                if (
                    len(low) != 1
                    or len(high) != 1
                    or low[0][0] != low[0][1]
                    or high[0][0] != high[0][1]
                ):
                    raise self.error("a class range needs single characters at both ends")
                if high[0][0] < low[0][0]:
                    raise self.error("a class range out of order")
                ranges.append((low[0][0], high[0][0]))
            else:
                ranges.extend(low)
        out = _normalise(ranges)
        return Chars(_complement(out) if negate else out)

    def class_item(self) -> tuple[tuple[int, int], ...]:
        c = self.s[self.i]
        self.i += 1
        if c == "\\":
            return self.escape()
        return ((ord(c), ord(c)),)


def parse(pattern: str) -> object:
    """The syntax tree of `pattern`: Chars, Concat, Alt and Repeat nodes; RegexError naming
    what the dialect does not take."""
    return _Parser(pattern).parse()


# -- UTF-8: a code point range as byte-range sequences -----------------------------------------


def _encode(code: int) -> bytes:
    return chr(code).encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=8192)  # a JSON schema's string classes ask for the same ranges often
def utf8_sequences(lo: int, hi: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Byte-range sequences whose concatenations are exactly the UTF-8 encodings of the code
    points lo..hi (surrogates left out): split the range until both ends encode to the same
    length and differ only in a suffix of whole 6-bit continuation ranges."""
    out: list[tuple[tuple[int, int], ...]] = []
    todo = [(lo, hi)]
    while todo:
        a, b = todo.pop()
        if a > b:
            continue
        if a <= SURROGATES[1] and b >= SURROGATES[0]:  # cut the surrogates out
            todo += [(a, SURROGATES[0] - 1), (SURROGATES[1] + 1, b)]
            continue
        for limit in (0x7F, 0x7FF, 0xFFFF):  # one encoded length each
            if a <= limit < b:
                todo += [(a, limit), (limit + 1, b)]
                break
        else:
            for k in range(1, 4):  # the low 6k bits: ranges of whole continuation bytes
                mask = (1 << (6 * k)) - 1
                if a & ~mask != b & ~mask:
                    if a & mask:
                        todo += [(a, a | mask), ((a | mask) + 1, b)]
                        break
                    if b & mask != mask:
                        todo += [(a, (b & ~mask) - 1), (b & ~mask, b)]
                        break
            else:
                out.append(tuple(zip(_encode(a), _encode(b), strict=True)))
    return tuple(out)


# -- the NFA over bytes, and its DFA made on demand -----------------------------------------


class ByteAutomaton:
    """A pattern's NFA (nodes with byte-range edges and epsilon edges; node 0 the start, one
    final node), and its DFA states as they are reached: state `DEAD` (no node) and `START`
    exist from the start. Raises RegexError for what the dialect does not take."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._edges: list[list[tuple[int, int, int]]] = []
        self._eps: list[list[int]] = []
        start = self._node()
        self._final = self._build(parse(pattern), start)
        self._prune()
        self._closures: dict[int, frozenset[int]] = {}
        cuts = sorted(
            {0, 256, *(b for es in self._edges for lo, hi, _ in es for b in (lo, hi + 1))}
        )
        # bytes no edge tells apart share a class: a DFA row is computed once per class
        self._class_of = [0] * 256
        self._reps = []
        for c, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            self._reps.append(a)
            self._class_of[a:b] = [c] * (b - a)
        self._sets: list[frozenset[int]] = []
        self._index: dict[frozenset[int], int] = {}
        self._rows: list[list[int] | None] = []
        self.accepting: list[bool] = []
        self._intern(frozenset())
        self._intern(self._closure(start))

    @property
    def num_states(self) -> int:
        return len(self._sets)

    def row(self, state: int) -> list[int]:
        """The state after each byte 0..255 from `state`."""
        row = self._rows[state]
        if row is None:
            targets: list[set[int]] = [set() for _ in self._reps]
            for n in self._sets[state]:
                for lo, hi, t in self._edges[n]:
                    reached = self._closure(t)
                    for c in range(
                        self._class_of[lo], self._class_of[hi] + 1
                    ):  # the classes of lo..hi
                        targets[c] |= reached
            by_class = [self._intern(frozenset(t)) for t in targets]
            row = self._rows[state] = [by_class[c] for c in self._class_of]
        return row

    def step(self, state: int, data: bytes) -> int:
        for b in data:
            if state == DEAD:
                break
            state = self.row(state)[b]
        return state

    def is_final(self, state: int) -> bool:
        """Accepting with no way on: the output is complete."""
        return self.accepting[state] and not any(self.row(state))

    def matches_nothing(self) -> bool:
        """No byte string takes the start to the final node (the start is DEAD: there is no
        START state, and the pattern cannot guide)."""
        return len(self._sets) <= START

    def _prune(self) -> None:
        """Drop the edges into nodes from which the final node cannot be reached (an empty
        class on the way: `a[^\x00-\U0010ffff]`), so that every DFA state but DEAD can still
        end in a match, and a guided output never walks into a dead end."""
        into: list[list[int]] = [[] for _ in self._edges]
        for n, (edges, eps) in enumerate(zip(self._edges, self._eps, strict=True)):
            for m in (*eps, *(t for _, _, t in edges)):
                into[m].append(n)
        live, todo = {self._final}, [self._final]
        while todo:
            for n in into[todo.pop()]:
                if n not in live:
                    live.add(n)
                    todo.append(n)
        for n in range(len(self._edges)):
            self._edges[n] = [e for e in self._edges[n] if e[2] in live]
            self._eps[n] = [m for m in self._eps[n] if m in live]

    def _intern(self, nodes: frozenset[int]) -> int:
        state = self._index.get(nodes)
        if state is None:
            state = self._index[nodes] = len(self._sets)
            self._sets.append(nodes)
            self._rows.append(None)
            self.accepting.append(self._final in nodes)
        return state

    def _closure(self, node: int) -> frozenset[int]:
        """The nodes `node` reaches by epsilon edges, only those that matter to a DFA state
        (with byte edges, or final): states equal in those are one state."""
        done = self._closures.get(node)
        if done is None:
            seen, todo = {node}, [node]
            while todo:
                for m in self._eps[todo.pop()]:
                    if m not in seen:
                        seen.add(m)
                        todo.append(m)
            done = self._closures[node] = frozenset(
                n for n in seen if self._edges[n] or n == self._final
            )
        return done

    def _node(self) -> int:
        if len(self._edges) >= MAX_NFA_NODES:
            raise RegexError(f"regex too large: its automaton passes {MAX_NFA_NODES} nodes")
        self._edges.append([])
        self._eps.append([])
        return len(self._edges) - 1

    def _build(self, node: object, start: int) -> int:
        """Thompson's construction: add `node`'s fragment from `start`, return its end. No
        fragment loops back to the `start` it was given, so alternatives may share it."""
        if isinstance(node, Chars):
            end, inner = self._node(), {}
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):
                    at = start
                    for k, (blo, bhi) in enumerate(seq):
                        if k == len(seq) - 1:
                            self._edges[at].append((blo, bhi, end))
                        else:  # sequences share their leading byte ranges
                            key = (at, blo, bhi)
                            if key not in inner:
                                inner[key] = self._node()
                                self._edges[at].append((blo, bhi, inner[key]))
                            at = inner[key]
            return end
        if isinstance(node, Concat):
            for part in node.parts:
                start = self._build(part, start)
            return start
        if isinstance(node, Alt):
            end = self._node()
            for option in node.options:
                self._eps[self._build(option, start)].append(end)
            return end
        assert isinstance(node, Repeat)
        for _ in range(node.low):
            start = self._build(node.node, start)
        end = self._node()
        self._eps[start].append(end)
        if node.high is None:
            loop = self._node()
            self._eps[start].append(loop)
            again = self._build(node.node, loop)
            self._eps[again] += [loop, end]
            return end
        for _ in range(node.high - node.low):  # each further copy optional
            start = self._build(node.node, start)
            self._eps[start].append(end)
        return end


def escape(text: str) -> str:
    """`text` as a regex of itself in this dialect."""
    return "".join(f"\\{c}" if c in '\\.^$*+?{}[]()|-/"' else c for c in text)


def choice_regex(choices: tuple[str, ...]) -> str:
    """The regex whose language is exactly `choices`."""
    return "(?:" + "|".join(escape(c) for c in choices) + ")"
