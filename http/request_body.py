"""A request's JSON body, read as OpenAI and vLLM read it, and decoded into the route's typed
msgspec struct: every failure a 400 naming the field.

The unknown-field policy of every route is here (`decode`), one rule for all:
- a field of the struct: null is "not given" (its default), unless its default is
  `msgspec.UNSET` (then null is a value of its own, as SGLang's max_new_tokens: up to the
  context);
- a field we do not honour, declared `only(default)` on the struct (what routers and clients
  send at their defaults, e.g. sglang-router's `"no_stop_trim": false`): that value or null
  is accepted, any other refused, naming it (we would not do what it asks);
- any other field (unknown to us): null is accepted (it asks for nothing), anything else
  refused, naming it, "unknown or unsupported";
and so at every depth the struct types (messages, their parts, stream_options, ...).

msgspec's decoder then checks the types and the constraints declared on the fields
(`msgspec.Meta`); its error's path (`$.messages[0].name`) becomes the 400's `param`: the path
up to its first index ("messages"), as the OpenAI routes have always named a message's field,
and the message names the whole path. A field may declare the words of its expected value
(`expect`), for errors at it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from deltaserve.http import errors

B = TypeVar("B", bound=msgspec.Struct)

# msgspec's names of types -> JSON's, for messages
_JSON_TYPES = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "str": "a string",
    "array": "an array",
    "object": "an object",
    "null": "null",
}
_ERROR = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def only(*allowed: object, why: str = "") -> msgspec.Meta:
    """A field we do not honour, taken only at the value(s) `allowed` (its default: what we do
    anyway) or null; any other is refused naming it, saying `why` (default: "only its
    default")."""
    return msgspec.Meta(extra={"only": allowed, "why": why})


def expect(words: str, **constraints: Any) -> msgspec.Meta:
    """The words for a field's expected value in the errors at it ("a non-empty list of
    messages"), with the field's msgspec constraints (min_length=1, ...)."""
    return msgspec.Meta(extra={"expected": words}, **constraints)


async def read_json(request: web.Request) -> object:
    try:
        raw = await request.read()  # raises 413 past client_max_size
    except RequestPayloadError as exc:  # e.g. a Content-Encoding its bytes do not decode by
        raise errors.bad_request(f"the request body could not be read: {exc}") from None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        body = _decode_non_finite(raw, exc)
        if body is not None:
            return body
        raise errors.bad_request(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec raises this, not DecodeError, for bad UTF-8
        raise errors.bad_request(
            f"the request body is not valid UTF-8 ({exc.reason}): JSON must be UTF-8"
        ) from None
    except RecursionError:  # msgspec's own depth limit: e.g. 100k nested arrays
        raise errors.bad_request("the request body's JSON is nested too deeply") from None


def _decode_non_finite(raw: bytes, exc: msgspec.DecodeError) -> object | None:
    """The body, when msgspec refused it only for a non-finite number (`NaN`, `Infinity`, or
    a float out of range such as 1e400, which Python's json module reads as nan / inf): the
    field checks then refuse that value naming its field. None for any other error."""
    if not (str(exc).startswith("Number out of range") or b"NaN" in raw or b"Infinity" in raw):
        return None
    try:
        body = json.loads(raw.decode("utf-8"))
        msgspec.json.encode(body)  # what else msgspec refuses (lone surrogates) stays refused
    except (ValueError, RecursionError):  # UnicodeError and JSONDecodeError are ValueErrors
        return None
    return body


def decode(body: object, body_type: type[B]) -> B:
    """`body` (a JSON value) as `body_type`, the policy above applied; an ApiError (400)
    naming the field otherwise."""
    if not isinstance(body, dict):
        got = _json_type(body)
        raise errors.bad_request(f"the request body must be a JSON object, got {got}")
    info = _type_info(body_type)
    kept = _kept(info, body, "")
    try:
        return msgspec.convert(kept, body_type)
    except msgspec.ValidationError as exc:
        raise _refusal(str(exc), info, kept) from None


@functools.cache
def _type_info(body_type: type) -> mi.Type:
    return mi.type_info(body_type)


# ---- the policy ----------------------------------------------------------------------------


def _kept(info: mi.Type, value: object, path: str) -> object:
    """`value` with what the policy drops dropped (a copy), refusing what it refuses; a struct's
    integral number where an integer (only) is expected taken as one, as vLLM's pydantic takes
    2.0 for 2 (a list's items are left to msgspec: token ids stay integers)."""
    info, _ = _unwrapped(info, value)
    if isinstance(info, mi.StructType) and isinstance(value, dict) and _tagged(info, value):
        fields = {f.encode_name: f for f in info.fields}
        out = {}
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            field = fields.get(key)
            if key == info.tag_field:
                out[key] = item
            elif field is None:
                if item is not None:
                    raise _unknown(where, path, info)
            elif item is not None or field.default is msgspec.UNSET:
                _check_only(field.type, item, where)
                out[key] = _kept(field.type, item, where)
        return out
    if isinstance(info, mi.ListType) and isinstance(value, list) and _holds_structs(info):
        return [_kept(info.item_type, item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(info, mi.IntType) and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _holds_structs(info: mi.Type) -> bool:
    """Whether values of `info` may hold structs (only those the policy walks: a list of a
    million token ids is left to msgspec)."""
    if isinstance(info, mi.Metadata):
        return _holds_structs(info.type)
    if isinstance(info, mi.UnionType):
        return any(_holds_structs(t) for t in info.types)
    if isinstance(info, mi.ListType):
        return _holds_structs(info.item_type)
    return isinstance(info, mi.StructType)


def _check_only(info: mi.Type, value: object, where: str) -> None:
    if not _is_only(info) or value is None or any(_same(value, a) for a in info.extra["only"]):
        return
    shown = " or ".join(f"{where}={json.dumps(a)}" for a in info.extra["only"])
    raise errors.unsupported(where, info.extra["why"] or f"only its default ({shown}) is supported")


def _same(value: object, allowed: object) -> bool:
    """JSON's equality: 1 is not true, false is not 0."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return type(value) is type(allowed) and value == allowed


def _unknown(where: str, path: str, info: mi.StructType) -> errors.ApiError:
    if not path:
        return errors.unsupported(where, "unknown or unsupported parameter")
    carried = [f.encode_name for f in info.fields if not _is_only(f.type)]
    if info.tag_field:
        carried.insert(0, info.tag_field)
    listed = ", ".join(carried[:-1]) + f" and {carried[-1]}" if len(carried) > 1 else carried[0]
    return errors.unsupported(where, f"unknown field: {path} carries only {listed}")


def _is_only(info: mi.Type) -> bool:
    return isinstance(info, mi.Metadata) and "only" in (info.extra or {})


# ---- the decoder's errors ------------------------------------------------------------------


def _refusal(error: str, info: mi.Type, body: dict[str, Any]) -> errors.ApiError:
    """msgspec's error as the 400 naming the field: `param` the path up to its first index."""
    match = _ERROR.match(error)
    what, raw_path = match["what"], match["path"] or ""
    path = raw_path.lstrip(".")
    param = re.split(r"\[", path, maxsplit=1)[0] or None
    where = path or "the request body"
    if missing := re.match(r"Object missing required field `(.+)`", what):
        field = f"{path}.{missing[1]}" if path else missing[1]
        return errors.bad_request(f"{field} is required", param or missing[1])
    if what.startswith("Number out of range"):
        return errors.bad_request(f"{where} must be a finite number, got one out of range", param)
    declared = _type_at(info, body, raw_path)
    expected = _expected_words(declared)
    if invalid := re.match(r"Invalid (?:enum )?value (.+)", what):
        got = invalid[1]
        parent_path, _, tag_field = raw_path.rpartition(".")
        tags = _tags(_type_at(info, body, parent_path))
        parent = parent_path.lstrip(".") or "the request body"
        if tags and tag_field == "type":  # a kind of thing (a content part, a tool) not served
            return errors.unsupported(path, f"only {tag_field} {tags}, got {got}")
        if tags:
            return errors.bad_request(f"{parent} needs {tag_field} {tags}; {where} is {got}", param)
        return errors.bad_request(
            f"{where} must be {expected or 'another value'}, got {got}", param
        )
    if typed := re.match(r"Expected `(.+?)`(.*?)(?:, got `(.+)`)?$", what):
        words = expected or _type_words(typed[1]) + typed[2]
        got = f", got {_JSON_TYPES.get(typed[3], typed[3])}" if typed[3] else ""
        return errors.bad_request(f"{where} must be {words}{got}", param)
    return errors.bad_request(f"{where}: {what}", param)


def _type_words(types: str) -> str:
    """msgspec's `int | null` as "an integer or null"."""
    names = [_JSON_TYPES.get(t.strip(), t.strip()) for t in types.split("|")]
    return " or ".join(names)


def _type_at(info: mi.Type, body: object, raw_path: str) -> mi.Type | None:
    """The declared type at `raw_path` (msgspec's `.messages[0].name`) of `body`, metadata
    and union as declared; None where the path leaves the types."""
    value: object = body
    for name, index in _PATH_PART.findall(raw_path):
        info, _ = _unwrapped(info, value)
        if name and isinstance(info, mi.StructType):
            field = next((f for f in info.fields if f.encode_name == name), None)
            if field is None:
                return None
            info, value = field.type, value.get(name) if isinstance(value, dict) else None
        elif index and isinstance(info, mi.ListType):
            info = info.item_type
            value = value[int(index)] if isinstance(value, list) and index.isdigit() else None
        elif index and isinstance(info, mi.DictType):
            info, value = info.value_type, None
        else:
            return None
    return info


def _expected_words(info: mi.Type | None) -> str | None:
    """The `expect` words declared on a field's type, if any."""
    return (info.extra or {}).get("expected") if isinstance(info, mi.Metadata) else None


def _tags(info: mi.Type | None) -> str:
    """The tags a union of tagged structs (or one) takes, as "'user' or 'assistant'"."""
    while isinstance(info, mi.Metadata):
        info = info.type
    members = info.types if isinstance(info, mi.UnionType) else (info,)
    tags = [repr(m.tag) for m in members if isinstance(m, mi.StructType) and m.tag is not None]
    return ", ".join(tags[:-1]) + f" or {tags[-1]}" if len(tags) > 1 else "".join(tags)


def _unwrapped(info: mi.Type, value: object) -> tuple[mi.Type, mi.Metadata | None]:
    """The type `value` decodes as: its metadata unwrapped, its union's member chosen (the
    struct whose tag it carries, else the one of its JSON kind)."""
    meta = None
    while True:
        if isinstance(info, mi.Metadata):
            meta, info = info, info.type
        elif isinstance(info, mi.UnionType):
            info = _member(info, value)
        else:
            return info, meta


def _member(union: mi.UnionType, value: object) -> mi.Type:
    """The member of `union` that `value` decodes as (any: msgspec then says why not)."""
    inners = [(m, m.type if isinstance(m, mi.Metadata) else m) for m in union.types]
    for member, inner in inners:
        if isinstance(value, dict) and isinstance(inner, mi.DictType):
            return member
        if isinstance(value, dict) and isinstance(inner, mi.StructType) and _tagged(inner, value):
            return member
        if isinstance(value, list) and isinstance(inner, mi.ListType):
            return member
    if isinstance(value, int | float) and not isinstance(value, bool):
        kinds = (
            (mi.FloatType, mi.IntType) if isinstance(value, float) else (mi.IntType, mi.FloatType)
        )
        for kind in kinds:  # a float decodes as a float where it may
            for member, inner in inners:
                if isinstance(inner, kind):
                    return member
    return mi.AnyType()


def _tagged(info: mi.StructType, value: dict[str, Any]) -> bool:
    """Whether `value` carries the struct's tag (an untagged struct: any object)."""
    return info.tag_field is None or value.get(info.tag_field) == info.tag


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
