"""Work the engine does between requests: new weights (an RL loop's update, from a
checkpoint folder), a prefix-cache flush, sleep mode (the ranks give their device memory back
until a wake-up: engine/rank/sleep_mode.py), and pausing generation around them.

Asked for from outside the tick (AsyncEngine.update_weights, flush_cache, pause); the tick runs
the queued operations, in order, once no step is in flight and no request holds state on the
ranks, and admits nothing while one waits: running requests finish on the weights they
started with, waiting ones start on the new ones. Saved prompt states (prefix caching) are
forgotten with new weights: they are the old weights' (SGLang flushes its radix cache so).

A level-2 sleep discards the weights: from then until new ones load, nothing is admitted,
awake or not (the ranks would answer from garbage memory), and AsyncEngine.generate refuses.

A pause holds admission until `resume` (vLLM's pause modes): "abort" and "wait" take effect
once the running requests are aborted or have ended; "keep" freezes them where they are (no
step runs), and an update then runs beside them: they go on with the new weights on resume,
their states made by the old (vLLM's in-flight update for asynchronous RL).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from deltaserve.engine.events import EngineDeadError
from deltaserve.engine.prefix_cache import PrefixCache
from deltaserve.ipc.messages import SLEEP_TAGS, LoadWeights, Sleep, WakeUp

Kind = Literal["load_weights", "flush_cache", "pause", "sleep", "wake_up"]
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True, slots=True)
class Operation:
    kind: Kind
    done: asyncio.Future[None]
    model_dir: str | None = None  # load_weights: the checkpoint folder
    mode: PauseMode = "wait"  # pause: how it treats the running requests
    flush: bool = False  # pause: also forget the saved prompt states (vLLM's clear_cache)
    level: int = 1  # sleep: 1 keeps the weights on the host, 2 drops them
    tags: tuple[str, ...] = SLEEP_TAGS  # wake_up: what it takes back


class Maintenance:
    def __init__(self) -> None:
        self._queue: deque[Operation] = deque()
        self.paused: PauseMode | None = None
        self.asleep: set[str] = set()  # the sleep tags not yet woken
        self.weights_dropped = False  # by a level-2 sleep, until new weights load

    @property
    def pending(self) -> bool:
        """Whether an operation waits to run."""
        return bool(self._queue)

    @property
    def admits(self) -> bool:
        """Whether the tick may admit requests: no operation waits, generation is not paused,
        the ranks are awake and hold weights."""
        return (
            not self.pending
            and self.paused is None
            and not self.asleep
            and not self.weights_dropped
        )

    @property
    def frozen(self) -> bool:
        """No step may run: paused with "keep", or such a pause waits for the step in flight."""
        return self.paused == "keep" or any(
            op.kind == "pause" and op.mode == "keep" for op in self._queue
        )

    def ready(self, running: bool) -> bool:
        """Whether the next operation can run now that no step is in flight: once no request
        is on the ranks, or beside frozen ones."""
        return self.pending and (not running or self.frozen)

    def ask(self, kind: Kind, model_dir: str | None = None, **options: Any) -> asyncio.Future[None]:
        """Queue an operation (`options`: Operation's); the future resolves once it ran (or
        with the reason it did not)."""
        done = asyncio.get_running_loop().create_future()
        self._queue.append(Operation(kind, done, model_dir, **options))
        return done

    def resume(self) -> None:
        """Generation goes on; a pause that has not taken effect yet never will."""
        self.paused = None
        for op in [op for op in self._queue if op.kind == "pause"]:
            self._queue.remove(op)
            _settle(op.done, ValueError("resumed before the pause took effect"))

    async def run(self, controller: Any, prefix: PrefixCache) -> None:
        """Every queued operation, in order (the tick calls this when `ready`). A rank that
        fails to load poisons the replica: raised, after the operation's owner is told."""
        while self._queue:
            op = self._queue.popleft()
            if refusal := self._refusal(op):
                _settle(op.done, ValueError(refusal))
                continue
            try:
                if op.kind == "load_weights":
                    await controller.maintain(LoadWeights(0, op.model_dir))
                    self.weights_dropped = False
                if op.kind == "sleep":  # the saved prefixes' states and blocks go with the cache
                    prefix.flush()
                    await controller.drop([], "must_be_absent", evict=prefix.take_evicted())
                    self.weights_dropped = self.weights_dropped or op.level == 2
                    await controller.maintain(Sleep(0, op.level))
                    self.asleep = set(SLEEP_TAGS)
                if op.kind == "wake_up" and self.asleep & set(op.tags):
                    await controller.maintain(WakeUp(0, list(op.tags)))
                    self.asleep -= set(op.tags)
                if op.kind == "pause":
                    self.paused = op.mode
                if op.kind in ("load_weights", "flush_cache") or op.flush:
                    prefix.flush()
            except BaseException as exc:  # the replica is poisoned, or the tick cancelled
                _settle(op.done, EngineDeadError(f"{op.kind} failed: {exc!r}"))
                raise
            _settle(op.done, None)

    def _refusal(self, op: Operation) -> str | None:
        """Why `op` cannot run now (sleep mode's rules), or None."""
        if op.kind == "sleep" and self.asleep:
            return "the engine is asleep already"
        if op.kind == "sleep" and self.frozen:
            return "requests frozen by a keep pause hold the cache: resume them first"
        if op.kind == "load_weights" and "weights" in self.asleep:
            return "the weights are asleep: wake_up(['weights']) first"
        return None

    def fail(self, reason: str) -> None:
        """The engine stopped or died with operations queued: each owner hears why."""
        while self._queue:
            _settle(self._queue.popleft().done, EngineDeadError(reason))


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():  # its owner stopped waiting
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
