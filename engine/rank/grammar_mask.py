"""Rank 0's guided decoding: each guided request's llguidance matcher, the token masks the
library fills for them, and the bounds that end a request alone.

The engine compiled each grammar once (engine/guides.py) and sends it with the request; here
a matcher is built for it the first time it comes (a template: the engine's worker proved it
builds within the bounds) and each request copies it. The copies share the template's lexer,
whose states the next requests reuse, under one lock: measured, eight copies filled at once
in threads took five times as long as eight matchers of their own (and than filling the eight
copies one after another). So a grammar's requests are spread over lanes, each a template of its own
whose requests are filled one after another in one thread, the lanes in parallel (llguidance lets go
of the GIL). A grammar gets another lane while its lanes hold LANE_REQUESTS requests each, up to
MAX_LANES, where its template took no more than LANE_BUILD_MS to build (each lane is one more
build). Grammars no request uses keep their lanes a while (GRAMMARS_KEPT), never a lane that went
past a bound.

Each mask is timed: one longer than its request's `max_mask_ms` fails that request, and the
step waits no longer than that per request of a lane (a late fill finishes in its thread, into
an array of its own; the lane's requests not filled by then fail too: theirs is the same
grammar). A matcher in llguidance's error state (its lexer past max_lexer_states, its parser
past the library's items or fuel) fails its request. A failure is reported once, with the
request's next sample (`SampleColumns.failed`); the engine ends the request with an error and
drops it, every other request carries on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deltaserve.engine.guided.runtime import error_summary, parser_limits
from deltaserve.ipc.messages import GuideLimits

log = logging.getLogger("deltaserve.rank")
GRAMMARS_KEPT = 8  # grammars whose lanes stay after their requests end
MAX_LANES = 4  # lanes of one grammar at most
LANE_REQUESTS = 16  # requests a lane takes before its grammar gets another
LANE_BUILD_MS = 50.0  # a grammar slower to build keeps one lane
MASK_THREADS = 8  # lanes filled at once (a late fill holds one until it ends)


@dataclass(eq=False, slots=True)
class _Lane:
    """A template of one grammar and the requests that copy it (filled in one thread)."""

    template: object
    live: int = 0


@dataclass(eq=False, slots=True)
class _Grammar:
    lanes: list[_Lane] = field(default_factory=list)
    build_ms: float = 0.0  # its first template's


@dataclass(eq=False, slots=True)
class _Guided:
    """One request's matcher; `failure` once it went past a bound (`reported`: sent)."""

    matcher: object | None
    key: tuple
    lane: _Lane | None
    limits: GuideLimits
    failure: str | None = None
    reported: bool = False


