"""Typed readers of a request's JSON fields: each refuses a value of the wrong type with a
400 naming the field and what it got."""

from __future__ import annotations

from typing import Any, TypeVar

from deltaserve.http.errors import bad_request

_D = TypeVar("_D", bool, None)  # opt_bool's default: a bool, or None for "not given"


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def opt_int(obj: dict[str, Any], name: str, *, default: int | None = None) -> int | None:
    value = obj.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not is_int(value):
        raise bad_request(f"{name} must be an integer, got {json_type(value)} {value!r}", name)
    return value


def opt_float(obj: dict[str, Any], name: str, default: float) -> float:
    value = obj.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{name} must be a number, got {json_type(value)} {value!r}", name)
    try:
        return float(value)
    except OverflowError:  # an integer literal past the float range (json reads it exactly)
        raise bad_request(
            f"{name} must be a finite number, got an integer out of range", name
        ) from None


def opt_bool(obj: dict[str, Any], name: str, *, default: _D) -> bool | _D:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {json_type(value)} {value!r}", name)
    return value


def json_object(body: object) -> dict[str, Any]:
    """A request body that must be a JSON object."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}")
    return body


def opt_str(obj: dict[str, Any], name: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {json_type(value)}", name)
    return value


def json_type(value: object) -> str:
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
