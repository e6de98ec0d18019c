"""Rank 0's guided decoding: each guided request's llguidance matcher, the token masks the
library fills for them, and the bounds that end a request alone.

The engine compiled each grammar once (engine/guided.py) and sends it with the request; here
one matcher per grammar is built the first time it comes (a template: the engine's worker
proved it builds within the bounds) and each request copies it (the copies share its lexer,
whose states the next requests reuse). Templates of grammars no request uses are kept a
while (TEMPLATES_KEPT), never one that went past a bound.

A step's masks are filled in threads (llguidance lets go of the GIL), each timed: a mask
that takes longer than its request's `max_mask_ms` fails that request, and the step waits no
longer than that for it (the late fill finishes in its thread, into an array of its own).
A matcher in llguidance's error state (its lexer past max_lexer_states, its parser past the
library's items or fuel) fails its request too. A failure is reported once, with the
request's next sample (`SampleColumns.failed`); the engine ends the request with an error
and drops it, every other request carries on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deltaserve.engine.guide_grammar import error_summary, parser_limits
from deltaserve.ipc.messages import GuideLimits

log = logging.getLogger("deltaserve.rank")
TEMPLATES_KEPT = 8  # grammars whose matcher stays after their requests end
MASK_THREADS = 16  # a late fill holds one until it ends; the others go on meanwhile


@dataclass(eq=False, slots=True)
class _Guided:
    """One request's matcher; `failure` once it went past a bound (`reported`: sent)."""

    matcher: object | None
    template_key: tuple
    limits: GuideLimits
    failure: str | None = None
    reported: bool = False


class GuideMatchers:
    """`tokenizer(end_ids)` makes llguidance's tokenizer of the model's vocabulary, whose end
    tokens are `end_ids`; made the first time a guided request comes."""

    def __init__(self, tokenizer: Callable[[tuple[int, ...]], object]) -> None:
        self._tokenizer = tokenizer
        self._tokenizers: dict[tuple[int, ...], object] = {}
        self._templates: OrderedDict[tuple, object] = OrderedDict()
        self._requests: dict[int, _Guided] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._requests

    def add(
        self, request_id: int, grammar: str, end_ids: tuple[int, ...], limits: GuideLimits
    ) -> None:
        """Its matcher, a copy of its grammar's template; a grammar that does not build is the
        request's failure, reported with its first sample."""
        key = (grammar, end_ids, limits)
        template = self._templates.get(key)
        failure = None
        if template is None:
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
                    self._templates[key] = template
        if key in self._templates:
            self._templates.move_to_end(key)
        matcher = None if failure else template.deep_copy()
        self._requests[request_id] = _Guided(matcher, key, limits, failure)
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
        if self._requests.pop(request_id, None) is not None:
            self._trim()

    def masks(self, request_ids: list[int], width: int) -> np.ndarray:
        """Int32 [len(request_ids), ceil(width / 32)]: bit t of each row (word t // 32, bit
        t % 32) set where its request may sample token t next. A request that failed (now, or
        before) gets a row of every token; `take_failures` says which."""
        rows = np.full((len(request_ids), (width + 31) // 32), -1, dtype=np.int32)
        live = [
            (i, g)
            for i, rid in enumerate(request_ids)
            if (g := self._requests[rid]).failure is None
        ]
        if not live:
            return rows
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                MASK_THREADS, thread_name_prefix="guide-mask"
            )
        filled = np.zeros((len(live), rows.shape[1]), dtype=np.int32)  # a late fill's own
        futures = {
            self._pool.submit(_fill, g.matcher, filled, j): (i, g, j)
            for j, (i, g) in enumerate(live)
        }
        bound_s = max(g.limits.max_mask_ms for _, g in live) / 1e3
        done, late = concurrent.futures.wait(futures, timeout=bound_s)
        for future in late:
            _, g, _ = futures[future]
            self._fail(g, f"max_mask_ms ({g.limits.max_mask_ms:g} ms): a token mask took longer")
        for future in done:
            i, g, j = futures[future]
            took_ms = future.result()
            if took_ms > g.limits.max_mask_ms:
                bound = g.limits.max_mask_ms
                self._fail(g, f"max_mask_ms ({bound:g} ms): a token mask took {took_ms:.0f} ms")
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
        """A request past a bound: its template goes too (its lexer's states are shared)."""
        g.failure, g.matcher = f"structured outputs went past {reason}", None
        self._templates.pop(g.template_key, None)

    def _trim(self) -> None:
        """Templates no request uses: the most recent TEMPLATES_KEPT stay."""
        in_use = {g.template_key for g in self._requests.values()}
        idle = [k for k in self._templates if k not in in_use]
        for key in idle[: max(0, len(idle) - TEMPLATES_KEPT)]:
            del self._templates[key]


def load_tokenizer(model_dir: str, vocab_size: int, end_ids: tuple[int, ...]) -> object:
    """llguidance's tokenizer of the model's tokenizer.json, masks `vocab_size` wide (the
    model's rows, padding included), ending with `end_ids`."""
    from llguidance import LLTokenizer

    started = time.monotonic()
    text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
    tokenizer = LLTokenizer(text, n_vocab=vocab_size, eos_token=list(end_ids))
    log.info("guided decoding's vocabulary read in %.1f s", time.monotonic() - started)
    return tokenizer


def _fill(matcher: object, rows: np.ndarray, row: int) -> float:
    """Fill `rows[row]` with the matcher's next mask; the milliseconds it took."""
    started = time.perf_counter()
    matcher.unsafe_compute_mask_ptr(rows[row].ctypes.data, rows[row].nbytes)
    return 1e3 * (time.perf_counter() - started)


def apply_masks(work: torch.Tensor, rows: torch.Tensor, masks: np.ndarray) -> None:
    """`work[rows]` at -inf wherever `masks` (GuideMatchers.masks' rows, in the order of
    `rows`) has no bit set. On CUDA the packed words go up (an eighth of the bytes) and are
    unpacked there; on the CPU numpy unpacks them (a tenth of torch's time there)."""
    vocab = work.shape[1]
    if work.device.type == "cuda":  # pinned: queued on the stream (engine/rank/transfer.py)
        packed = torch.from_numpy(masks).pin_memory().to(work.device, non_blocking=True)
        shifts = torch.arange(8, dtype=torch.uint8, device=work.device)
        bits = (packed.view(torch.uint8).unsqueeze(-1) >> shifts) & 1
        allowed = bits.bool().view(masks.shape[0], -1)[:, :vocab]
    else:
        bits = np.unpackbits(masks.view(np.uint8), axis=1, count=vocab, bitorder="little")
        allowed = torch.from_numpy(bits.view(np.bool_))
    work[rows] = work[rows].masked_fill(~allowed, float("-inf"))


__all__ = ["GuideMatchers", "TEMPLATES_KEPT", "apply_masks", "load_tokenizer"]
