"""What the engine tests share: an engine's config and placements, a stream's events
collected, the checks that an engine is idle with nothing held on any rank (or only its saved
prefixes, as the ledger says), and the plain path the engine is compared against
(`reference_tokens`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import ErrorEvent, FinishedEvent, TokenEvent
from deltaserve.engine.rank.executor import Executor
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.ipc.messages import ExecutorConfig, NewRequest, Sample, StepItem


def engine_config(model: Path, **overrides) -> EngineConfig:
    base = dict(
        model=str(model),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        num_kv_blocks=64,
        block_size=16,
        max_queued_requests=8,
        startup_timeout_s=90.0,
    )
    return EngineConfig(**{**base, **overrides})


# where an engine test runs: the CPU at TP 1 and 2 (gloo), and CUDA where there is one
PLACEMENTS = {"params": [("cpu", 1), ("cpu", 2), ("cuda", 1)], "ids": ["tp1", "tp2", "cuda"]}


async def start_placed(placement: tuple[str, int], model: Path, **overrides) -> AsyncEngine:
    """An engine on one of PLACEMENTS (skipped where there is no GPU), engine_config's otherwise."""
    device, tp_size = placement
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    return await AsyncEngine.start(
        engine_config(model, device=device, tp_size=tp_size, **overrides)
    )


async def collect(stream, timeout_s: float = 60.0) -> tuple[list[TokenEvent], object]:
    """All token events and the one terminal event of a single-choice stream."""
    events = await asyncio.wait_for(drain(stream), timeout_s)
    assert events and isinstance(events[-1], FinishedEvent | ErrorEvent), events[-1:]
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


async def drain(stream) -> list:
    return [e async for e in stream]


def ids_of(tokens: list[TokenEvent]) -> list[int]:
    return [t.token_id for t in tokens]


async def assert_idle_and_empty(engine: AsyncEngine) -> None:
    """Nothing running or waiting, and every rank holds no request, slot or block."""
    for _ in range(250):
        load = engine.load()
        if load.running == 0 and load.waiting == 0:
            break
        await asyncio.sleep(0.02)
    assert (load.running, load.waiting) == (0, 0), load
    assert (load.free_slots, load.free_blocks) == (load.num_slots, load.num_blocks), load
    for snap in await engine.rank_snapshots():
        assert (snap.request_ids, snap.slots_used, snap.blocks_used) == ([], 0, 0), snap


class PlanLog:
    """Records every dispatched plan (the scheduler's plan listeners)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.plans = []
        self._engine = engine
        engine.scheduler.plan_listeners.append(self.plans.append)

    def close(self) -> None:
        self._engine.scheduler.plan_listeners.remove(self.plans.append)

    def request_ids(self) -> set[int]:
        return {c.request_id for p in self.plans for c in p.chunks}


async def assert_ledger_is_every_ranks(engine: AsyncEngine) -> int:
    """Idle: no request anywhere; the blocks the saved prefixes hold, by the ledger, are what
    every rank has in use. Returns that count."""
    for _ in range(250):
        if engine.load().running == 0:
            break
        await asyncio.sleep(0.02)
    load = engine.load()
    assert (load.running, load.waiting, load.free_slots) == (0, 0, load.num_slots), load
    held = load.num_blocks - load.free_blocks
    for snap in await engine.rank_snapshots():
        assert (snap.request_ids, snap.slots_used, snap.blocks_used) == ([], 0, held), snap
    return held


def reference_tokens(
    model_dir: Path | str,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    num_logprobs: int = 0,
) -> list[Sample]:
    """The plain path the engine is compared against: the rank's executor in this process, no
    control plane, no scheduler; exactly `max_tokens` tokens after `prompt_ids` (no EOS ends
    them: the engine's requests it is held to ignore EOS)."""
    total = len(prompt_ids) + max_tokens
    config = ExecutorConfig(str(model_dir), max_num_seqs=1, num_kv_blocks=1)
    blocks = -(-total // config.block_size)
    executor = Executor(msgspec.structs.replace(config, num_kv_blocks=blocks))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=num_logprobs)
    first = StepItem(0, 0, list(prompt_ids), True, NewRequest(total, params.to_spec(seed)))
    samples = executor.run_step([first])
    while len(samples) < max_tokens:
        position = len(prompt_ids) + len(samples) - 1
        samples += executor.run_step([StepItem(0, position, [samples[-1].token_id], True)])
    return samples
