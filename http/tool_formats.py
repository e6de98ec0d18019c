"""The two tool-call formats Qwen models write, read out of a chat's content text as it
arrives, named as vLLM's `--tool-call-parser` values:

- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>`; the values are text, converted by the type the
  tool's JSON schema gives the parameter (vllm/tool_parsers/qwen3coder_tool_parser.py).
- `hermes` (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (vllm/tool_parsers/hermes_tool_parser.py).

Each format is a scanner, fed the text in deltas (`feed`, then `finish` at the end of the
output), that returns what each delta decided: content, then pieces of calls' arguments. It
reads from where the last delta left off, tag by tag, and keeps only what is undecided (a
tag a delta may have cut, a value not yet ended, in pieces), so a delta costs its own
length, not the text before it (a value is joined and converted once, when it ends); and what
it decides never depends on how the text was split: a whole text is one feed.

Where this differs from vLLM: vLLM's streaming and non-streaming paths disagree in places
(text after the calls, a call its non-streaming path rejects); here the non-streaming result
is the rule and the stream follows it. In that result:
- Content is the text before the first call; text after or between calls is dropped (as
  vLLM's non-streaming). A `<tool_call>` block that is not a call stays content.
- qwen3_coder: a block ends at its first `</tool_call>`, the function body at its first
  `</function>`, a value at the first `</parameter>` or `<parameter=` (vLLM's parser before it
  learned to skip such tags written inside a value); a block or value cut off by the end of the
  output still counts, as vLLM's. A repeated parameter keeps its first value (vLLM: the last).
  A `<function=` with an invalid name is no call and its text stays content (vLLM drops it).
- hermes: a block whose JSON is not an object with a string `name` and an object `arguments`
  is malformed. Malformed first block: the whole text is content, as vLLM's; a malformed block
  after valid calls ends the calls there (vLLM turns the whole text back into content, which
  its stream, having sent the earlier calls, cannot do).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"

# vLLM's _is_valid_function_name: a name with one of these is template text, not a call. The
# first of them ends the name, which is one if that is its ">".
_NAME_END = re.compile(r"[{}<>\"' \t\n\r]")
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})

Tag = str | re.Pattern[str]


class CallPiece(NamedTuple):
    """Text to append to call `index`'s arguments (JSON); `name` with the call's first."""

    index: int
    arguments: str
    name: str | None = None


class Decided(NamedTuple):
    """What a delta decided: content (the text before the first call), then calls' pieces."""

    content: str
    pieces: list[CallPiece]


def partial_tag_len(text: str, tags: Sequence[Tag], start: int = 0) -> int:
    """The length of the longest end of `text[start:]` that one of `tags` starts with: a tag
    a delta may have cut, held back until the next delta decides. The tags here have a "<"
    first and nowhere else, so only the end from the last "<" can be one."""
    longest = max((len(t) for t in tags if isinstance(t, str)), default=0)
    at = text.rfind("<", max(start, len(text) - longest + 1))
    if at < 0:
        return 0
    end = text[at:]
    cut = any(isinstance(t, str) and len(end) < len(t) and t.startswith(end) for t in tags)
    return len(end) if cut else 0


def dumps(value: Any) -> str:
    """JSON as vLLM writes arguments (`json.dumps(..., ensure_ascii=False)`); NaN refused."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


class UnreadText:
    """The text fed and not read yet, `text[pos:]`. `next` finds the first of some tags in
    it; each tag's search goes on from its last match, so one feed reads a character once per
    tag, and between feeds only the unread end (a cut tag) is kept and copied."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self._next: dict[Tag, int] = {}  # a tag's first match at or after pos; -1: none

    def add(self, delta: str) -> None:
        self.text = self.text[self.pos :] + delta
        self.pos = 0
        self._next.clear()

    def next(self, tags: Sequence[Tag]) -> tuple[int, Tag | None]:
        """Where the first of `tags` starts, and which (-1, None if none)."""
        first, found = -1, None
        for tag in tags:
            at = self._next.get(tag, -2)
            if -1 < at < self.pos or at == -2:
                if isinstance(tag, str):
                    at = self.text.find(tag, self.pos)
                else:
                    match = tag.search(self.text, self.pos)
                    at = match.start() if match else -1
                self._next[tag] = at
            if at >= 0 and (first < 0 or at < first):
                first, found = at, tag
        return first, found

    def take(self, end: int) -> str:
        """The text up to `end`, read."""
        piece = self.text[self.pos : end]
        self.pos = end
        return piece

    def rest(self, tags: Sequence[Tag], final: bool) -> str:
        """The rest of the text, read, but for an end that may start one of `tags`."""
        keep = 0 if final else partial_tag_len(self.text, tags, self.pos)
        return self.take(len(self.text) - keep)


