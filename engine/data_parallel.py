"""Data parallelism (vLLM's --data-parallel-size): several replicas of the model, each an
AsyncEngine on its own devices with its own ranks, scheduler and caches, behind the one
interface the HTTP server and asyncio clients use (engine/interface.py `Engine`). Replica i
runs on the i-th tp_size of the config's device_ids (engine/config.py `replica_config`).

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
import itertools
import logging
from collections.abc import Callable
from typing import Any

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import EngineDeadError, LoadSnapshot
from deltaserve.engine.metrics import summed_metrics
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.stream import RequestStream

log = logging.getLogger("deltaserve.engine")
# the worst of the replicas' states is the engine's
_STATE_ORDER = ("serving", "starting", "draining", "dead")


# ---- the fan-out: one of AsyncEngine's members over every replica, the answers combined ----


def _concat(parts: list[list[Any]]) -> list[Any]:
    return [x for part in parts for x in part]


def _first(parts: list[Any]) -> Any:
    return parts[0]


def _nothing(parts: list[Any]) -> None:
    return None


def _joined(endpoints: list[str | None]) -> str | None:
    return ", ".join(e for e in endpoints if e is not None) or None


def _combined(name: str, combine: Callable[[list[Any]], Any]) -> property:
    """A property: every replica's `name`, combined."""
    return property(lambda self: combine([getattr(r, name) for r in self.replicas]))


def _called(name: str, combine: Callable[[list[Any]], Any] = _nothing) -> Callable[..., Any]:
    """A method: every replica's `name` called with the arguments given, in turn; the
    results combined."""

    def call(self: DataParallelEngine, *args: Any, **kwargs: Any) -> Any:
        return combine([getattr(r, name)(*args, **kwargs) for r in self.replicas])

    call.__name__ = call.__qualname__ = name
    return call


def _awaited(name: str, combine: Callable[[list[Any]], Any] = _nothing) -> Callable[..., Any]:
    """A coroutine method: every replica's `name` at once; once all are done, the first error
    raised, else the results combined."""

    async def call(self: DataParallelEngine, *args: Any, **kwargs: Any) -> Any:
        calls = (getattr(r, name)(*args, **kwargs) for r in self.replicas)
        results = await asyncio.gather(*calls, return_exceptions=True)
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]
        return combine(results)

    call.__name__ = call.__qualname__ = name
    return call


def _on_first(name: str) -> Callable[..., Any]:
    """A coroutine method: replica 0's `name`, once the engine is alive (its tokenizer and its
    compiled grammars serve every replica in this process)."""

    async def call(self: DataParallelEngine, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        return await getattr(self.replicas[0], name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class DataParallelEngine:
    """Start with `await DataParallelEngine.start(config)` (config.data_parallel_size
    replicas), stop with `shutdown`. An Engine (engine/interface.py): each member means what
    AsyncEngine's does, over the replicas; the table below says how each combines them."""

    def __init__(self, replicas: list[AsyncEngine]) -> None:
        self.replicas = replicas
        first = replicas[0]
        self.config, self.model_config, self.tokenizer = (
            first.config,
            first.model_config,
            first.tokenizer,
        )
        self.max_model_len, self.max_logprobs, self.eos_token_ids = (
            first.max_model_len,
            first.max_logprobs,
            first.eos_token_ids,
        )
        self._picked = [0] * len(replicas)  # when each was last picked (a count of picks)
        self._picks = itertools.count(1)
        self._watch = asyncio.get_running_loop().create_task(self._fail_together())

    @classmethod
    async def start(cls, config: EngineConfig) -> DataParallelEngine:
        """Every replica started at once; if one fails, the others are shut down and its error
        raised."""
        replicas = range(config.data_parallel_size)
        started = await asyncio.gather(
            *(AsyncEngine.start(config, replica=i) for i in replicas), return_exceptions=True
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

    # ---- every replica's, combined ----------------------------------------------------------

    is_dead = _combined("is_dead", any)
    is_sleeping = _combined("is_sleeping", any)
    weights_dropped = _combined("weights_dropped", any)
    is_paused = _combined("is_paused", _first)  # every replica pauses and resumes together
    weights_dir = _combined("weights_dir", _first)  # ... and loads the same weights
    longest_sequence = _combined("longest_sequence", min)
    # a call of more choices than one queue takes is taken, spread
    max_queued_requests = _combined("max_queued_requests", sum)
    metrics = _combined("metrics", summed_metrics)
    rank_pids = _combined("rank_pids", _concat)
    # a monitor attaches to one replica: every replica's endpoint, comma-separated
    monitor_endpoint = _combined("monitor_endpoint", _joined)
    replica_loads = _called("load", list)
    request_ids = _called("request_ids", _concat)
    rank_snapshots = _awaited("rank_snapshots", _concat)
    wait_closed = _awaited("wait_closed")
    abort = _awaited("abort")
    # what changes the engine goes to every replica
    update_weights = _awaited("update_weights")
    flush_cache = _awaited("flush_cache")
    pause = _awaited("pause")
    resume = _called("resume")
    sleep = _awaited("sleep")
    wake_up = _awaited("wake_up")
    _shutdown_every = _awaited("shutdown")
    # tokenization and compiles: replica 0's
    run_tokenizer = _on_first("run_tokenizer")
    encode = _on_first("encode")
    media_prompt = _on_first("media_prompt")  # its processor too
    prepare = _on_first("prepare")

    @property
    def dead_reason(self) -> str | None:
        return next(
            (f"replica {i}: {r.dead_reason}" for i, r in enumerate(self.replicas) if r.is_dead),
            None,
        )

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

    def _check_alive(self) -> None:
        if (reason := self.dead_reason) is not None:
            raise EngineDeadError(f"engine is dead: {reason}")

    # ---- requests ---------------------------------------------------------------------------

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
        # an id a replica still holds goes to it, which refuses it while its request runs, as one
        # engine does
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

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """As AsyncEngine.shutdown, every replica at once."""
        await self._shutdown_every(drain_timeout_s)
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch


__all__ = ["DataParallelEngine"]
