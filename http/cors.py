"""CORS as `vllm serve` answers it: vLLM wraps its app in Starlette's CORSMiddleware with
--allowed-origins, --allowed-methods, --allowed-headers (each ["*"] by default) and
--allow-credentials (off), so that chat UIs in a browser may call the server from another origin.

The rules are Starlette's (starlette/middleware/cors.py, 1.0):
- A request without Origin is left alone.
- A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered here, before
  the API key is checked (a browser sends no key with it): 200 "OK", or 400 "Disallowed CORS
  origin, method, headers, private-network" naming what is not allowed; either way with the
  allowed methods, the allowed headers and Access-Control-Max-Age 600.
- Any other response to a request with Origin (errors and 401s too, SSE streams too) gets
  Access-Control-Allow-Origin: `*` when every origin is allowed and credentials are not; the
  request's Origin, with Vary: Origin, when it is allowed otherwise; none for an origin not
  allowed. Plus Access-Control-Allow-Credentials: true with --allow-credentials.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

# what "*" in allowed_methods stands for (Starlette's list)
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
# the request headers a browser may always send, so always allowed
SAFELISTED_HEADERS = frozenset({"Accept", "Accept-Language", "Content-Language", "Content-Type"})
MAX_AGE_S = 600


def cors_list(name: str, value: object) -> tuple[str, ...]:
    """`value` (a list of strings, as the flags' JSON gives it) as a tuple; ValueError naming
    `name` for anything else (a bare string would be read letter by letter)."""
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Sequence)
        or not all(isinstance(v, str) for v in value)
    ):
        raise ValueError(f'{name} must be a list of strings such as ["*"], got {value!r}')
    return tuple(value)


def _is_preflight(request: web.BaseRequest) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


class Cors:
    """The policy, with the headers that do not depend on the request worked out once.
    `middleware` must come first in the app's list (it answers preflights before the API key is
    asked for); `on_response_prepare` goes on the app's signal of that name, so that every
    response, streamed ones included, gets its headers just before they are sent."""

    def __init__(
        self,
        origins: Sequence[str],
        methods: Sequence[str],
        headers: Sequence[str],
        credentials: bool,
    ) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)
        self.methods = ALL_METHODS if "*" in methods else tuple(methods)
        self.any_header = "*" in headers
        allowed_headers = sorted(SAFELISTED_HEADERS | set(headers))
        self.headers = frozenset(h.lower() for h in allowed_headers)
        # a browser refuses "*" on a request sent with credentials: then the origin is echoed
        self.echo_origin = not self.any_origin or credentials

        self.simple_headers: dict[str, str] = {}
        if self.any_origin:
            self.simple_headers["Access-Control-Allow-Origin"] = "*"
        if credentials:
            self.simple_headers["Access-Control-Allow-Credentials"] = "true"

        preflight = {"Vary": "Origin"} if self.echo_origin else {"Access-Control-Allow-Origin": "*"}
        preflight["Access-Control-Allow-Methods"] = ", ".join(self.methods)
        preflight["Access-Control-Max-Age"] = str(MAX_AGE_S)
        if not self.any_header:
            preflight["Access-Control-Allow-Headers"] = ", ".join(allowed_headers)
        if credentials:
            preflight["Access-Control-Allow-Credentials"] = "true"
        self.preflight_headers = preflight

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if _is_preflight(request):
            return self.preflight(request)
        return await handler(request)

    def preflight(self, request: web.BaseRequest) -> web.Response:
        origin = request.headers["Origin"]
        requested_headers = request.headers.get("Access-Control-Request-Headers")
        headers = dict(self.preflight_headers)
        failures = []
        if not self.allows(origin):
            failures.append("origin")
        elif self.echo_origin:
            headers["Access-Control-Allow-Origin"] = origin
        if request.headers["Access-Control-Request-Method"] not in self.methods:
            failures.append("method")
        if requested_headers is not None:
            if self.any_header:  # echoed: "*" there would not cover Authorization (Fetch spec)
                headers["Access-Control-Allow-Headers"] = requested_headers
            elif any(h.strip() not in self.headers for h in requested_headers.lower().split(",")):
                failures.append("headers")
        # Chrome's Private Network Access: vLLM leaves Starlette's allow_private_network off
        if "Access-Control-Request-Private-Network" in request.headers:
            failures.append("private-network")
        if failures:
            return web.Response(
                status=400, text="Disallowed CORS " + ", ".join(failures), headers=headers
            )
        return web.Response(status=200, text="OK", headers=headers)

    async def on_response_prepare(
        self, request: web.BaseRequest, response: web.StreamResponse
    ) -> None:
        origin = request.headers.get("Origin")
        if origin is None or _is_preflight(request):  # a preflight's answer has its own headers
            return
        response.headers.update(self.simple_headers)
        if self.echo_origin and self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            vary = response.headers.get("Vary")
            response.headers["Vary"] = f"{vary}, Origin" if vary is not None else "Origin"
