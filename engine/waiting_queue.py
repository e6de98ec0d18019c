"""The queue of requests waiting for admission, in admission order, and what its bounds count."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from deltaserve.engine.request import Request
from deltaserve.engine.tick_records import Entry


class WaitingQueue:
    """Entries in admission order: arrival order, or with `by_priority` (vLLM's priority
    policy) each request's priority first (lower first), then arrival; and the choices the
    queue bounds count: submitted, not admitted, still wanted by their owner (request id ->
    prompt tokens). They are counted at submission, before the tick drains them into
    entries, and an owner that leaves frees its places at once (`forget`), before the tick
    takes its entries out."""

    def __init__(self, by_priority: bool = False) -> None:
        self.by_priority = by_priority
        self._entries: deque[Entry] = deque()
        self._counted: dict[int, int] = {}

    @property
    def num_choices(self) -> int:
        return len(self._counted)

    @property
    def num_tokens(self) -> int:
        return sum(self._counted.values())

    def count(self, requests: Iterable[Request]) -> None:
        self._counted.update((r.request_id, r.prompt_len) for r in requests)

    def forget(self, request_ids: Iterable[int]) -> None:
        for rid in request_ids:
            self._counted.pop(rid, None)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def head(self) -> Entry:
        return self._entries[0]

    def extend(self, entries: Iterable[Entry]) -> None:
        """Arrivals: behind every entry of their priority or a lower value."""
        for entry in entries:
            at = len(self._entries)
            if self.by_priority:
                while at and self._entries[at - 1].request.priority > entry.request.priority:
                    at -= 1
            self._entries.insert(at, entry)

    def requeue(self, entries: list[Entry]) -> None:
        """Preempted requests, youngest first in `entries`: each goes in front of every entry of
        its priority or a higher value (the front, without priorities), the oldest foremost,
        counted again."""
        self.count(entry.request for entry in entries)
        for entry in entries:
            at = 0
            if self.by_priority:
                while at < len(self._entries) and (
                    self._entries[at].request.priority < entry.request.priority
                ):
                    at += 1
            self._entries.insert(at, entry)

    def popleft(self) -> Entry:
        entry = self._entries.popleft()
        self.forget((entry.request.request_id,))
        return entry

    def remove(self, entry: Entry) -> None:
        self._entries.remove(entry)
        self.forget((entry.request.request_id,))

    def clear(self) -> None:
        self._entries.clear()
        self._counted.clear()