# ---- qwen3_coder -------------------------------------------------------------------------

# Where the scan is. Outside blocks: "text"; a `<function=` outside them (models leave the
# wrapper out: vLLM takes it as the one call) is "bare_name", then "bare_body", held until
# the end, as a later `<tool_call>` makes it content. In a block: "head" (before its
# `<function=`), "name", then the call's "body", "key" and "value"; "skip" is the rest of a
# block that holds no more of a call.
_Qwen3Where = Literal[
    "text", "bare_name", "bare_body", "head", "name", "skip", "body", "key", "value"
]
# what ends each part (the first in the text of these)
_QWEN3_ENDS: dict[str, tuple[Tag, ...]] = {
    "text": (TOOL_CALL,),
    "bare_name": (_NAME_END,),
    "bare_body": (TOOL_CALL,),
    "head": (FUNCTION, END_TOOL_CALL),
    "name": (_NAME_END,),
    "skip": (END_TOOL_CALL,),
    "body": (PARAMETER, END_FUNCTION, END_TOOL_CALL),
    "key": (">", END_FUNCTION, END_TOOL_CALL),
    "value": (END_PARAMETER, PARAMETER, END_FUNCTION, END_TOOL_CALL),
}
_BY_CHARS = ("bare_name", "name", "key")  # the parts a character other than "<" can end
_BARE_ENDS = {  # a bare call's body has no block to end
    where: tuple(t for t in tags if t != END_TOOL_CALL) for where, tags in _QWEN3_ENDS.items()
}


class _Scanner:
    """What both formats' scanners share: deltas in (`feed`, then `finish` at the end), and
    out what each call decided. A delta with no "<" arriving while nothing is held unread is
    all in the current part (every tag starts with "<"), unless the part ends on a character
    (`_ends_on_plain_text`): then it is kept without a scan."""

    _unread: UnreadText
    _content: list[str]  # what this feed decided
    _pieces: list[CallPiece]

    def feed(self, text: str) -> Decided:
        unread = self._unread
        if unread.pos == len(unread.text) and "<" not in text and not self._ends_on_plain_text():
            self._keep(text)
        else:
            unread.add(text)
        return self._read(final=False)

    def finish(self) -> Decided:
        """The end of the output: what was held back is decided."""
        return self._read(final=True)

    def _decided(self) -> Decided:
        decided = Decided("".join(self._content), self._pieces)
        self._content, self._pieces = [], []
        return decided

    def _ends_on_plain_text(self) -> bool:
        return False

    def _keep(self, text: str) -> None:
        raise NotImplementedError

    def _read(self, final: bool) -> Decided:
        raise NotImplementedError


