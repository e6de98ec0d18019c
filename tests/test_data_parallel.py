"""Data parallelism (`deltaserve serve -dp N`, engine/data_parallel.py): two CPU replicas of
the tiny model, each with its own rank process, behind one engine. Requests spread over the
replicas and answer as one engine does; an abort reaches the replica holding the request;
through the server the official client is answered and /metrics adds the replicas up; a
replica that dies takes the whole engine down, every request ending once."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest
import pytest_asyncio
from engine_helpers import engine_config
from serve_helpers import metric_samples, openai_client, serving
from test_engine_faults import assert_gone

from deltaserve.engine.config import EngineConfig, replica_device_ids
from deltaserve.engine.data_parallel import DataParallelEngine
from deltaserve.engine.events import (
    EngineDeadError,
    ErrorEvent,
    FinishedEvent,
    QueueFullError,
    TokenEvent,
)
from deltaserve.engine.interface import Engine
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http import serve
from deltaserve.http.server import ServerConfig

module_loop = pytest.mark.asyncio(loop_scope="module")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir):
    engine = await serve._start_engine(
        engine_config(tiny_model_dir, data_parallel_size=2), asyncio.Event()
    )  # `serve -dp 2`
    yield engine
    await engine.shutdown()


async def events_of(stream) -> list:
    return await asyncio.wait_for(_drain(stream), 60)


async def _drain(stream) -> list:
    return [e async for e in stream]


def tokens_of(events: list) -> list[int]:
    assert isinstance(events[-1], FinishedEvent), events[-1]
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@module_loop
async def test_requests_spread_over_the_replicas_and_answer_as_one_engine(engine):
    assert isinstance(engine, Engine) and all(isinstance(r, Engine) for r in engine.replicas)
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(3)]
    before = [r.metrics.generation_tokens_total for r in engine.replicas]
    # each prompt twice at once: the two go to different replicas, which answer alike
    streams = [engine.generate(p, GREEDY) for p in prompts for _ in range(2)]
    answers = [
        tokens_of(events) for events in await asyncio.gather(*(events_of(s) for s in streams))
    ]
    assert answers[0::2] == answers[1::2] and len({tuple(a) for a in answers}) == 3
    served = [
        r.metrics.generation_tokens_total - b for r, b in zip(engine.replicas, before, strict=True)
    ]
    assert served == [24, 24], served
    load, parts = engine.load(), [r.load() for r in engine.replicas]
    assert load.num_slots == sum(p.num_slots for p in parts) == 8 and load.state == "serving"
    summed, each = engine.metrics, [r.metrics for r in engine.replicas]
    assert summed.generation_tokens_total == sum(m.generation_tokens_total for m in each)
    assert (
        summed.request_success_total["length"]
        == sum(m.request_success_total["length"] for m in each)
        >= 6
    )
    ttft = summed.time_to_first_token_s
    assert ttft.counts == [
        a + b for a, b in zip(*(m.time_to_first_token_s.counts for m in each), strict=True)
    ]
    assert ttft.count == sum(ttft.counts) == sum(m.time_to_first_token_s.count for m in each) >= 6
    assert len(await engine.rank_snapshots()) == 2
    # a call of 12 prompts: more than one replica's queue (8) takes, as many as the two do
    many, params = [[7, 8, 9]] * 12, [GREEDY] * 12
    engine.check(many, params)
    assert engine.max_queued_requests == 16  # the route's bound for one call: both queues
    with pytest.raises(QueueFullError):
        engine.replicas[0].check(many, params)
    with pytest.raises(QueueFullError):
        engine.check(many + [[1]] * 5, params + [GREEDY] * 5)


@module_loop
async def test_abort_reaches_the_replica_holding_the_request(engine):
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    streams = [engine.generate([5, 6, 7], long, request_id=f"job-{i}") for i in range(2)]
    await asyncio.sleep(0.3)
    assert sorted(engine.request_ids()) == ["job-0", "job-1"]
    assert [len(r.request_ids()) for r in engine.replicas] == [1, 1]
    for _ in range(2):  # an id in use on either replica is refused, as one engine refuses it
        with pytest.raises(ValueError, match="already in use"):
            engine.generate([1, 2], GREEDY, request_id="job-1")
    for i in range(2):
        await engine.abort(f"job-{i}")
    for events in await asyncio.gather(*(events_of(s) for s in streams)):
        assert isinstance(events[-1], FinishedEvent) and events[-1].reason == "abort"
    assert engine.request_ids() == []


@module_loop
async def test_maintenance_goes_to_every_replica(engine):
    await engine.sleep(1)
    assert engine.is_sleeping and all(r.is_sleeping for r in engine.replicas)
    waiting = asyncio.ensure_future(events_of(engine.generate([3, 4, 5], GREEDY)))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await engine.wake_up()
    assert not any(r.is_sleeping for r in engine.replicas) and len(tokens_of(await waiting)) == 8
    await engine.pause("wait")
    assert engine.is_paused and all(r.is_paused for r in engine.replicas)
    engine.resume()
    assert not any(r.is_paused for r in engine.replicas)


@module_loop
async def test_served_by_the_official_client_with_summed_metrics(engine):
    async with serving(engine, ServerConfig("tiny")) as server:
        async with openai_client(server) as client:
            before = engine.metrics.generation_tokens_total
            answers = await asyncio.gather(
                *(
                    client.completions.create(
                        model="tiny",
                        prompt=[9707, 11, 1879 + i],
                        max_tokens=4,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(4)
                )
            )
            assert all(a.usage.completion_tokens == 4 for a in answers)
        async with aiohttp.ClientSession() as session, session.get(server.url + "/metrics") as r:
            text = await r.text()
        async with (
            aiohttp.ClientSession() as session,
            session.get(server.url + "/get_server_info") as r,
        ):
            info = await r.json()
        assert info["dp_size"] == len(info["internal_states"]) == 2, (
            info
        )  # SGLang's: a state per replica
        generated = metric_samples(text, "tiny")["vllm:generation_tokens_total"]
        assert generated == engine.metrics.generation_tokens_total == before + 16


async def test_a_conversations_next_turn_goes_where_its_prefix_is_saved(tiny_model_dir):
    """With prefix caching, a prompt that begins with a saved one goes to the replica holding
    it (its FinishedEvent counts the cached tokens), though by load alone, both idle, the other
    replica's turn had come; an unrelated prompt still goes by load."""
    engine = await DataParallelEngine.start(
        engine_config(tiny_model_dir, enable_prefix_caching=True, data_parallel_size=2)
    )
    try:
        turn = [7 + i for i in range(40)]
        first = await events_of(engine.generate(turn, GREEDY))
        assert [len(r.request_ids()) for r in engine.replicas] == [0, 0]
        held = [r.cached_tokens(turn + tokens_of(first) + [5, 6, 7]) for r in engine.replicas]
        assert held.count(0) == 1 and max(held) > len(turn), (
            held
        )  # one replica saved the turn and its answer
        home = held.index(max(held))
        before = [r.metrics.prompt_tokens_total for r in engine.replicas]
        second = await events_of(engine.generate(turn + tokens_of(first) + [5, 6, 7], GREEDY))
        assert second[-1].cached_tokens > 0, "the second turn did not start from the first's state"
        grew = [
            r.metrics.prompt_tokens_total - b for r, b in zip(engine.replicas, before, strict=True)
        ]
        assert grew[home] > 0 and grew[1 - home] == 0, grew
        other = await events_of(engine.generate([900 + i for i in range(20)], GREEDY))
        assert other[-1].cached_tokens == 0
        assert engine.replicas[1 - home].metrics.prompt_tokens_total > before[1 - home], (
            "by load: the other one"
        )
    finally:
        await engine.shutdown()


