"""KV-cache events in vLLM's wire format (engine/kv_events.py, engine/kv_event_publisher.py).

A subscriber written here from vLLM's published schema (vllm/distributed/kv_events.py: the
msgspec structs, their tags and layout, the [topic, seq, payload] frames, the replay
protocol), not from ours, reads the stream of an engine with real rank processes at TP 1 and
2. After a workload with shared prefixes, a conversation, evictions and a flush, the blocks it
holds, each read back as the token prefix its parent chain spells, are the full blocks of the
scheduler's saved prefixes; a subscriber that joins after all of it replays from seq 0 and
holds the same.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
from engine_helpers import PLACEMENTS, start_placed

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.config_flags import engine_config
from deltaserve.engine.kv_events import BlockEvents, KVEventsConfig
from deltaserve.engine.prefix_cache import SavedPrefix
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http import serve

module_loop = pytest.mark.asyncio(loop_scope="module")
TOPIC = "kv@deltaserve"
BLOCK = 16


# ---- vLLM's schema, as its kv_events.py publishes it --------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """What a router keeps: every announced block, its parent and its tokens."""

    def __init__(self) -> None:
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.seqs: list[int] = []
        self.ranks: set[int | None] = set()

    def apply(self, seq: int, payload: bytes) -> None:
        assert not self.seqs or seq == self.seqs[-1] + 1, (self.seqs[-1:], seq)
        self.seqs.append(seq)
        batch = self.decoder.decode(payload)
        self.ranks.add(batch.data_parallel_rank)
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == BLOCK and event.medium == "GPU"
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert h not in self.blocks, f"block {h} stored twice"
                    tokens = tuple(event.token_ids[i * BLOCK : (i + 1) * BLOCK])
                    self.blocks[h] = (parent, tokens)
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert h in self.blocks, f"block {h} removed but never stored"
                    del self.blocks[h]
            else:
                self.blocks.clear()

    def prefixes(self) -> set[tuple[int, ...]]:
        """Each block read back as the tokens from the prompt's start to its end."""
        spelled = set()
        for h in self.blocks:
            tokens: tuple[int, ...] = ()
            while h is not None:
                assert h in self.blocks, "a block whose parent is gone"
                h, block = self.blocks[h]
                tokens = block + tokens
            spelled.add(tokens)
        return spelled


def saved_blocks(engine: AsyncEngine) -> set[tuple[int, ...]]:
    """The full blocks of every saved prefix, as token prefixes."""
    return {
        prefix.prompt[:end]
        for prefix in engine.scheduler.prefix.saved_prefixes()
        for end in range(BLOCK, prefix.num_tokens + 1, BLOCK)
    }


async def receive(sub: zmq.asyncio.Socket, subscriber: Subscriber, until_idle_s: float = 0.5):
    """Every batch that arrives until none has for `until_idle_s`."""
    while await sub.poll(until_idle_s * 1000):
        topic, seq, payload = await sub.recv_multipart()
        assert topic == TOPIC.encode()
        subscriber.apply(int.from_bytes(seq, "big"), payload)


async def replay(endpoint: str, start: int, subscriber: Subscriber) -> None:
    """vLLM's replay, as routers ask for it (a DEALER; a REQ takes one reply only): the first
    seq wanted; [topic, seq, payload] per buffered batch from there, then END_SEQ."""
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert await dealer.poll(10_000), "no replay answer"
            empty, topic, seq, payload = await dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                break
            assert topic == TOPIC.encode()
            subscriber.apply(int.from_bytes(seq, "big"), payload)
    finally:
        dealer.close(linger=0)


# ---- end to end -----------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module", **PLACEMENTS)
async def engine(request, tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv")
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{folder}/pub",
        replay_endpoint=f"ipc://{folder}/replay",
        topic=TOPIC,
    )
    engine = await start_placed(
        request.param,
        tiny_model_dir,
        num_kv_blocks=40,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        prefix_cache_states=3,
        kv_events_config=config,
    )
    yield engine
    await engine.shutdown()