class Qwen3CoderScanner(_Scanner):
    """qwen3_coder calls in a text fed in deltas. A call is sent as it is read: its name and
    "{" once `<function=NAME>` is whole, each parameter when its value ends, "}" at the end
    of its body. Content is sent as soon as no later text can make it part of a call."""

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self._tools = tools
        self._unread = UnreadText()
        self._where: _Qwen3Where = "text"
        self._block_seen = False  # a <tool_call> anywhere: no bare call, calls are in blocks
        self._bare_seen = False  # the first <function= outside a block, the only bare call
        self._held: list[str] = []  # text read that is content unless it is a call
        self._bare_name = ""
        self._bare_body_from = 0  # where in _held a bare call's body starts
        self._words: list[str] = []  # the name, key or value being read
        self._key = ""
        self._num_calls = 0
        self._properties: Mapping[str, Any] = {}  # the schema of the call's tool
        self._keys_seen: set[str] = set()
        self._content: list[str] = []  # what this feed decided
        self._pieces: list[CallPiece] = []

    def _ends_on_plain_text(self) -> bool:
        return self._where in _BY_CHARS

    def _read(self, final: bool) -> Decided:
        while self._step(final):
            pass
        return self._decided()

    def _step(self, final: bool) -> bool:
        """Reads the part the scan is in up to what ends it, and goes on to the next part
        (True); False when the part goes on past the text fed so far."""
        ends = self._ends()
        at, tag = self._unread.next(ends)
        if tag is None:
            self._keep(self._unread.rest(ends, final))
            return final and self._at_end()
        self._keep(self._unread.take(at))
        if isinstance(tag, str):
            self._on_tag(tag)
        else:
            self._name_ended(self._unread.text[at])
        return True

    def _ends(self) -> tuple[Tag, ...]:
        where = self._where
        if where == "text" and not (self._block_seen or self._bare_seen):
            return (TOOL_CALL, FUNCTION)
        if where in ("body", "key", "value") and not self._block_seen:
            return _BARE_ENDS[where]
        return _QWEN3_ENDS[where]

    def _keep(self, text: str) -> None:
        """Text read in the current part, kept as the part says."""
        if not text:
            return
        where, before_calls = self._where, not self._num_calls
        if where in ("bare_name", "name", "key", "value"):
            self._words.append(text)
        if where in ("bare_name", "bare_body") or (where in ("head", "name") and before_calls):
            self._held.append(text)
        elif where in ("text", "skip") and before_calls:
            self._content.append(text)

    def _on_tag(self, tag: str) -> None:
        """`tag`, at the unread text's start, ends the current part."""
        where, unread = self._where, self._unread
        if where == "bare_body":  # a <tool_call>: the bare call was content; read it there
            self._release_held()
            self._where = "text"
            return
        if where == "key" and tag == ">":
            unread.take(unread.pos + 1)
            self._key, self._words = "".join(self._words), []
            self._where = "value"
            return
        if where == "value":
            self._add_parameter("".join(self._words))
        self._words = []
        unread.take(unread.pos + len(tag))
        if tag == TOOL_CALL:  # in "text"
            self._block_seen = True
            self._held = [TOOL_CALL]
            self._where = "head"
        elif where == "text":  # the first <function= outside a block
            self._bare_seen = True
            self._held = [FUNCTION]
            self._where = "bare_name"
        elif tag == FUNCTION:  # in "head"
            self._held.append(FUNCTION)
            self._where = "name"
        elif where in ("head", "skip"):  # </tool_call>: the block was no call
            self._held.append(END_TOOL_CALL)
            self._release_held()
            self._where = "text"
        elif tag == PARAMETER:
            self._where = "key"
        elif tag == END_PARAMETER:
            self._where = "body"
        else:  # </function> or </tool_call>: the call's body ends
            self._close_call()
            self._where = "skip" if tag == END_FUNCTION else "text"

    def _name_ended(self, char: str) -> None:
        """A function's name ended at `char`: a call if that is its ">" and it is not empty;
        else the block (or the bare `<function=`) is no call, and its text is content."""
        name = "".join(self._words)
        self._words = []
        if char != ">" or not name:
            self._release_held()
            self._where = "text" if self._where == "bare_name" else "skip"
            return
        self._unread.take(self._unread.pos + 1)
        if self._where == "bare_name":
            self._held.append(">")
            self._bare_name = name
            self._bare_body_from = len(self._held)
            self._where = "bare_body"
        else:
            self._held = []  # the content ends where the block starts
            self._open_call(name)
            self._where = "body"

    def _at_end(self) -> bool:
        """The end of the output, in the middle of a part: True to read on (a bare call's
        body, read now that no `<tool_call>` can follow it)."""
        where = self._where
        if where == "bare_body":
            body = "".join(self._held[self._bare_body_from :])
            self._held = []
            self._open_call(self._bare_name)
            self._unread.add(body)
            self._where = "body"
            return True
        if where == "value":
            self._add_parameter("".join(self._words))
        if where in ("body", "key", "value"):
            self._close_call()
        self._release_held()
        return False

    def _release_held(self) -> None:
        """What was held is no call: content (there is none after a call)."""
        if not self._num_calls:
            self._content.extend(self._held)
        self._held = []

    def _open_call(self, name: str) -> None:
        self._num_calls += 1
        self._properties = tool_properties(self._tools, name)
        self._keys_seen = set()
        self._pieces.append(CallPiece(self._num_calls - 1, "{", name))

    def _add_parameter(self, text: str) -> None:
        """A value read whole: its '"key": value' piece (", "-led after the first); each piece
        is `dumps` of its key and value, so they join to `dumps` of the arguments dict."""
        key = self._key
        if key in self._keys_seen:
            return
        value: Any = _strip_newline(text)
        if key in self._properties:
            value = convert_value(value, self._properties[key])
        piece = f"{dumps(key)}: {dumps(value)}"
        index = self._num_calls - 1
        self._pieces.append(CallPiece(index, ", " + piece if self._keys_seen else piece))
        self._keys_seen.add(key)

    def _close_call(self) -> None:
        self._pieces.append(CallPiece(self._num_calls - 1, "}"))


