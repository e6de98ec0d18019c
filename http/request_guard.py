"""Requests are what they claim: the Host they name, the site they come from, the body they
carry. What a web page in a browser could otherwise make the server do for it:

- **DNS rebinding**: a page at `evil.example`, whose name the attacker then points at
  127.0.0.1, is same-origin with the server to the browser. Its requests name their Host,
  `evil.example:8000`: on a loopback connection the Host must be an IP address, `localhost`
  (or `*.localhost`) or this machine's own name; `--allowed-hosts` names the hosts for every
  connection instead (`"*"`: any), as Starlette's TrustedHostMiddleware does.
- **Cross-site requests**: a page may send a POST with a `text/plain` body, or none, to any
  server without asking first (no CORS preflight), and the server acts before the browser
  hides the answer. A request from another site (an `Origin` that is not the server's own,
  or the browser's `Sec-Fetch-Site: cross-site | same-site`) is refused (403) unless CORS
  allows its origin (`--allowed-origins`, none by default); the open probes excepted.
- **Bodies**: a POST, PUT or PATCH body must be JSON, `Content-Type: application/json`
  (415 otherwise, naming the route), as vLLM's FastAPI and SGLang require. A POST without a
  body may say anything (aiohttp's client sends `application/octet-stream`): from another
  site the check above refuses it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from deltaserve.http.auth import OPEN_PATHS, route_path
from deltaserve.http.cors import Cors
from deltaserve.http.errors import ApiError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
CROSS_SITE = frozenset({"cross-site", "same-site"})  # Sec-Fetch-Site values from another site


def _hostname(host: str) -> str:
    """The name in a Host header, its port and an IPv6 literal's brackets taken off."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return (host.rsplit(":", 1)[0] if host.count(":") == 1 else host).rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _loopback_connection(request: web.BaseRequest) -> bool:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if not isinstance(sockname, tuple):  # a unix socket: no browser reaches it
        return False
    try:
        return ipaddress.ip_address(sockname[0].split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _host_matches(name: str, patterns: Sequence[str]) -> bool:
    """Starlette's rules: `*` any host, `*.example.com` its subdomains, else the exact name."""
    for pattern in patterns:
        pattern = pattern.lower()
        if pattern == "*" or name == pattern:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def _forbidden(message: str, code: str) -> ApiError:
    return ApiError(403, message, type="permission_error", code=code)


class RequestGuard:
    """`check_host` goes first of the app's middlewares but the error one; `check_site`
    after the CORS one (whose preflight answers need no key); `check_body` after the key's.
    `allowed_hosts` None: the loopback rule above."""

    def __init__(self, allowed_hosts: Sequence[str] | None, cors: Cors) -> None:
        self.allowed_hosts = None if allowed_hosts is None else tuple(allowed_hosts)
        self.cors = cors
        # this machine's names (Debian maps the hostname to 127.0.1.1): a local client's
        self.local_names = frozenset({"localhost", socket.gethostname().lower()})

    def host_allowed(self, request: web.BaseRequest) -> bool:
        host = request.headers.get("Host")
        if host is None:  # HTTP/1.0 without one: not a browser
            return True
        name = _hostname(host)
        if self.allowed_hosts is not None:
            return _host_matches(name, self.allowed_hosts)
        if not _loopback_connection(request):
            return True
        return _is_ip(name) or name in self.local_names or name.endswith(".localhost")

    @web.middleware
    async def check_host(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not self.host_allowed(request):
            hint = (
                "on a loopback connection the Host must be an IP address, localhost or this "
                "machine's name (DNS rebinding); --allowed-hosts names the hosts to serve"
                if self.allowed_hosts is None
                else f"not in --allowed-hosts {list(self.allowed_hosts)}"
            )
            raise ApiError(
                400,
                f"Host {request.headers['Host']!r} is not allowed: {hint}",
                type="invalid_request_error",
                code="invalid_host",
            )
        return await handler(request)

    def from_another_site(self, request: web.BaseRequest) -> bool:
        origin = request.headers.get("Origin")
        if origin is not None:
            same = urlsplit(origin).netloc.lower() == request.headers.get("Host", "").lower()
            return not same
        return request.headers.get("Sec-Fetch-Site", "").lower() in CROSS_SITE

    @web.middleware
    async def check_site(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if (
            route_path(request) not in OPEN_PATHS
            and self.from_another_site(request)
            and not self.cors.allows(request.headers.get("Origin", "null"))
        ):
            raise _forbidden(
                f"{request.method} {request.path} from another site "
                f"(Origin {request.headers.get('Origin')!r}): cross-site requests are refused "
                "unless --allowed-origins names the origin (CORS)",
                "cross_site_request",
            )
        return await handler(request)

    @web.middleware
    async def check_body(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method in BODY_METHODS and request.body_exists:
            content_type = request.headers.get("Content-Type")
            media_type = (
                None if content_type is None else content_type.split(";", 1)[0].strip().lower()
            )
            if media_type != "application/json":
                raise ApiError(
                    415,
                    f"{request.method} {request.path} takes a JSON body: Content-Type must be "
                    f"application/json, got {content_type or 'none'} (curl: -H "
                    "'Content-Type: application/json')",
                    type="invalid_request_error",
                    code="unsupported_media_type",
                )
        return await handler(request)
