"""The texts in which none of some words occurs, as one regex of engine/regex_automaton.py's
dialect: a structural tag's free text, which may not hold a trigger, and any_text inside a tag,
which may not hold its end (engine/structural_tag.py).

The automaton of the words' prefixes (Aho-Corasick's: a state is the longest suffix of the text
that begins a word; a character that would complete a word has no edge) becomes a regex by
state elimination.
"""

from __future__ import annotations

from deltaserve.engine.grammar import _literal

MAX_WORD_CHARS = 256  # the words' total length: the automaton has a state per prefix


def text_without(words: list[str]) -> str:
    """The regex of the texts (newlines included) in which no word of `words` occurs; every
    text where `words` is empty."""
    if not words:
        return "[\\s\\S]*"
    if sum(map(len, words)) > MAX_WORD_CHARS or not all(words):
        raise ValueError(
            f"the strings to exclude must be non-empty, {MAX_WORD_CHARS} characters together at most"
        )
    prefixes = sorted({w[:k] for w in words for k in range(len(w))}, key=lambda p: (len(p), p))
    alphabet = sorted({c for w in words for c in w})

    def after(state: str, c: str) -> str | None:
        """The longest suffix of state + c that begins a word; None where a word ends there."""
        text = state + c
        if any(text.endswith(w) for w in words):
            return None
        return next(
            text[k:] for k in range(len(text) + 1) if text[k:] in prefixes or k == len(text)
        )

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
        edges[p][""] = (
            "[^" + "".join(_literal(c) for c in elsewhere) + "]" if elsewhere else "[\\s\\S]"
        )
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


__all__ = ["MAX_WORD_CHARS", "text_without"]
