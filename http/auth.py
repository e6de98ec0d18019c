"""Who may call which route: the API key and the admin key.

Three levels, by the route a request resolved to (never by the path's spelling, so no
spelling of a guarded path reaches its handler without the key):
- open: `/health`, `/ping`, `/version`, `/metrics` (probes and scrapers; vLLM and SGLang
  leave these open too);
- admin: the routes that change the engine (rl_routes.py, routed only when enabled): the
  admin key when one is set, else the API key, else none (SGLang's ADMIN_OPTIONAL);
- every other route, and any other path: the API key when one is set.

A key is taken as `Authorization: Bearer KEY` or as Anthropic's clients send it,
`x-api-key: KEY`, and compared as SHA-256 digests with `hmac.compare_digest` (as vLLM's
middleware compares), so the time taken says nothing of the key's length or bytes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection
from typing import Any

from aiohttp import web

from deltaserve.http import errors

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


def route_path(request: web.Request) -> str:
    """The path of the route the request resolved to; for one no route takes (a 404, a 405),
    its own path: no handler runs for it."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def _digest(key: str) -> bytes:
    # surrogateescape: a header's undecodable bytes arrive as surrogates; never a 500
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _given_key(request: web.BaseRequest) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key")


class ApiKeys:
    """The keys' digests and the admin routes' paths, fixed at start. `middleware` goes
    after the CORS one (a browser's preflight carries no key)."""

    def __init__(
        self, api_key: str | None, admin_api_key: str | None, admin_paths: Collection[str]
    ) -> None:
        self._api = None if api_key is None else _digest(api_key)
        admin = admin_api_key if admin_api_key is not None else api_key
        self._admin = None if admin is None else _digest(admin)
        self._admin_paths = frozenset(admin_paths)

    def required(self, request: web.Request) -> bytes | None:
        """The digest of the key the request must carry, or None where it needs none."""
        path = route_path(request)
        if path in OPEN_PATHS:
            return None
        return self._admin if path in self._admin_paths else self._api

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        required = self.required(request)
        if required is not None:
            given = _given_key(request)
            if given is None or not hmac.compare_digest(_digest(given), required):
                raise errors.unauthorized()
        return await handler(request)
