"""The engine's side of structured outputs and stop regexes: bounds checked up front, compiles
in the worker (engine/grammar_worker.py) cached by their text, failures too.

`Guides.prepare(params)` is what `AsyncEngine.prepare` runs before a request is submitted:
a constraint or stop regex past a size or nesting bound is refused at once; any other is
compiled in the worker unless its outcome is cached, and refused with the worker's error.
What it returns carries the compiled grammar (`guide_grammar`, which the rank builds its
matcher from, once per grammar) and each stop regex's matcher (`stop_regex_templates`, which
each request's watch copies). Nothing here compiles on the event loop: a stop regex's matcher,
already proven by the worker, is built in a thread.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING

from deltaserve.engine.grammar_worker import GrammarWorker, Job, Outcome, Setup
from deltaserve.engine.guided.stop_regex import StopTemplate, stop_template
from deltaserve.engine.sampling_params import ParamError
from deltaserve.engine.structured_config import StructuredOutputsConfig
from deltaserve.ipc.messages import GuideLimits

if TYPE_CHECKING:
    from deltaserve.engine.sampling_params import SamplingParams

MAX_CACHED_OUTCOMES = 1024
MAX_CACHED_BYTES = 16 * 2**20  # the grammars kept (failures keep their message only)
MAX_STOP_TEMPLATES = 256
_OPEN, _CLOSE = "([{", ")]}"


class Guides:
    def __init__(self, setup: Setup, config: StructuredOutputsConfig) -> None:
        self.config = config
        self.worker = GrammarWorker(setup, config)
        self._outcomes: OrderedDict[bytes, Outcome] = OrderedDict()
        self._compiling: dict[bytes, asyncio.Future[Outcome]] = {}  # one job per text at a time
        self._cached_bytes = 0
        self._stop_templates: OrderedDict[str, StopTemplate] = OrderedDict()

    async def prepare(self, params: SamplingParams) -> SamplingParams:
        """`params` with their constraint compiled and their stop regexes' matchers; a
        ParamError naming the field (then the bound, or what is wrong) where refused. Raises
        WorkerFailed where no compile worker could start."""
        if params.is_prepared:
            return params
        grammar = ""
        if (constraint := params.constraint()) is not None:
            self._check_size(constraint.field, constraint.text)
            outcome = await self._compile(
                Job(constraint.kind, constraint.text, constraint.whitespace)
            )
            if outcome.error:
                raise ParamError(constraint.field, f"{constraint.field}: {outcome.error}")
            grammar = outcome.grammar
        templates = await self._stop_regexes(params.stop_regex)
        limits = GuideLimits(self.config.max_lexer_states, self.config.max_mask_ms)
        return replace(
            params,
            guide_grammar=grammar,
            guide_limits=limits if grammar else None,
            stop_regex_templates=templates,
        )

    def _check_size(self, field: str, text: str) -> None:
        config = self.config
        if (size := len(text.encode())) > config.max_grammar_bytes:
            raise ParamError(
                field,
                f"{field}: {size} bytes; structured outputs take at most max_grammar_bytes "
                f"({config.max_grammar_bytes})",
            )
        if (depth := nesting_depth(text)) > config.max_nesting_depth:
            raise ParamError(
                field,
                f"{field}: nested {depth} brackets deep; at most max_nesting_depth "
                f"({config.max_nesting_depth})",
            )

    async def _stop_regexes(self, patterns: tuple[str, ...]) -> tuple[StopTemplate, ...]:
        config = self.config
        if len(patterns) > config.max_stop_regexes:
            raise ParamError(
                "stop_regex",
                f"stop_regex: {len(patterns)} regexes; at most max_stop_regexes "
                f"({config.max_stop_regexes})",
            )
        if (size := sum(len(p.encode()) for p in patterns)) > config.max_stop_regex_bytes:
            raise ParamError(
                "stop_regex",
                f"stop_regex: {size} bytes together; at most max_stop_regex_bytes "
                f"({config.max_stop_regex_bytes})",
            )
        templates = []
        for pattern in patterns:
            self._check_size("stop_regex", pattern)
            outcome = await self._compile(Job("stop_regex", pattern))
            if outcome.error:
                raise ParamError("stop_regex", f"stop_regex {pattern!r}: {outcome.error}")
            templates.append(await self._stop_template(pattern))
        return tuple(templates)

    async def _stop_template(self, pattern: str) -> StopTemplate:
        template = self._stop_templates.get(pattern)
        if template is None or template.spent:
            states = self.config.max_lexer_states
            template = await asyncio.to_thread(stop_template, pattern, states)
            self._stop_templates[pattern] = template
            while len(self._stop_templates) > MAX_STOP_TEMPLATES:
                self._stop_templates.popitem(last=False)
        self._stop_templates.move_to_end(pattern)
        return template

    async def _compile(self, job: Job) -> Outcome:
        """The job's outcome, from the cache, from the same text's compile under way, or from
        the worker."""
        key = hashlib.sha256(f"{job.kind}\0{job.whitespace!r}\0{job.text}".encode()).digest()
        outcome = self._outcomes.get(key)
        if outcome is None:
            pending = self._compiling.get(key)
            if pending is not None:
                return await asyncio.shield(pending)
            pending = self._compiling[key] = asyncio.get_running_loop().create_future()
            try:
                outcome = await self.worker.run(job)
            except asyncio.CancelledError:
                pending.cancel()
                raise
            except Exception as exc:
                pending.set_exception(exc)
                pending.exception()  # retrieved: no "never retrieved" warning without waiters
                raise
            finally:
                del self._compiling[key]
            pending.set_result(outcome)
            self._remember(key, outcome)
        self._outcomes.move_to_end(key)
        return outcome

    def _remember(self, key: bytes, outcome: Outcome) -> None:
        if key in self._outcomes:
            return
        self._outcomes[key] = outcome
        self._cached_bytes += len(outcome.grammar) + len(outcome.error)
        while len(self._outcomes) > MAX_CACHED_OUTCOMES or self._cached_bytes > MAX_CACHED_BYTES:
            _, old = self._outcomes.popitem(last=False)
            self._cached_bytes -= len(old.grammar) + len(old.error)

    async def close(self) -> None:
        await self.worker.close()


def nesting_depth(text: str) -> int:
    """How deep brackets of any kind nest in `text` (an escaped one does not count; quoted
    text does, so a schema's strings may count for more than they nest: a bound, not a
    parse)."""
    depth = deepest = 0
    escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif c in _CLOSE:
            depth = max(0, depth - 1)
    return deepest


__all__ = ["Guides", "nesting_depth"]