class GuideMatchers:
    """`tokenizer(end_ids)` makes llguidance's tokenizer of the model's vocabulary, whose end
    tokens are `end_ids`; made the first time a guided request comes."""

    def __init__(self, tokenizer: Callable[[tuple[int, ...]], object]) -> None:
        self._tokenizer = tokenizer
        self._tokenizers: dict[tuple[int, ...], object] = {}
        self._grammars: OrderedDict[tuple, _Grammar] = OrderedDict()
        self._requests: dict[int, _Guided] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._requests

    def add(
        self, request_id: int, grammar: str, end_ids: tuple[int, ...], limits: GuideLimits
    ) -> None:
        """Its matcher, a copy of a lane's template of its grammar; a grammar that does not
        build is the request's failure, reported with its first sample."""
        key = (grammar, end_ids, limits)
        known = self._grammars.setdefault(key, _Grammar())
        self._grammars.move_to_end(key)
        lane = min(known.lanes, key=lambda lane: lane.live, default=None)
        wants_lane = lane is None or (
            lane.live >= LANE_REQUESTS
            and len(known.lanes) < MAX_LANES
            and known.build_ms <= LANE_BUILD_MS
        )
        failure = None
        if wants_lane:
            started = time.perf_counter()
            try:
                template = self._build(grammar, end_ids, limits)
            except Exception as exc:  # no vocabulary, or llguidance refusing: this request's
                failure = f"structured outputs: its matcher could not be built: {exc!r}"
            else:
                if template.is_error():
                    failure = (
                        "structured outputs: its grammar does not build: "
                        f"{error_summary(template.get_error())}"
                    )
                else:
                    lane = _Lane(template)
                    known.lanes.append(lane)
                    if len(known.lanes) == 1:
                        known.build_ms = 1e3 * (time.perf_counter() - started)
        if failure is not None:
            self._requests[request_id] = _Guided(None, key, None, limits, failure)
        else:
            lane.live += 1
            self._requests[request_id] = _Guided(lane.template.deep_copy(), key, lane, limits)
        self._trim()

    def _build(self, grammar: str, end_ids: tuple[int, ...], limits: GuideLimits) -> object:
        """A grammar's template on the vocabulary (read the first time: its failure is kept,
        each later request fails at once rather than reading it again)."""
        from llguidance import LLMatcher

        tokenizer = self._tokenizers.get(end_ids)
        if tokenizer is None:
            try:
                tokenizer = self._tokenizer(end_ids)
            except Exception as exc:
                tokenizer = exc
            self._tokenizers[end_ids] = tokenizer
        if isinstance(tokenizer, Exception):
            raise tokenizer
        bounds = parser_limits(limits.max_lexer_states)
        return LLMatcher(tokenizer, grammar, log_level=0, limits=bounds)

    def remove(self, request_id: int) -> None:
        """Forget a request; idempotent."""
        g = self._requests.pop(request_id, None)
        if g is not None:
            if g.lane is not None:
                g.lane.live -= 1
            self._trim()

    def masks(
        self, request_ids: list[int], width: int, drafts: list[tuple[int, ...]] | None = None
    ) -> np.ndarray:
        """Int32 [len(request_ids), ceil(width / 32)]: bit t of each row (word t // 32, bit
        t % 32) set where its request may sample token t next. A request that failed (now, or
        before) gets a row of every token; `take_failures` says which. With `drafts`
        (speculative decoding), each request's mask after its drafts: its matcher takes them
        first and is rolled back after; drafts it cannot take leave a row of every token (a
        row never reached: the one before it could not sample the draft)."""
        if drafts is None:
            return self._masks(request_ids, width)
        taken = []
        for rid, tokens in zip(request_ids, drafts, strict=True):
            g = self._requests[rid]
            ok = g.failure is None and g.matcher.validate_tokens(list(tokens)) == len(tokens)
            if ok:
                g.matcher.consume_tokens(list(tokens))
            taken.append(len(tokens) if ok else -1)
        reached = [i for i, n in enumerate(taken) if n >= 0]
        rows = np.full((len(request_ids), (width + 31) // 32), -1, dtype=np.int32)
        try:
            rows[reached] = self._masks([request_ids[i] for i in reached], width)
        finally:
            for i in reached:
                g = self._requests[request_ids[i]]
                if g.matcher is not None:  # a request that failed now has none
                    g.matcher.rollback(taken[i])
        return rows

    def _masks(self, request_ids: list[int], width: int) -> np.ndarray:
        rows = np.full((len(request_ids), (width + 31) // 32), -1, dtype=np.int32)
        lanes: dict[int, list[tuple[int, _Guided]]] = {}  # id(lane) -> its (row, request)
        for i, rid in enumerate(request_ids):
            g = self._requests[rid]
            if g.failure is None:
                lanes.setdefault(id(g.lane), []).append((i, g))
        if not lanes:
            return rows
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                MASK_THREADS, thread_name_prefix="guide-mask"
            )
        live = [entry for entries in lanes.values() for entry in entries]
        filled = np.zeros((len(live), rows.shape[1]), dtype=np.int32)  # a late fill's own
        took = np.full(len(live), np.nan)  # ms each fill took; nan: not done
        futures, first = [], 0
        for entries in lanes.values():
            order = list(range(first, first + len(entries)))
            matchers = [g.matcher for _, g in entries]
            futures.append(self._pool.submit(_fill_lane, matchers, order, filled, took))
            first += len(entries)
        longest = max(len(entries) for entries in lanes.values())
        bound_s = longest * max(g.limits.max_mask_ms for _, g in live) / 1e3
        concurrent.futures.wait(futures, timeout=bound_s)  # a late lane's rows stay nan
        for j, (i, g) in enumerate(live):
            bound = g.limits.max_mask_ms
            if np.isnan(took[j]):
                self._fail(g, f"max_mask_ms ({bound:g} ms): a token mask took longer")
            elif took[j] > bound:
                self._fail(g, f"max_mask_ms ({bound:g} ms): a token mask took {took[j]:.0f} ms")
            elif g.matcher.is_error():
                self._fail_on_error(g)
            else:
                rows[i] = filled[j]
        return rows

    def consume(self, request_id: int, token: int) -> None:
        """The request's sampled token; one its matcher cannot take (only past a bound: the
        mask offered it) fails the request."""
        g = self._requests.get(request_id)
        if g is not None and g.failure is None and not g.matcher.consume_token(token):
            self._fail_on_error(g)

    def take_failures(self, request_ids: list[int]) -> dict[int, str]:
        """The failures of these requests not reported yet, now reported."""
        out = {}
        for rid in request_ids:
            g = self._requests.get(rid)
            if g is not None and g.failure is not None and not g.reported:
                g.reported = True
                out[rid] = g.failure
        return out

    def _fail_on_error(self, g: _Guided) -> None:
        """The matcher's error state: which of llguidance's limits it went past."""
        error = error_summary(g.matcher.get_error())
        if "too many states" in error:
            bound = f"max_lexer_states ({g.limits.max_lexer_states})"
        elif "too many expressions" in error:
            bound = "the lexer's work per token (llguidance's fuel)"
        elif "items" in error:
            bound = "llguidance's Earley items per step (max_items_in_row, step_max_items)"
        else:
            bound = "llguidance's parser limits"
        self._fail(g, f"{bound}: {error}")

    def _fail(self, g: _Guided, reason: str) -> None:
        """A request past a bound: its lane goes too (its lexer's states are shared); the
        requests still on it keep their copies."""
        g.failure, g.matcher = f"structured outputs went past {reason}", None
        known = self._grammars.get(g.key)
        if known is not None and g.lane in known.lanes:
            known.lanes.remove(g.lane)
        if g.lane is not None:
            g.lane.live -= 1
            g.lane = None

    def _trim(self) -> None:
        """Grammars no request uses: the most recent GRAMMARS_KEPT keep their lanes."""
        idle = [k for k, known in self._grammars.items() if not any(x.live for x in known.lanes)]
        for key in idle[: max(0, len(idle) - GRAMMARS_KEPT)]:
            del self._grammars[key]


def load_tokenizer(model_dir: str, vocab_size: int, end_ids: tuple[int, ...]) -> object:
    """llguidance's tokenizer of the model's tokenizer.json, masks `vocab_size` wide (the
    model's rows, padding included), ending with `end_ids`."""
    from llguidance import LLTokenizer

    started = time.monotonic()
    text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
    tokenizer = LLTokenizer(text, n_vocab=vocab_size, eos_token=list(end_ids))
    log.info("guided decoding's vocabulary read in %.1f s", time.monotonic() - started)
    return tokenizer


def _fill_lane(
    matchers: list[object], order: list[int], rows: np.ndarray, took: np.ndarray
) -> None:
    """One lane's masks, one after another: `rows[order[k]]` from `matchers[k]`, and the
    milliseconds each took in `took`."""
    for matcher, j in zip(matchers, order, strict=True):
        started = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(rows[j].ctypes.data, rows[j].nbytes)
        took[j] = 1e3 * (time.perf_counter() - started)


__all__ = ["GRAMMARS_KEPT", "GuideMatchers", "load_tokenizer"]
