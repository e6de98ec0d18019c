"""The caller's side of a generate call: an async iterator of events.

The scheduler holds only the `EventSink` (an asyncio.Queue and a closed flag), never the
stream itself, so a consumer that walks away is noticed however it leaves:
- `await stream.aclose()` (or `async with` exit) closes the sink;
- the task iterating it is cancelled: `__anext__` closes the sink and re-raises;
- `break` out of `async for` and dropping the stream: a weakref finalizer closes the sink.
A closed sink wakes the tick, whose prune step cancels the requests behind it; its client
id is free for a new request at once, as after `AsyncEngine.abort`.

A consumer that may fall behind (an HTTP stream whose client stops reading) bounds what waits
for it (`RequestStream.limit_pending`): past the bound the sink closes itself, so the events
waiting stay few however long the request would have run.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

from deltaserve.engine.events import ErrorEvent, Event, FinishedEvent


class EventSink:
    """Where the tick puts one generate call's events. `num_open` counts choices that have
    not had their terminal event yet; the sink is resolved when it reaches 0."""

    __slots__ = (
        "client_id",
        "request_ids",
        "queue",
        "num_open",
        "closed",
        "max_pending",
        "_wake",
        "_on_resolved",
        "_on_overflow",
    )

    def __init__(
        self,
        client_id: str,
        request_ids: tuple[int, ...],
        wake: Callable[[], None],
        on_resolved: Callable[[EventSink], None],
    ) -> None:
        self.client_id = client_id
        self.request_ids = request_ids  # engine RequestIds, one per choice
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.num_open = len(request_ids)
        self.closed = False
        self.max_pending: int | None = None  # events that may wait unread (limit_pending)
        self._wake = wake
        self._on_resolved = on_resolved
        self._on_overflow: Callable[[], None] | None = None

    @property
    def resolved(self) -> bool:
        return self.num_open == 0

    def put(self, event: Event) -> None:
        """Deliver an event (tick only). Terminal events count down the open choices; past
        `max_pending` unread events the sink closes (its requests are cancelled) and the
        consumer's overflow callback runs soon after, on the loop, never inside the tick."""
        self.queue.put_nowait(event)
        if isinstance(event, FinishedEvent | ErrorEvent):
            self.num_open -= 1
            if self.num_open == 0:
                self._on_resolved(self)
        elif self.max_pending is not None and self.queue.qsize() > self.max_pending:
            self.max_pending = None
            self.close()
            if self._on_overflow is not None:
                asyncio.get_running_loop().call_soon(self._on_overflow)

    def limit_pending(self, max_events: int, on_overflow: Callable[[], None]) -> None:
        self.max_pending = max_events
        self._on_overflow = on_overflow

    def close(self) -> None:
        """The consumer left; idempotent, callable from a finalizer."""
        if self.closed or self.resolved:
            self.closed = True
            return
        self.closed = True
        self._wake()


class RequestStream:
    """Events of every choice of one generate call, interleaved; ends after each choice's
    terminal event (exactly one per choice)."""

    def __init__(self, sink: EventSink, prompt_token_ids: tuple[int, ...]) -> None:
        self._sink = sink
        self._num_open = len(sink.request_ids)
        self.request_id = sink.client_id
        self.request_ids = sink.request_ids  # engine RequestIds, one per choice
        self.prompt_token_ids = prompt_token_ids
        weakref.finalize(self, sink.close).atexit = False

    @property
    def finished(self) -> bool:
        return self._num_open == 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._num_open == 0 or self._sink.closed:
            raise StopAsyncIteration
        try:
            event = await self._sink.queue.get()
        except asyncio.CancelledError:
            self._sink.close()
            raise
        if isinstance(event, FinishedEvent | ErrorEvent):
            self._num_open -= 1
        return event

    def limit_pending(self, max_events: int, on_overflow: Callable[[], None]) -> None:
        """Bound the events that may wait unread: once more than `max_events` wait (the
        consumer stopped reading), the stream ends as `aclose` ends it and `on_overflow()`
        runs on the loop."""
        self._sink.limit_pending(max_events, on_overflow)

    async def aclose(self) -> None:
        """Stop listening; choices still running are cancelled. Idempotent."""
        self._sink.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
