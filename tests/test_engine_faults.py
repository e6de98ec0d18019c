"""Fail closed: a rank fault under load, and a rank dying while the engine is idle; what an
aborted choice's last event carries."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import EngineDeadError, ErrorEvent, FinishedEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.ipc.faults import FaultPlan


def config(model, **overrides) -> EngineConfig:
    base = dict(
        model=str(model),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        num_kv_blocks=64,
        startup_timeout_s=90.0,
        step_timeout_s=30.0,
    )
    return EngineConfig(**{**base, **overrides})


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # not running, and reaped (a zombie would still answer)


async def events_of(stream) -> list:
    return [e async for e in stream]


async def test_rank_fault_under_load_fails_closed(tiny_model_dir):
    """Rank 1 dies inside the 6th step with requests running, waiting and just submitted:
    every choice ends with exactly one ErrorEvent, nothing hangs, later calls fail with
    EngineDeadError, an idle terminal snapshot is published, and no rank process remains."""
    fault = FaultPlan(rank=1, kind="die_mid_step", at_step=6)
    engine = await AsyncEngine.start(config(tiny_model_dir, tp_size=2, fault=fault))
    try:
        loads = []
        engine.scheduler.load_listeners.append(loads.append)
        pids = engine.rank_pids
        assert len(pids) == 2
        params = SamplingParams(max_tokens=40, temperature=0.7, seed=1)
        streams = [engine.generate([100 + i, 200 + i, 300 + i] * (i + 1), params) for i in range(6)]
        streams.append(
            engine.generate([7, 8, 9], SamplingParams(max_tokens=40, temperature=0, n=2))
        )
        late = []

        def submit_during_fatal_step(plan) -> None:
            if (
                engine.scheduler.metrics.steps_total == 5 and not late
            ):  # the 6th step is dispatching
                late.append(engine.generate([5, 6], params))

        engine.scheduler.plan_listeners.append(submit_during_fatal_step)
        results = await asyncio.wait_for(asyncio.gather(*(events_of(s) for s in streams)), 60)
        results.append(await asyncio.wait_for(events_of(late[0]), 10))
        num_choices = 0
        for events in results:
            terminal = [e for e in events if not isinstance(e, TokenEvent)]
            indices = sorted(e.index for e in terminal)
            assert indices == list(range(len(indices))) and len(indices) >= 1
            assert all(isinstance(e, ErrorEvent) and "rank 1" in e.message for e in terminal), (
                terminal
            )
            assert not isinstance(events[-1], TokenEvent)
            num_choices += len(indices)
        assert num_choices == 9
        assert engine.is_dead and "rank 1" in engine.dead_reason
        assert engine.metrics.request_success_total["error"] == 9
        final = engine.load()
        assert final.is_dead and (final.running, final.waiting) == (0, 0) and loads[-1] == final
        assert final.free_slots == final.num_slots
        with pytest.raises(EngineDeadError):
            engine.generate([1, 2], params)
        with pytest.raises(EngineDeadError):
            await engine.rank_snapshots()
        await engine.abort("anything")  # no-op, no error
        await asyncio.wait_for(engine.wait_closed(), 15)  # it tears itself down
        assert_gone(pids)
    finally:
        await engine.shutdown()


async def test_rank_death_while_idle_kills_the_engine(tiny_model_dir):
    engine = await AsyncEngine.start(config(tiny_model_dir))
    try:
        events = await events_of(
            engine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
        )
        assert isinstance(events[-1], FinishedEvent)
        pids = engine.rank_pids
        os.kill(pids[0], signal.SIGKILL)
        for _ in range(200):
            if engine.is_dead:
                break
            await asyncio.sleep(0.025)
        assert engine.is_dead and "rank 0" in engine.dead_reason
        assert engine.load().is_dead
        with pytest.raises(EngineDeadError, match="rank 0"):
            engine.generate([1, 2, 3], SamplingParams())
        await asyncio.wait_for(engine.wait_closed(), 15)
        assert_gone(pids)
    finally:
        await engine.shutdown()


async def test_owners_hear_of_a_poisoned_replica_before_its_teardown(tiny_model_dir):
    """Rank 1 stalls before its receipt of the 4th step: the gate times out and cancels the
    step, and the stalled rank never acks the cancel, so the teardown waits out its grace
    (CANCEL_GRACE_S) before killing it. Every owner hears of the death while that rank still
    runs, i.e. before the teardown (DESIGN: errors first, then teardown); they were told only
    once the teardown was over."""
    fault = FaultPlan(rank=1, kind="stall_before_receipt", at_step=4, stall_s=60.0)
    engine = await AsyncEngine.start(
        config(tiny_model_dir, tp_size=2, step_timeout_s=2.0, fault=fault)
    )
    try:
        stalled = engine.rank_pids[1]

        async def consume(stream) -> tuple[list, bool]:
            events = [e async for e in stream]
            try:
                os.kill(stalled, 0)
                return events, True
            except ProcessLookupError:
                return events, False

        params = SamplingParams(max_tokens=40, temperature=0)
        results = await asyncio.wait_for(
            asyncio.gather(*(consume(engine.generate([11 + i, 12, 13], params)) for i in range(3))),
            30,
        )
        assert all(isinstance(events[-1], ErrorEvent) for events, _ in results)
        assert all(alive for _, alive in results), (
            "an owner heard only after the stalled rank was killed"
        )
        await asyncio.wait_for(engine.wait_closed(), 30)
        assert_gone(engine.rank_pids)
    finally:
        await engine.shutdown()


async def test_abort_delivers_the_withheld_text(tiny_model_dir):
    """Text held back while it might be the start of a stop string is part of the output once
    the request ends without that stop string: an abort's FinishedEvent carries it, so the
    choice's text adds up to the text of the tokens it was told of (`output_tokens`), as
    vLLM's final abort output does (its detokenizer's text with `finished=True`)."""
    engine = await AsyncEngine.start(config(tiny_model_dir))
    try:
        never = "\x07" * 40  # no output holds it: the last 39 characters are always held back
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=[never])
        tokens, finished = [], []
        async for event in engine.generate([11, 12, 13], params, request_id="held"):
            if isinstance(event, TokenEvent):
                tokens.append(event)
                if len(tokens) == 12:
                    await engine.abort("held")
            else:
                finished.append(event)
        [fin] = finished
        assert isinstance(fin, FinishedEvent) and fin.reason == "abort"
        assert fin.output_tokens == len(tokens) < 200
        text = engine.tokenizer.decode([e.token_id for e in tokens], skip_special_tokens=True)
        streamed = "".join(e.text for e in tokens)
        assert text and streamed != text  # something was held back
        assert streamed + fin.text == text
        # A cancelled shutdown call (say, a timeout around it) cancelled the scheduler task: the
        # clean shutdown became a failure ("engine task cancelled" ErrorEvents, is_dead), and
        # the caller's cancellation was swallowed. Now only the wait is cancelled.
        running = engine.generate([11, 12, 13], params)
        await running.__anext__()
        pids = engine.rank_pids
        call = asyncio.create_task(engine.shutdown())
        await asyncio.sleep(0)  # the call has begun the shutdown
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        *_, last = await asyncio.wait_for(events_of(running), 30)
        assert isinstance(last, FinishedEvent) and last.reason == "abort", last
        await asyncio.wait_for(engine.wait_closed(), 30)
        assert not engine.is_dead and engine.load().is_dead  # stopped, not failed
        assert_gone(pids)
    finally:
        await engine.shutdown()