@module_loop
async def test_a_subscriber_from_vllms_schema_holds_the_saved_prefixes(engine):
    pub, replay_endpoint = engine.kv_events_endpoints
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(pub)
    await asyncio.sleep(0.3)  # the subscription reaches the PUB socket before the first batch
    live = Subscriber()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run(prompt: list[int]) -> list[int]:
        events = [e async for e in engine.generate(prompt, params)]
        return [e.token_id for e in events[:-1]]

    system = list(range(5, 40))  # 35 tokens: two full blocks and a tail
    turn1 = [*system, 60, 61, 62]
    out = await run(turn1)
    await run([*turn1, *out, 9, 9])  # the conversation's next turn
    await run([*system, 70, 71, 72, 73])  # parts after 32: a shared prefix saved there
    for k in range(3):  # three states: older saves are evicted, their blocks removed
        await run([1000 * (k + 1) + i for i in range(40)])
    await receive(sub, live)
    assert saved_blocks(engine) and live.prefixes() == saved_blocks(engine)
    assert live.ranks == {0}

    await engine.flush_cache()  # AllBlocksCleared
    await run([*system, 80, 81])
    await receive(sub, live)
    assert live.prefixes() == saved_blocks(engine)

    late = Subscriber()  # joins now: replays everything from seq 0
    await replay(replay_endpoint, 0, late)
    assert late.seqs == live.seqs == list(range(len(live.seqs)))
    assert late.prefixes() == live.prefixes() == saved_blocks(engine)

    tail = Subscriber()  # asks from the middle: gets the rest
    tail.seqs = [live.seqs[-3]]  # as if it held everything up to there
    await replay(replay_endpoint, live.seqs[-2], tail)
    assert tail.seqs[1:] == live.seqs[-2:]
    sub.close(linger=0)


# ---- the block bookkeeping and the flag ------------------------------------------------------


def _prefix(prefix_id: int, tokens: list[int]) -> SavedPrefix:
    return SavedPrefix(prefix_id, tuple(tokens), len(tokens), [], 0, False)


@pytest.mark.asyncio
async def test_shared_blocks_are_announced_once_and_removed_with_their_last_prefix():
    batches = []
    events = BlockEvents(4, lambda ts, batch: batches.append(batch))
    a, b = _prefix(0, list(range(10))), _prefix(1, [*range(8), 50, 51, 52, 53, 54])
    events.saved(a)  # blocks [0..4) [4..8); 8, 9 a tail: not announced
    events.saved(b)  # shares both, adds its third block [50..54); 54 a tail
    await asyncio.sleep(0)
    (stored_a, stored_b) = batches.pop()
    assert stored_a.token_ids == list(range(8)) and stored_a.parent_block_hash is None
    assert stored_b.token_ids == [50, 51, 52, 53]
    assert stored_b.parent_block_hash == stored_a.block_hashes[-1]
    events.evicted(a)  # b still covers a's blocks
    events.evicted(b)
    await asyncio.sleep(0)
    (removed,) = batches.pop()
    assert set(removed.block_hashes) == {*stored_a.block_hashes, *stored_b.block_hashes}
    image = _prefix(2, [1, 2, 3, 4, -7, -7, 5, 6, 7, 8, 9, 9])  # an image's marks in block 1
    events.saved(image)
    events.cleared()
    events.evicted(image)  # after a clear: nothing more to remove
    await asyncio.sleep(0)
    stored, cleared = batches.pop()
    assert stored.token_ids == [1, 2, 3, 4] and type(cleared).__name__ == "AllBlocksCleared"
    assert events.announced == frozenset()


def test_the_flag_is_vllms_and_each_replica_gets_its_own_endpoints():
    flag = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5657", "topic": "kv", "buffer_steps": 100, "hwm": 10}'
    )
    args = serve.parse_args(
        ["/m", "--device", "cpu", "--enable-prefix-caching", "--kv-events-config", flag]
    )
    config = engine_config(args).kv_events_config
    assert config == KVEventsConfig.parse(flag)
    assert config.publishes and config.buffer_steps == 100
    with pytest.raises(ValueError, match="unknown key.*block_size"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "block_size": 16}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse('{"publisher": "kafka"}')
    assert not KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).publishes
    with pytest.raises(ValueError, match="--enable-prefix-caching"):
        EngineConfig(model="m", kv_events_config=config)
    assert [(c.endpoint, c.replay_endpoint) for c in (config.for_replica(i) for i in range(2))] == [
        ("tcp://*:5557", "tcp://*:5657"),
        ("tcp://*:5558", "tcp://*:5658"),
    ]
    ipc = KVEventsConfig(enable_kv_cache_events=True, endpoint="ipc:///run/kv")
    assert ipc.for_replica(1).endpoint == "ipc:///run/kv_dp1"
