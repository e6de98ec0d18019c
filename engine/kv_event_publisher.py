"""The KV-event publisher: vLLM's ZmqEventPublisher written for the event loop.

A PUB socket sends each batch as [topic, seq, payload] (engine/kv_events_schema.py) and keeps
the last `buffer_steps` for replay; a ROUTER socket (`replay_endpoint`) answers a subscriber
that missed batches (a gap in seq, or a late start) with those from the seq it asks for, then
the end marker. Sends never block the loop: NOBLOCK, and PUB drops for a subscriber past its
high-water mark (vLLM's publisher thread and queue buy nothing here: a batch is encoded and
sent in microseconds, and the scheduler's tick owns the loop anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque

import zmq
import zmq.asyncio

from deltaserve.engine.kv_events import KVEventsConfig
from deltaserve.engine.kv_events_schema import END_SEQ, KVEvent, KVEventBatch, encoder

log = logging.getLogger("deltaserve.engine")
CLOSE_LINGER_MS = 250  # time the last batches get to leave on close


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local endpoint, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Made in the event loop (`KVEventPublisher(config, rank)`), `aclose`d at the end."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self._topic = config.topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context(io_threads=1)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        # the replay socket is an asyncio one of its own (over the same context), never a shadow
        # of a plain socket: a shadow's close frees the socket, and the plain object's
        # garbage collection would later close whatever socket took its address since
        self._replay: zmq.asyncio.Socket | None = None
        self._replays: asyncio.Task | None = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets(0)
            self._ctx.term()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r}: {exc}") from None
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        if self._replay is not None:
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replays = asyncio.get_running_loop().create_task(
                self._serve_replays(self._replay), name="deltaserve-kv-event-replay"
            )

    @property
    def num_published(self) -> int:
        return self._seq

    def publish(self, ts: float, events: list[KVEvent]) -> None:
        """Send one batch (BlockEvents' sink) and keep it for replay; nothing once closed."""
        if self._pub.closed:
            return
        payload = encoder.encode(KVEventBatch(ts, events, self._rank))
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # PUB drops rather than blocks; kept for safety
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    async def _serve_replays(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:  # [identity, b"", start seq]
                log.warning("kv events: a replay request of %d frames ignored", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def aclose(self) -> None:
        """Stop answering replays, give the last batches a moment, close. Idempotent."""
        if self._replays is not None:
            self._replays.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replays
            self._replays = None
        if self._pub.closed:
            return
        self._close_sockets(CLOSE_LINGER_MS)
        # term waits up to the linger for the last frames to leave: not on the loop thread.
        await asyncio.get_running_loop().run_in_executor(None, self._ctx.term)
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint and endpoint.startswith("ipc://"):  # libzmq leaves the file behind
                with contextlib.suppress(OSError):
                    os.unlink(endpoint.removeprefix("ipc://"))

    def _close_sockets(self, linger_ms: int) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:  # drops its reader from the loop too
            self._replay.close(linger=0)
