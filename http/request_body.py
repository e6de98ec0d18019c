"""A request's JSON body, read as OpenAI and vLLM read it, every failure a 400 naming why."""

from __future__ import annotations

import json

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from deltaserve.http import errors


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
