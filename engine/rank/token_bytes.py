"""Each token of the model's vocabulary as the bytes it writes, for guided decoding on rank 0.

The rank has no tokenizer loaded (the engine process tokenizes), and decoding token by token
would lose bytes: a byte-level BPE token may hold part of a UTF-8 character, which `decode`
turns into U+FFFD. So the bytes are read from tokenizer.json itself: byte-level vocabularies
(Qwen's, GPT-2's) spell each byte as one printable character (GPT-2's `bytes_to_unicode`
table, inverted here); SentencePiece-style ones write a space as U+2581 and a raw byte as
`<0xNN>`. Special added tokens write nothing a grammar can use (None); other added tokens
(Qwen's `<tool_call>`, `<think>`) write their text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def _byte_level_decoder() -> dict[int, int]:
    """GPT-2's printable stand-in for each byte, inverted (as a `str.translate` table to the
    byte's latin-1 character): bytes that print as themselves keep their character, the
    others take 256, 257, ... in byte order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_in = {b: b for b in kept}
    extra = 256
    for b in range(256):
        if b not in stand_in:
            stand_in[b] = extra
            extra += 1
    return {c: b for b, c in stand_in.items()}


def _uses_byte_level(spec: object) -> bool:
    if not isinstance(spec, dict):
        return False
    return spec.get("type") == "ByteLevel" or any(
        _uses_byte_level(d) for d in spec.get("decoders") or ()
    )


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


_DECODER = json.JSONDecoder()
_BLANK = re.compile(r"[ \t\n\r]*")
_WANTED = {"added_tokens": None, "decoder": None, "model": {"vocab": None}}


def _members(text: str, at: int, wanted: dict, stop_early: bool = True) -> tuple[dict, int | None]:
    """The members named in `wanted` (a nested dict: that member's own members, read the
    same way) of the JSON object at `text[at]`, and the index past the object, or None where
    the reading stopped once all were found. Other members are decoded and dropped.
    tokenizer.json writes `model.vocab` before `model.merges`, and decoding the merges was
    two thirds of decoding the whole file."""
    found: dict = {}
    at = _BLANK.match(text, at).end()
    if text[at : at + 1] != "{":
        raise ValueError(f"tokenizer.json: an object expected at character {at}")
    at += 1
    while not (stop_early and len(found) == len(wanted)):
        at = _BLANK.match(text, at).end()
        if text[at] == "}":
            return found, at + 1
        if text[at] == ",":
            at = _BLANK.match(text, at + 1).end()
        key, at = _DECODER.raw_decode(text, at)
        at = _BLANK.match(text, _BLANK.match(text, at).end() + 1).end()  # past the colon
        if isinstance(wanted.get(key), dict):
            last = len(found) == len(wanted) - 1  # every other member found: may stop inside
            found[key], at = _members(text, at, wanted[key], stop_early and last)
            if at is None:
                return found, None
        else:
            value, at = _DECODER.raw_decode(text, at)
            if key in wanted:
                found[key] = value
    return found, None


def read_token_bytes(model_dir: str | Path) -> list[bytes | None]:
    """Token id -> its bytes (None: a special token, or an id the tokenizer leaves unused)."""
    data, _ = _members((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"), 0, _WANTED)
    vocab: dict[str, int] | None = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        raise ValueError(f"{model_dir}/tokenizer.json: no model.vocab object")
    added = data.get("added_tokens") or []
    size = 1 + max([*vocab.values(), *(t["id"] for t in added)])
    out: list[bytes | None] = [None] * size
    if _uses_byte_level(data.get("decoder")):
        table = _byte_level_decoder()
        for token, i in vocab.items():
            spelled = token.translate(table)
            if max(spelled, default="\0") < "\u0100":  # else not a byte-level spelling
                out[i] = spelled.encode("latin-1")
    else:
        for token, i in vocab.items():
            out[i] = _sentencepiece_bytes(token)
    for t in added:
        out[t["id"]] = None if t.get("special") else t["content"].encode("utf-8")
    return out
