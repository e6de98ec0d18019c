"""ZeroMQ channels of one replica: one thin class per socket kind (after mini-sglang
`utils/mp.py`). Frames are msgspec msgpack bytes; callers decode them strictly.

Sockets live on ipc:// paths in the replica's private 0700 run directory:
    ipc://RUN/cmd{r}   controller binds a PUSH per rank, rank r connects a PULL
    ipc://RUN/reply    controller binds one PULL, every rank connects a PUSH

The controller side does not await per-frame futures (zmq.asyncio): `PullChannel.watch` puts
the socket's fd in the event loop and one callback drains every ready frame, which halves the
round trip measured by tools/bench_ipc.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

MAX_IPC_PATH = 100  # sockaddr_un holds 107 bytes; keep a margin


def ipc_endpoint(run_dir: str, name: str) -> str:
    path = f"{run_dir}/{name}"
    if len(path) > MAX_IPC_PATH:
        raise ValueError(
            f"ipc socket path {path!r} is {len(path)} bytes, over the {MAX_IPC_PATH}-byte "
            f"limit of unix sockets; set TMPDIR to a shorter folder"
        )
    return f"ipc://{path}"


def close_context(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    """Close `sockets` (linger 0: no wait for peers), then any other socket of `ctx`, then
    `ctx` itself; idempotent. The caller names the sockets and holds them: the context's own
    list is weak, and in a garbage cycle its entries are gone before any finalizer runs, so
    `ctx.destroy()` (pyzmq's `Context.__del__` too) would close nothing, then wait forever."""
    for socket in sockets:
        socket.close(linger=0)
    ctx.destroy(linger=0)


class PushChannel:
    """One-way sender (PUSH). `send` never blocks: False means no peer could take the frame."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, bind: bool, linger_ms: int = 0) -> None:
        self.endpoint = endpoint
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, linger_ms)
        self.socket.bind(endpoint) if bind else self.socket.connect(endpoint)

    def send(self, frame: bytes) -> bool:
        try:
            self.socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.socket.close()


class PullChannel:
    """One-way receiver (PULL): blocking `recv` with a timeout for the rank's loop, or
    `watch` for the controller's event loop."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, bind: bool) -> None:
        self.endpoint = endpoint
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint) if bind else self.socket.connect(endpoint)
        self._loop: asyncio.AbstractEventLoop | None = None

    def recv(self, timeout_ms: int) -> bytes | None:
        if not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return self.socket.recv(zmq.NOBLOCK)

    def recv_nowait(self) -> bytes | None:
        try:
            return self.socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def watch(self, loop: asyncio.AbstractEventLoop, on_frame: Callable[[bytes], None]) -> None:
        """Call `on_frame` from the loop for every frame that arrives. ZMQ_FD is edge
        triggered: each wake-up drains until the socket is empty."""

        def drain() -> None:
            while self._loop is not None:
                try:
                    frame = self.socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                try:
                    on_frame(frame)
                except Exception as exc:  # keep draining: a frame left behind raises no edge
                    loop.call_exception_handler(
                        {"message": "PullChannel frame handler failed", "exception": exc}
                    )

        self._loop = loop
        loop.add_reader(self.socket.getsockopt(zmq.FD), drain)
        loop.call_soon(drain)  # frames queued before the watch began raise no edge

    def close(self) -> None:
        loop, self._loop = self._loop, None
        try:
            if loop is not None and not loop.is_closed():
                loop.remove_reader(self.socket.getsockopt(zmq.FD))
        finally:
            self.socket.close()
