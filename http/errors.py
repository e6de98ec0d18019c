"""OpenAI-shaped API errors: `{"error": {"message", "type", "param", "code"}}`.

Raised anywhere in the request path (parsing, admission, the engine's `ParamError`s through
`refused_param`) and turned into a JSON response in one place (the server's error
middleware). Free of aiohttp so that the request parser stays pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from deltaserve.engine.sampling_params import ParamError


class ApiError(Exception):
    """A request failure with its HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


@contextmanager
def renamed_fields(renames: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """The chat route's refusals of a translated request (Responses, Messages), naming the
    fields the client sent: each (pattern, replacement) applied in order to message and param."""
    try:
        yield
    except ApiError as err:
        for pattern, name in renames:
            err.message = re.sub(pattern, name, err.message)
            err.param = err.param and re.sub(pattern, name, err.param)
        raise


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param, code=None)


def refused_param(exc: ParamError, names: Mapping[str, str] = {}) -> ApiError:
    """The engine's refusal of a parameter as a 400 naming the field the client sent: `names`
    maps the engine's name of a field (a SamplingParams field, "prompt") to the request's
    (chat: "logprobs" -> "top_logprobs", "prompt" -> "messages"), in the message too where it
    starts with it."""
    param = names.get(exc.param, exc.param)
    message = str(exc)
    if param != exc.param and message.startswith(exc.param):
        message = param + message[len(exc.param) :]
    return bad_request(message, param)


def unsupported(param: str, why: str) -> ApiError:
    """A parameter we cannot honour: refused, never silently ignored."""
    return ApiError(
        400,
        f"parameter '{param}' is not supported: {why}",
        type="invalid_request_error",
        param=param,
        code="unsupported_parameter",
    )


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "invalid or missing API key (send 'Authorization: Bearer <key>')",
        type="authentication_error",
        code="invalid_api_key",
    )


def model_not_found(requested: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"model '{requested}' does not exist; this server serves '{served}'",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )


def queue_full(message: str) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code="queue_full")


def engine_dead(reason: str | None) -> ApiError:
    return ApiError(
        503,
        f"the engine is dead: {reason or 'unknown reason'}",
        type="service_unavailable",
        code="engine_dead",
    )


def no_weights() -> ApiError:
    return ApiError(
        503,
        "no weights loaded: a level-2 sleep discarded them; load new ones "
        "(POST /update_weights_from_disk) before generating",
        type="service_unavailable",
        code="no_weights",
    )


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down and admits no new requests",
        type="service_unavailable",
        code="shutting_down",
    )
