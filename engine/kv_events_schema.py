"""KV-cache events in vLLM's wire format (vllm/distributed/kv_events.py), for the routers
that place requests by where a prompt's prefix is cached (vllm-router's kv_aware, llm-d,
Dynamo). Imports only msgspec, so that a subscriber loads neither torch nor the engine.

Framing, as vLLM's `ZmqEventPublisher`: every batch is a three-frame ZeroMQ multipart
[topic, seq, payload] on a PUB socket: `topic` the configured topic's bytes, `seq` an 8-byte
big-endian count (0, 1, ... per publisher: a gap means the subscriber lost batches), `payload`
one msgpack `KVEventBatch`. The batch is a positional array [ts, events, data_parallel_rank]
(`array_like`); each event a msgpack map whose key "type" names it (vLLM's tagged structs,
map-encoded since vLLM #42892, which its current consumers read). Replay (a ROUTER socket):
a request of one frame, the first seq wanted as 8 bytes big-endian, is answered with
[topic, seq, payload] for each batch still buffered from that seq on, then the end marker
[b"", -1 as 8 signed bytes, b""].
"""

from __future__ import annotations

from typing import Any

import msgspec

# The tier vLLM names its device cache ("GPU" on every platform: the primary tier).
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event's map carries "type": its class name (msgspec's default tag)."""


class BlockStored(KVCacheEvent):
    """Full blocks a request can now start after: `block_hashes[i]` chains onto
    `block_hashes[i - 1]` (the first onto `parent_block_hash`, None: the prompt's start);
    `token_ids` are the blocks' tokens, `block_size` per block."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block this publisher announced is gone (a cache flush, new weights, sleep)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # wall clock (Unix seconds) when the events happened
    events: list[KVEvent]
    data_parallel_rank: int | None = None


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(KVEventBatch)
