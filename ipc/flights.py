"""The commands in flight on one replica, and the one rule that lets two be in flight at once.

Commands go one at a time, except that a step may follow a step the gate has released
(pipelining: the ranks find it waiting when they finish). So at most two flights exist, and
only the newer can be waiting for the gate: ranks read frames in order, so one decision word
in the gate still suffices. A reply is matched to its flight by seq: a rank's reply to step N
can reach the controller after another rank's reply to N+1.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from deltaserve.ipc.messages import Reply, RunUnifiedStep
from deltaserve.ipc.replica_config import ReplicaPoisoned
from deltaserve.ipc.validate import ReplySet


@dataclass(slots=True, eq=False)
class Flight:
    """One command in flight. `future` holds its result (or ReplicaPoisoned); `gate` becomes
    True once the gate has released it, False if it never will (it was cancelled)."""

    replies: ReplySet
    future: asyncio.Future
    gate: asyncio.Future
    gated: bool
    frame: bytes = b""
    digest: int = 0  # crc32 of the frame, which every rank's gate receipt must match
    released: bool = False
    timer: asyncio.TimerHandle | None = None
    unsent: list[int] = field(default_factory=list)  # ranks whose channel refused the frame

    @property
    def seq(self) -> int:
        return self.replies.seq


class Flights:
    """The flights, oldest first, and the last two complete reply sets (so that a second
    reply to a finished command is named as such)."""

    def __init__(self) -> None:
        self._queue: deque[Flight] = deque()
        self._ended: deque[ReplySet] = deque(maxlen=2)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, flight: Flight) -> bool:
        return flight in self._queue

    def add(self, flight: Flight) -> None:
        self._queue.append(flight)

    @property
    def oldest(self) -> Flight | None:
        return self._queue[0] if self._queue else None

    @property
    def newest(self) -> Flight | None:
        """The only flight that can be waiting for the gate."""
        return self._queue[-1] if self._queue else None

    def can_follow(self) -> bool:
        """A step may be sent now behind the one flight: a step the gate has released."""
        if len(self._queue) != 1:
            return False
        ahead = self._queue[0]
        return ahead.released and type(ahead.replies.command) is RunUnifiedStep

    def by_seq(self, seq: int) -> Flight | None:
        return next((f for f in self._queue if f.seq == seq), None)

    def stray_reason(self, reply: Reply, num_ranks: int) -> str:
        """Why `reply`, which matches no flight, poisons the replica."""
        last = next((r for r in self._ended if r.seq == reply.seq), None)
        if (
            last is not None
            and 0 <= reply.rank < num_ranks
            and last.replies[reply.rank] is not None
        ):
            return f"rank {reply.rank} sent a second reply to {last.name} seq {last.seq}"
        return (
            f"{type(reply).__name__} from rank {reply.rank} for seq {reply.seq}, "
            f"but no command with that seq awaits a reply"
        )

    def end(self, future: asyncio.Future) -> bool | None:
        """Take out the flight whose `future` is done (its timer stopped, its gate settled);
        whether it was the oldest, or None if it was not in flight."""
        flight = next((f for f in self._queue if f.future is future), None)
        if flight is None:
            return None
        if flight.timer is not None:
            flight.timer.cancel()
        was_oldest = flight is self._queue[0]
        self._queue.remove(flight)
        if not future.cancelled() and future.exception() is None:
            self._ended.append(flight.replies)
        if not flight.gate.done():
            flight.gate.set_result(False)
        return was_oldest

    def fail_all(self, reason: str) -> None:
        for flight in self._queue:
            if not flight.gate.done():
                flight.gate.set_result(False)
            if not flight.future.done():
                flight.future.set_exception(ReplicaPoisoned(reason))
                flight.future.exception()  # retrieved here: a follower's caller may never await it
