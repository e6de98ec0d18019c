"""Data parallelism (vLLM's --data-parallel-size): several replicas of the model, each an
AsyncEngine on its own devices with its own ranks, scheduler and caches, behind the one
interface the HTTP server and asyncio clients use.

A request goes to the replica holding the fewest unfinished requests (ties: the one picked
longest ago), unless prefix caching is on and another replica holds a saved prefix of its
prompt (token ids) and is not a whole batch (max_num_seqs) busier: then to the one holding the
longest, as SGLang's cache-aware router weighs hits against balance. A conversation's next turn
so finds its last turn's state. A request id that a replica still holds goes to that replica,
which refuses it while its request runs, as one engine does. Everything else that changes the
engine (pause, resume, flush, sleep, new weights, shutdown) goes to every replica. The
tokenizer and the limits are replica 0's: every replica serves the same model with the same
configuration.

Fail closed as one engine: when a replica dies, the others are shut down at once, so every
request owner still gets exactly one terminal event and the engine is dead, naming the
replica's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import EngineDeadError, LoadSnapshot
from deltaserve.engine.media import MediaSource
from deltaserve.engine.media_prompt import MultimodalPrompt
from deltaserve.engine.metrics import EngineMetrics, summed_metrics
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.stream import RequestStream
from deltaserve.ipc.messages import SnapshotReply

log = logging.getLogger("deltaserve.engine")
T = TypeVar("T")
# the worst of the replicas' states is the engine's
_STATE_ORDER = ("serving", "starting", "draining", "dead")


def replica_configs(
    config: EngineConfig, size: int, device_ids: tuple[int, ...] | None = None
) -> list[EngineConfig]:
    """Each replica's configuration: on CUDA replica i takes devices i * tp_size .. (i + 1) *
    tp_size - 1 of `device_ids` (default 0, 1, ...); a monitor endpoint only as "auto" (each
    replica publishes on its own)."""
    if size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {size}")
    if config.device_ids is not None:
        raise ValueError(
            "give a data-parallel engine's devices as device_ids (tp_size x data_parallel_size of them)"
        )
    if size > 1 and config.monitor_endpoint not in (None, "auto"):
        raise ValueError(
            f"monitor_endpoint {config.monitor_endpoint!r}: with data parallelism each replica "
            "publishes on its own endpoint; use 'auto'"
        )
    tp = config.tp_size
    if config.device != "cuda":
        if device_ids is not None:
            raise ValueError(
                f"device_ids {device_ids} given with device {config.device!r}; they name CUDA devices"
            )
        return [config] * size
    ids = tuple(range(tp * size)) if device_ids is None else tuple(device_ids)
    if len(ids) != tp * size or len(set(ids)) != len(ids):
        raise ValueError(
            f"device_ids {ids}: need {tp * size} distinct devices (tp_size {tp} x data_parallel_size {size})"
        )
    return [dataclasses.replace(config, device_ids=ids[i * tp : (i + 1) * tp]) for i in range(size)]


class DataParallelEngine:
    """Start with `await DataParallelEngine.start(config, size)`, stop with `shutdown`."""

    def __init__(self, replicas: list[AsyncEngine]) -> None:
        self.replicas = replicas
        first, n = replicas[0], len(replicas)
        # the engine's queue bounds are all the replicas' (a call of more choices than one queue
        # takes is taken, spread); the rest is each replica's
        self.config = dataclasses.replace(
            first.config,
            max_queued_requests=n * first.config.max_queued_requests,
            max_queued_tokens=n * first.config.max_queued_tokens,
        )
        self.model_config, self.tokenizer = first.model_config, first.tokenizer
        self.max_model_len, self.max_logprobs, self.eos_token_ids = (
            first.max_model_len,
            first.max_logprobs,
            first.eos_token_ids,
        )
        self._picked = [0] * len(replicas)  # when each was last picked (a count of picks)
        self._picks = itertools.count(1)
        self._watch = asyncio.get_running_loop().create_task(self._fail_together())

    @classmethod
    async def start(
        cls, config: EngineConfig, size: int, device_ids: tuple[int, ...] | None = None
    ) -> DataParallelEngine:
        """Every replica started at once; if one fails, the others are shut down and its error raised."""
        configs = replica_configs(config, size, device_ids)
        started = await asyncio.gather(
            *(AsyncEngine.start(c) for c in configs), return_exceptions=True
        )
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for replica in started:
                if isinstance(replica, AsyncEngine):
                    await replica.shutdown()
            raise failed[0]
        return cls(started)

    async def __aenter__(self) -> DataParallelEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def _fail_together(self) -> None:
        """Once a replica stops dead, shut the others down (their requests end now, each with
        one terminal event); a shutdown of the whole stops them all anyway."""
        waits = {asyncio.ensure_future(r.wait_closed()): r for r in self.replicas}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        dead = next((waits[t] for t in done if waits[t].is_dead), None)
        if dead is not None:
            log.error(
                "replica %d died (%s): shutting the others down",
                self.replicas.index(dead),
                dead.dead_reason,
            )
            await asyncio.gather(
                *(r.shutdown() for r in self.replicas if r is not dead), return_exceptions=True
            )

    # ---- state ------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return any(r.is_dead for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        return next(
            (f"replica {i}: {r.dead_reason}" for i, r in enumerate(self.replicas) if r.is_dead),
            None,
        )

    @property
    def is_paused(self) -> bool:
        return self.replicas[0].is_paused

    @property
    def weights_dir(self) -> str:
        return self.replicas[0].weights_dir

    @property
    def longest_sequence(self) -> int:
        return min(r.longest_sequence for r in self.replicas)

    @property
    def monitor_endpoint(self) -> str | None:
        """Every replica's endpoint, comma-separated (a monitor attaches to one replica)."""
        endpoints = [r.monitor_endpoint for r in self.replicas if r.monitor_endpoint is not None]
        return ", ".join(endpoints) or None

    @property
    def rank_pids(self) -> list[int]:
        return [pid for r in self.replicas for pid in r.rank_pids]

    @property
    def metrics(self) -> EngineMetrics:
        return summed_metrics([r.metrics for r in self.replicas])

    def load(self) -> LoadSnapshot:
        """The replicas' loads added up (step figures: the longest step's duration), in the
        worst of their states."""
        loads = [r.load() for r in self.replicas]
        added = {
            name: sum(getattr(load, name) for load in loads)
            for name in (
                "running",
                "waiting",
                "free_slots",
                "free_blocks",
                "num_slots",
                "num_blocks",
                "steps_total",
                "step_prefill_tokens",
                "step_decode_tokens",
                "prompt_tokens_total",
                "generation_tokens_total",
                "step_draft_tokens",
                "spec_decode_num_drafts_total",
                "spec_decode_num_draft_tokens_total",
                "spec_decode_num_accepted_tokens_total",
            )
        }
        state = max((load.state for load in loads), key=_STATE_ORDER.index)
        positions = (load.spec_decode_accepted_per_position for load in loads)
        per_position = [sum(counts) for counts in zip(*positions, strict=True)]  # replicas' k
        return LoadSnapshot(
            state=state,
            step_duration_s=max(load.step_duration_s for load in loads),
            spec_decode_accepted_per_position=per_position,
            **added,
        )

    def replica_loads(self) -> list[LoadSnapshot]:
        return [r.load() for r in self.replicas]

    async def rank_snapshots(self) -> list[SnapshotReply]:
        return [snap for r in self.replicas for snap in await r.rank_snapshots()]

    async def wait_closed(self) -> None:
        await asyncio.gather(*(r.wait_closed() for r in self.replicas))

    # ---- tokenization: replica 0's ----------------------------------------------------------

    async def run_tokenizer(self, fn: Callable[[Any], T], size: int) -> T:
        self._check_alive()
        return await self.replicas[0].run_tokenizer(fn, size)

    async def encode(self, text: str) -> list[int]:
        self._check_alive()
        return await self.replicas[0].encode(text)

    async def media_prompt(self, text: str, sources: list[MediaSource]) -> MultimodalPrompt:
        """As AsyncEngine.media_prompt: one replica's processor serves all."""
        self._check_alive()
        return await self.replicas[0].media_prompt(text, sources)

    def _check_alive(self) -> None:
        if (reason := self.dead_reason) is not None:
            raise EngineDeadError(f"engine is dead: {reason}")

    # ---- requests ---------------------------------------------------------------------------

    async def prepare(self, params: SamplingParams) -> SamplingParams:
        """As AsyncEngine.prepare: one replica compiles for all (the grammar and the stop
        regexes' matchers serve any replica in this process)."""
        return await self.replicas[0].prepare(params)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """As AsyncEngine.generate, on the replica `_route` chooses."""
        self._check_alive()
        holder = next(
            (i for i, r in enumerate(self.replicas) if request_id in r.request_ids()), None
        )
        # an id a replica still holds goes to it, which refuses it while its request runs, as one engine does
        i = self._route([prompt])[0] if request_id is None or holder is None else holder
        self._picked[i] = next(self._picks)
        return self.replicas[i].generate(prompt, params, request_id=request_id, priority=priority)

    def _route(self, prompts: list[str | list[int]]) -> list[int]:
        """The replica each prompt goes to, submitted one after another: the least busy, or the
        one holding the longest saved prefix of it (see the module's doc)."""
        count = range(len(self.replicas))
        busy = [len(r.request_ids()) for r in self.replicas]
        picked, stamp = list(self._picked), max(self._picked)
        routes = []
        for prompt in prompts:
            i = least = min(count, key=lambda i: (busy[i], picked[i]))
            if self.config.enable_prefix_caching and not isinstance(prompt, str):
                cached = [r.cached_tokens(prompt) for r in self.replicas]
                best = max(count, key=lambda i: (cached[i], -busy[i], -picked[i]))
                if (
                    cached[best] > 0
                    and busy[best] < busy[least] + self.replicas[best].config.max_num_seqs
                ):
                    i = best
            stamp += 1
            busy[i], picked[i] = busy[i] + 1, stamp
            routes.append(i)
        return routes

    def check(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        request_id: str | None = None,
    ) -> None:
        """As AsyncEngine.check: each replica checks the prompts `generate` would send it."""
        self._check_alive()
        routes = self._route(prompts)
        for i, replica in enumerate(self.replicas):
            if mine := [k for k, route in enumerate(routes) if route == i]:
                replica.check([prompts[k] for k in mine], [params[k] for k in mine], request_id)

    def request_ids(self) -> list[str]:
        return [rid for r in self.replicas for rid in r.request_ids()]

    async def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            await replica.abort(request_id)

    # ---- every replica ----------------------------------------------------------------------

    async def _each(self, call: Callable[[AsyncEngine], Any]) -> None:
        """`call` on every replica at once; the first error raised once all are done."""
        results = await asyncio.gather(*(call(r) for r in self.replicas), return_exceptions=True)
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]

    async def update_weights(self, model_dir: str, abort_running: bool = False) -> None:
        await self._each(lambda r: r.update_weights(model_dir, abort_running=abort_running))

    async def flush_cache(self) -> None:
        await self._each(lambda r: r.flush_cache())

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._each(lambda r: r.pause(mode, clear_cache))

    def resume(self) -> None:
        for replica in self.replicas:
            replica.resume()

    async def sleep(self, level: int = 1) -> None:
        await self._each(lambda r: r.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._each(lambda r: r.wake_up(tags))

    @property
    def is_sleeping(self) -> bool:
        return any(r.is_sleeping for r in self.replicas)

    @property
    def weights_dropped(self) -> bool:
        return any(r.weights_dropped for r in self.replicas)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """As AsyncEngine.shutdown, every replica at once."""
        await self._each(lambda r: r.shutdown(drain_timeout_s))
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch


__all__ = ["DataParallelEngine", "replica_configs"]
