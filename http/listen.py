"""Where `deltaserve serve` listens: host and port, or a Unix domain socket (`--uds`), over
TLS with vLLM's (uvicorn's) `--ssl-*` flags. Everything is checked before the engine starts,
so that a port in use or a bad certificate fails in a second, not after the weights have
loaded (minutes on a GPU)."""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # aiohttp is imported when the server starts, not to read the flags
    from aiohttp import web


def add_listen_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="listen on this Unix domain socket instead of --host/--port (as vLLM's)",
    )
    group.add_argument("--ssl-keyfile", default=None, help="TLS: the server's private key (PEM)")
    group.add_argument(
        "--ssl-certfile", default=None, help="TLS: the server's certificate chain (PEM)"
    )
    group.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="TLS: CA certificates that client certificates must chain to",
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 1, 2),
        default=int(ssl.CERT_NONE),
        help="TLS: client certificates 0 not asked for, 1 optional, 2 required (as uvicorn's)",
    )


@dataclass(frozen=True)
class Listen:
    host: str
    port: int
    uds: str | None = None
    ssl: ssl.SSLContext | None = None

    def url(self, address: object) -> str:
        """What the ready line names: the base URL, or the socket's path."""
        if self.uds is not None:
            return f"unix:{self.uds}"
        host, port = address[:2]  # type: ignore[index]
        scheme = "https" if self.ssl else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def listen_config(args: argparse.Namespace) -> Listen:
    """The flags as a `Listen`; ValueError naming the flag for what cannot serve."""
    return Listen(args.host, args.port, args.uds, tls_context(args))


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError(
                "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile"
            )
        return None
    if args.ssl_keyfile is None or args.ssl_certfile is None:
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        raise ValueError(
            f"--ssl-cert-reqs {args.ssl_cert_reqs} needs "
            "--ssl-ca-certs to check client certificates with"
        )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: {e}"
        ) from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs {args.ssl_ca_certs}: {e}") from None
    context.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
    return context


def check_listen(listen: Listen) -> None:
    """Bind every address the server will listen on, then let go. Binds as asyncio's
    create_server does (SO_REUSEADDR, IPv6 only on IPv6 sockets); raises the OSError
    (socket.gaierror for an unknown host name). A socket path: its folder must exist, and a
    socket already there must be a dead one (asyncio replaces it, live or not)."""
    if listen.uds is not None:
        path = Path(listen.uds)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"no folder {path.parent} for the socket")
        if path.exists() and not stat.S_ISSOCK(path.stat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        if path.exists():
            with socket.socket(socket.AF_UNIX) as probe:
                if probe.connect_ex(str(path)) == 0:
                    raise OSError(f"{path}: another server listens there")
        return
    infos = socket.getaddrinfo(
        listen.host or None, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    for family, kind, proto, _, address in dict.fromkeys(infos):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # a family this kernel lacks (IPv6 off): asyncio skips it too
            continue
        with sock:
            if os.name == "posix":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)


async def start_server(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout_s: float = 5.0,
    uds: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, web.BaseSite]:
    """Listen on host:port (0: any free port; see `runner.addresses`), or on the Unix socket
    `uds`; over TLS with `ssl_context`. Handlers are cancelled when their client disconnects,
    which cancels the client's requests."""
    from aiohttp import web

    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    if uds is not None:
        site: web.BaseSite = web.UnixSite(runner, uds, ssl_context=ssl_context)
    else:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site


def remove_socket(listen: Listen) -> None:
    """The socket file, once the server has stopped (Python before 3.13 leaves it)."""
    if listen.uds is not None:
        path = Path(listen.uds)
        if path.exists() and stat.S_ISSOCK(path.stat().st_mode):
            path.unlink()
