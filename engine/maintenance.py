"""Work the engine does between requests: new weights (an RL loop's update, from a
checkpoint folder), a prefix-cache flush.

Asked for from outside the tick (AsyncEngine.update_weights, flush_cache); the tick runs the
queued operations once no request holds state on the ranks and no step is in flight, and
admits nothing while one waits: running requests finish on the weights they started with,
waiting ones start on the new ones. Saved prompt states (prefix caching) are forgotten with
every operation: they are the old weights' (SGLang flushes its radix cache the same way).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from deltaserve.engine.events import EngineDeadError
from deltaserve.engine.prefix_cache import PrefixCache

Kind = Literal["load_weights", "flush_cache"]


@dataclass(frozen=True, slots=True)
class Operation:
    kind: Kind
    model_dir: str | None  # load_weights: the checkpoint folder
    done: asyncio.Future[None]


class Maintenance:
    def __init__(self) -> None:
        self._queue: deque[Operation] = deque()

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def ask(self, kind: Kind, model_dir: str | None = None) -> asyncio.Future[None]:
        """Queue an operation; the future resolves once it ran (or with the reason it did not)."""
        done = asyncio.get_running_loop().create_future()
        self._queue.append(Operation(kind, model_dir, done))
        return done

    async def run(self, controller: Any, prefix: PrefixCache) -> None:
        """Every queued operation, in order (the tick calls this while nothing runs). A rank
        that fails to load poisons the replica: raised, after the operation's owner is told."""
        while self._queue:
            op = self._queue.popleft()
            try:
                if op.kind == "load_weights":
                    await controller.load_weights(op.model_dir)
                prefix.flush()
            except BaseException as exc:  # the replica is poisoned, or the tick cancelled
                _settle(op.done, EngineDeadError(f"{op.kind} failed: {exc!r}"))
                raise
            _settle(op.done, None)

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