def _strip_newline(value: str) -> str:
    """The template writes each value between newlines: one is dropped at each end."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def tool_properties(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    """The JSON schema `properties` of the request's tool `name` ({} if none)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says, as vLLM's `_convert_param_value`: the
    text itself where it does not read as that type. Where vLLM fails the whole parse (a value
    JSON cannot hold: inf, a set), the text is kept."""
    kind, nullable = _schema_type(schema)
    null = value.lower() in ("null", "none")
    if nullable and null:
        return None
    if kind in _STRING_TYPES:
        return value
    if null:
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    if container:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            pass
        else:  # a JSON-quoted Python repr ("{'k': 'v'}"), as vLLM reads it
            return _literal(parsed) if isinstance(parsed, str) else _json_or(parsed, value)
    parsed = _literal(value)
    return _literal(parsed) if container and isinstance(parsed, str) else parsed


def _schema_type(schema: Any) -> tuple[str, bool]:
    """(type name, lower case; whether null is allowed): `type`, else the first non-null type
    of `anyOf`, else "string". A list of types is read as `anyOf` (vLLM reads its text)."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema and not isinstance(schema["type"], list):
        kind = str(schema["type"]).strip().lower()
        return kind, kind == "null"
    if "type" in schema:
        types = schema["type"]
    elif isinstance(schema.get("anyOf"), list):
        types = [
            option["type"]
            for option in schema["anyOf"]
            if isinstance(option, dict) and "type" in option
        ]
    else:
        return "string", False
    kinds = [str(t).strip().lower() for t in types]
    others = [k for k in kinds if k != "null"]
    return (others[0] if others else "string"), "null" in kinds


def _literal(text: str) -> Any:
    """A Python literal (vLLM's `ast.literal_eval` fallback) if JSON can hold it, else the
    text."""
    try:
        return _json_or(ast.literal_eval(text), text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def _json_or(value: Any, text: str) -> Any:
    try:
        dumps(value)
    except (TypeError, ValueError, RecursionError):
        return text
    return value


# ---- hermes ------------------------------------------------------------------------------

# "text" outside blocks, "json" in one; after a malformed block, "content" (the first: the
# whole text is content) or "done" (a later one: no more calls)
_HermesWhere = Literal["text", "json", "content", "done"]
_HERMES_ENDS: dict[str, tuple[Tag, ...]] = {
    "text": (TOOL_CALL,),
    "json": (END_TOOL_CALL,),
    "content": (),
    "done": (),
}


class HermesScanner(_Scanner):
    """hermes calls in a text fed in deltas: a call is sent whole when its block closes (its
    JSON is only read then); the text from the first `<tool_call>` is held until then."""

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self._unread = UnreadText()
        self._where: _HermesWhere = "text"
        self._block_seen = False
        self._held: list[str] = []  # the first block: content if it is malformed
        self._json: list[str] = []
        self._num_calls = 0
        self._content: list[str] = []  # what this feed decided
        self._pieces: list[CallPiece] = []

    def _read(self, final: bool) -> Decided:
        """At the end (`final`), a block not closed is read as it is."""
        unread = self._unread
        while True:
            ends = _HERMES_ENDS[self._where]
            at, tag = unread.next(ends)
            if tag is None:
                self._keep(unread.rest(ends, final))
                if final and self._where == "json":
                    self._block_ended("")
                break
            self._keep(unread.take(at))
            unread.take(at + len(tag))
            if self._where == "text":
                self._held = [TOOL_CALL] if not self._block_seen else []
                self._block_seen = True
                self._where = "json"
            else:
                self._block_ended(END_TOOL_CALL)
        return self._decided()

    def _keep(self, text: str) -> None:
        if not text:
            return
        if self._where == "json":
            self._json.append(text)
            if not self._num_calls:
                self._held.append(text)
        elif self._where == "content" or (self._where == "text" and not self._block_seen):
            self._content.append(text)

    def _block_ended(self, end_tag: str) -> None:
        call = _hermes_call("".join(self._json))
        self._json = []
        if call is not None:
            self._pieces.append(CallPiece(self._num_calls, call[1], call[0]))
            self._num_calls += 1
            self._where = "text"
        elif self._num_calls:
            self._where = "done"
        else:  # as vLLM's: the whole text stays content
            self._content.extend([*self._held, end_tag])
            self._where = "content"
        self._held = []


def _hermes_call(body: str) -> tuple[str, str] | None:
    """A block's (name, arguments JSON), None if it is malformed."""
    try:
        call = json.loads(body, parse_constant=_no_constant)
        if not isinstance(call, dict):
            return None
        name, arguments = call.get("name"), call.get("arguments")
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        return name, dumps(arguments)
    except (ValueError, RecursionError):  # not JSON, or a number JSON cannot hold (1e999)
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
