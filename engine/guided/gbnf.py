"""A grammar as Lark, the grammar language llguidance reads: GBNF (llama.cpp's, `root ::= ...`)
through llguidance's converter, Lark as it is."""

from __future__ import annotations

import re

from llguidance.gbnf_to_lark import gbnf_to_lark

_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)


def lark_of(grammar: str) -> str:
    """A grammar as Lark: GBNF (llama.cpp's, `root ::= ...`) converted, Lark taken as it is."""
    if "::=" not in grammar:
        return grammar
    try:
        return gbnf_to_lark(_ESCAPE.sub(_unicode_escape, grammar))
    except Exception as exc:  # the converter raises what its parser meets, named or not
        raise ValueError(f"not a GBNF grammar: {exc}") from None


def _unicode_escape(m: re.Match) -> str:
    """GBNF's \\uXXXX and \\UXXXXXXXX as llguidance's converter can pass on (it writes them as
    \\uXX, which its Lark reader refuses): the character itself where that is safe in a
    literal or class, \\xNN below 256; any other escape as it was."""
    escape = m.group(0)
    if escape[1] not in "uU":
        return escape
    c = chr(int(escape[2:], 16))
    if c.isalnum() or (not c.isascii() and c.isprintable()):
        return c
    return f"\\x{ord(c):02x}" if ord(c) < 256 else escape


__all__ = ["lark_of"]