def test_each_replica_takes_its_share_of_the_devices():
    """Replica i runs on the i-th tp_size of device_ids (default 0, 1, ...); the config
    refuses devices that do not make tp_size x data_parallel_size distinct ones, and a fixed
    monitor endpoint that every replica would bind."""
    cuda = EngineConfig(model="m", device="cuda", tp_size=2, data_parallel_size=2)
    assert [replica_device_ids(cuda, i) for i in range(2)] == [(0, 1), (2, 3)]
    given = EngineConfig(
        model="m", device="cuda", tp_size=2, data_parallel_size=2, device_ids=(4, 5, 6, 7)
    )
    assert [replica_device_ids(given, i) for i in range(2)] == [(4, 5), (6, 7)]
    assert replica_device_ids(EngineConfig(model="m", data_parallel_size=2), 1) is None  # cpu
    with pytest.raises(ValueError, match="need 4 distinct devices"):
        EngineConfig(
            model="m", device="cuda", tp_size=2, data_parallel_size=2, device_ids=(0, 1, 2)
        )
    with pytest.raises(ValueError, match="use 'auto'"):
        EngineConfig(model="m", monitor_endpoint="ipc:///tmp/x", data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        EngineConfig(model="m", data_parallel_size=0)


async def test_a_dying_replica_takes_the_engine_down_every_request_ending_once(tiny_model_dir):
    """Two replicas of tp 2 (four rank processes, a gloo group each): one rank of replica 0
    killed. Each choice ends once, with the event the contract names for where it ran: on the
    dead replica an ErrorEvent naming the death (fail closed), on the other, shut down at
    once, a FinishedEvent "abort" (its requests cannot have reached max_tokens by then)."""
    max_tokens = 1000
    engine = await DataParallelEngine.start(
        engine_config(
            tiny_model_dir,
            tp_size=2,
            step_timeout_s=30.0,
            max_model_len=max_tokens + 8,
            num_kv_blocks=4 * (max_tokens + 8) // 16 + 8,  # 4 choices of a replica at the end
            data_parallel_size=2,
        )
    )
    pids = engine.rank_pids
    assert len(pids) == 4
    try:
        long = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=2)
        streams = [engine.generate([40 + i, 50, 60], long) for i in range(4)]
        await asyncio.sleep(0.5)
        held = [set(r.request_ids()) for r in engine.replicas]
        assert all(held), "both replicas hold requests"
        assert sorted(len(h) for h in held) == [2, 2] and not held[0] & held[1], held
        os.kill(engine.replicas[0].rank_pids[0], signal.SIGKILL)
        results = await asyncio.gather(*(events_of(s) for s in streams))
        for stream, events in zip(streams, results, strict=True):
            terminal = [e for e in events if not isinstance(e, TokenEvent)]
            assert sorted(e.index for e in terminal) == [0, 1], terminal  # once per choice
            assert events[-1] in terminal  # nothing after a choice's end but the other's end
            if stream.request_id in held[0]:
                assert all(
                    isinstance(e, ErrorEvent) and "rank 0" in e.message and "SIGKILL" in e.message
                    for e in terminal
                ), terminal
            else:
                assert stream.request_id in held[1]
                assert all(
                    isinstance(e, FinishedEvent)
                    and e.reason == "abort"
                    and e.output_tokens < max_tokens
                    for e in terminal
                ), terminal
        assert engine.is_dead and engine.dead_reason.startswith("replica 0:"), engine.dead_reason
        assert engine.load().state == "dead"
        with pytest.raises(EngineDeadError):
            engine.generate([1, 2], GREEDY)
        await asyncio.wait_for(engine.wait_closed(), 30)  # the other replica was shut down too
        assert_gone(pids)
    finally:
        await engine.shutdown()
