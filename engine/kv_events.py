"""KV-cache events from the prefix cache: which full blocks a router may count as cached here.

vLLM announces a block as stored once its KV is cached, and a router then expects a prompt
that begins with blocks 0..i to skip their prefill. A DeltaNet layer has no per-position
state: a prompt can start only where a state was saved (engine/prefix_cache.py). So a block
is announced only while a saved prefix covers it whole, that is, while a DeltaNet state is
saved at or after its end: the full blocks of each saved prefix's tokens (its partly filled
last block never). A prompt that matches those blocks and the saved prefix's tail starts
there; one that parts from it inside the tail starts from a shorter save, if any (the
router's count is then an upper bound: docs/ROUTING.md).

Several saved prefixes share their leading blocks (a conversation's turns, a system prompt):
a block is announced when the first prefix covering it is saved and removed when the last one
goes (`BlockRemoved`); a flush (new weights, sleep, `flush_cache`) clears them all
(`AllBlocksCleared`). The events of one pass of the event loop go out as one batch.

Block hashes chain as vLLM's (block i's hashes block i-1's and its own tokens), over the ids
the prefix cache keys on, as 64-bit unsigned ints; the same tokens give the same hashes on
every replica. A block that holds an image's placeholder, and every block after it, is not
announced (routers key blocks on text token ids; the image's key is ours).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from deltaserve.engine.kv_events_schema import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

if TYPE_CHECKING:
    from deltaserve.engine.prefix_cache import SavedPrefix

HASH_MASK = (1 << 64) - 1  # block hashes go out as uint64 (a router refuses negative ones)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py), field for field.

    `endpoint` binds where it holds "*", "::", or is ipc:// or inproc://, else connects (vLLM's
    rule); `replay_endpoint` always binds. `buffer_steps` batches are kept for replay; `hwm` is
    the PUB socket's high-water mark (past it a slow subscriber loses batches).
    `max_queue_size` is accepted for vLLM's configs and bounds nothing here: batches are sent
    from the event loop without blocking, never queued."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, as vLLM's
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        if self.publisher not in (None, "null", "zmq"):
            raise ValueError(
                f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}"
            )
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv_events_config.replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")

    @property
    def publishes(self) -> bool:
        """Whether events go out: enabled, and the publisher (default zmq) is not null."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From the flag's JSON object; a key vLLM's config lacks is refused by name."""
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError("kv_events_config must be a JSON object")
        unknown = sorted(set(obj) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"kv_events_config has unknown key(s) {', '.join(unknown)}; the keys: "
                f"{', '.join(cls.__dataclass_fields__)}"
            )
        return cls(**obj)

    def for_replica(self, rank: int) -> KVEventsConfig:
        """Data-parallel replica `rank`'s endpoints, as vLLM offsets them: a tcp port + rank,
        an inproc:// or ipc:// name + "_dp{rank}"."""
        if rank == 0:
            return self
        from dataclasses import replace

        return replace(
            self,
            endpoint=_offset(self.endpoint, rank),
            replay_endpoint=None
            if self.replay_endpoint is None
            else _offset(self.replay_endpoint, rank),
        )


def _offset(endpoint: str, rank: int) -> str:
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_config endpoint {endpoint!r} has no port to offset")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class BlockEvents:
    """Told by the prefix cache of every save, eviction and flush (`saved`, `evicted`,
    `cleared`); hands each pass's events to `sink` as one list, from a `call_soon`."""

    def __init__(self, block_size: int, sink: Callable[[float, list[KVEvent]], None]) -> None:
        self.block_size = block_size
        self._sink = sink
        self._holders: dict[int, int] = {}  # announced block hash -> saved prefixes covering it
        self._blocks: dict[int, list[int]] = {}  # prefix id -> the hashes it covers
        self._pending: list[KVEvent] = []
        self._loop = asyncio.get_running_loop()

    @property
    def announced(self) -> frozenset[int]:
        """The block hashes announced and not removed (what a subscriber should hold)."""
        return frozenset(self._holders)

    def blocks_of(self, prefix: SavedPrefix) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, tokens) of each full block a saved prefix covers, up to its first image."""
        bs, blocks, h = self.block_size, [], 0
        for end in range(bs, prefix.num_tokens + 1, bs):
            tokens = prefix.prompt[end - bs : end]
            if min(tokens) < 0:  # an image's placeholder (engine/media_prompt.py)
                break
            h = hash((h, tokens))
            blocks.append((h & HASH_MASK, tokens))
        return blocks

    def saved(self, prefix: SavedPrefix) -> None:
        blocks = self.blocks_of(prefix)
        self._blocks[prefix.prefix_id] = [h for h, _ in blocks]
        run: list[tuple[int, tuple[int, ...]]] = []  # new blocks, contiguous
        parent: int | None = None
        for i, (h, tokens) in enumerate(blocks):
            self._holders[h] = self._holders.get(h, 0) + 1
            if self._holders[h] == 1:
                if not run:
                    parent = blocks[i - 1][0] if i else None
                run.append((h, tokens))
            elif run:
                self._stored(parent, run)
                run = []
        if run:
            self._stored(parent, run)

    def evicted(self, prefix: SavedPrefix) -> None:
        gone = []
        for h in self._blocks.pop(prefix.prefix_id, ()):
            self._holders[h] -= 1
            if not self._holders[h]:
                del self._holders[h]
                gone.append(h)
        if gone:
            self._emit(BlockRemoved(block_hashes=gone, medium=MEDIUM))

    def cleared(self) -> None:
        """Every saved prefix is forgotten (those still pinned are found by no one)."""
        self._holders.clear()
        self._blocks.clear()
        self._emit(AllBlocksCleared())

    def _stored(self, parent: int | None, run: list[tuple[int, tuple[int, ...]]]) -> None:
        self._emit(
            BlockStored(
                block_hashes=[h for h, _ in run],
                parent_block_hash=parent,
                token_ids=[t for _, tokens in run for t in tokens],
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
            )
        )

    def _emit(self, event: KVEvent) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(event)

    def _flush(self) -> None:
        events, self._pending = self._pending, []
        self._sink(time.time(), events)
