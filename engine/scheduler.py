"""The scheduler tick: one asyncio task owns every request's state.

Each tick (DESIGN.md section 5):
  drain   take every submission and cancellation that arrived, in arrival order;
  prune   cancel requests whose owner left (closed sink); drop what ranks hold (must_exist);
  publish the load snapshot (the one place load leaves the tick: `load_listeners`);
  maintain new weights, a cache flush, a pause (maintenance.py), once no step is in flight;
  admit   first come first served while a slot and the KV blocks a request needs now allow
          (its prompt's, a watermark left over); refuse what never fits;
  make room   when the running requests' next positions need more KV blocks than are free:
          evict saved prefixes, then preempt the youngest running requests (vLLM's recompute);
  plan    one unified step (planner.py), its requests' new blocks (`StepItem.grow`) in it;
then dispatch through the replica controller, await it, drain again (a cancellation that
arrived during the step wins over its result), commit the results.

Pipelining (LESSONS: plan step N+1 while the device runs step N): once the gate releases a
step, the next one is planned and sent behind it if that needs none of the step's results:
nothing new arrived or waits to be admitted, and the step's running requests each decode
once more, except those whose max_tokens step N reaches. Its items carry no token ids (the
ranks use their own last samples) and it carries the drops of requests that ended meanwhile
and of those that step N ends by max_tokens (their events wait in `Step.drops` until it has
run). The tick then commits step N with step N+1 already in flight (`_inflight`), and the
next tick starts by awaiting N+1's release. A request that ends at step N otherwise (a stop
token, a stop string, a cancellation) was in N+1 too: that sample is discarded and the
request is dropped after N+1.

Preemption (vLLM's recompute policy; `_make_room`): a request's blocks grow as it decodes, so
the running ones can run out. Before a step is planned (none in flight), while their next
positions need more blocks than are free, saved prefixes that free some are evicted, then the
youngest running request (the highest priority value first under the priority policy, then the
latest arrival) gives back its slot and blocks (`DropRequests`, with its state saved as a prefix
where its blocks are not needed and prefix caching is on) and goes back to the front of the
waiting queue; its next admission prefills its prompt and its output so far (`Request.preempt`)
and its stream goes on where it stopped. Age wins: the oldest running request is never a victim
while another runs, and one alone always fits (its lifetime fits the cache, or it was refused).

Monitors hook in through `load_listeners` and `lifecycle_listeners` (engine/monitor.py):
every request transition and the engine's failure pass through `_notify`, once each.

Completion commit boundary: a request's last token and its FinishedEvent are delivered only
after the all-rank drop of its state succeeded. A request that went past one of its own
bounds (rank 0 reports it in `SampleColumns.failed`; a stop regex's matcher here) ends the
same way with an ErrorEvent, alone: that is no replica error. Fail closed: a poisoned replica
(or any error in the tick) ends every unresolved choice with exactly one ErrorEvent, publishes
an idle terminal snapshot, and tears the replica down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import msgspec

from deltaserve.engine.capacity import CapacityLedger
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.encoder_cache import EncoderCacheIndex
from deltaserve.engine.events import (
    EngineState,
    ErrorEvent,
    Event,
    FinishedEvent,
    Lifecycle,
    LoadSnapshot,
    TokenEvent,
    Transition,
)
from deltaserve.engine.guided.stop_regex import StopRegexError
from deltaserve.engine.maintenance import Maintenance
from deltaserve.engine.media_prompt import chunk_media
from deltaserve.engine.metrics import EngineMetrics
from deltaserve.engine.planner import (
    KvRoom,
    PlanInput,
    PlannedChunk,
    StepBudget,
    StepPlan,
    plan_step,
)
from deltaserve.engine.prefix_cache import PrefixCache
from deltaserve.engine.request import Request
from deltaserve.engine.speculation import Speculation
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.engine.stop_check import check_stop, matched_stop
from deltaserve.engine.tick_records import Cancellation, Entry, Step, Submission
from deltaserve.engine.waiting_queue import WaitingQueue
from deltaserve.ipc.controller import ReplicaPoisoned
from deltaserve.ipc.messages import NewRequest, Sample, SampleColumns, SaveOnDrop, StepItem
from deltaserve.ipc.step_trace import StepTrace

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        controller: Any,  # ipc.controller.ReplicaController
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        budget: StepBudget,
        max_model_len: int,
        force_mixed: bool = False,
        pipeline: bool = True,
        prefix_states: int = 0,
        by_priority: bool = False,  # admission by request priority, then arrival (else arrival)
        speculative: SpeculativeConfig | None = None,  # MTP drafts (engine/speculation.py)
        kv_watermark: float = 0.0,  # share of the KV blocks admission leaves free while others run
        reserve_lifetime: bool = False,  # admit with prompt + max_tokens blocks: never preempts
    ) -> None:
        self._controller = controller
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._budget = budget
        self._force_mixed = force_mixed
        self._pipeline = pipeline
        self.max_model_len = max_model_len
        self.ledger = CapacityLedger(
            controller.num_slots, controller.num_blocks, controller.block_size
        )
        self.spec = None if speculative is None else Speculation(speculative)
        # with an MTP head a saved prefix's last position is its sharers' own (mtp.py)
        self.prefix = PrefixCache(
            prefix_states, self.ledger, private_positions=int(bool(self.spec))
        )
        self._reserve_lifetime = reserve_lifetime
        self._watermark_blocks = int(kv_watermark * self.ledger.num_blocks)  # vLLM's rounding
        self.encoder_index = EncoderCacheIndex()  # the images each rank keeps encoded, alike
        self.maintenance = Maintenance()  # new weights, a cache flush, pauses: between steps
        self.metrics = EngineMetrics()
        self.dead_reason: str | None = None
        self.load_listeners: list[Callable[[LoadSnapshot], None]] = []
        self.plan_listeners: list[Callable[[StepPlan], None]] = []  # tests read plans here
        self.lifecycle_listeners: list[Callable[[Lifecycle], None]] = []
        self._inbox: deque[Submission | Cancellation] = deque()
        self._entries: dict[int, Entry] = {}  # every unresolved request
        self._waiting = WaitingQueue(by_priority)
        self._running: dict[int, Entry] = {}  # admitted, in admission order
        self._pending_drop: dict[int, list[Event]] = {}  # on ranks, ended; events held back
        # the last step's samples of running requests (with their text, or None: not yet
        # detokenized), delivered once the next step is released (see _flush_outbox)
        self._outbox: list[tuple[Entry, Sample, str | None]] = []
        self._wake_event = asyncio.Event()
        self._idle_event = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._poison_reason: str | None = None
        self._stopping = False
        self._abort_all = False
        self._stopped = False  # stopped cleanly: the tick has exited
        self._inflight: Step | None = None  # sent, not yet committed (pipelined: not yet awaited)
        self._last_plan: StepPlan | None = None  # the step of the previous tick, if any
        self._last_step_s = 0.0
        self._results_at: float | None = None  # when the last step's results came back
        self._load = self._snapshot()
        self._trace = StepTrace("scheduler")

    # ---- called from outside the tick (event-loop thread) -----------------------------

    @property
    def num_queued(self) -> int:
        """Choices submitted and not yet admitted (the bounded waiting queue). One whose owner
        gave it up (`cancel`, `withdraw`) leaves it at once, not at the next tick."""
        return self._waiting.num_choices

    @property
    def queued_tokens(self) -> int:
        """The prompt tokens of those choices."""
        return self._waiting.num_tokens

    def load(self) -> LoadSnapshot:
        return self._load

    def submit(self, submission: Submission) -> None:
        self._waiting.count(submission.requests)
        self._inbox.append(submission)
        self.wake()

    def cancel(self, request_ids: tuple[int, ...]) -> None:
        self._waiting.forget(request_ids)
        self._inbox.append(Cancellation(request_ids))
        self.wake()

    def withdraw(self, request_ids: tuple[int, ...]) -> None:
        """Their owner left (a closed stream; may run in a finalizer): their places in the
        queue are free now, and the tick cancels them at its next prune."""
        self._waiting.forget(request_ids)
        self.wake_threadsafe()

    def wake(self) -> None:
        self._wake_event.set()

    def notify_refused(self, client_id: str, reason: str, message: str) -> None:
        """AsyncEngine.generate refused a submission (`reason` "queue_full" or "invalid")."""
        self._notify("rejected", client_id=client_id, reason=reason, message=message)

    def wake_threadsafe(self) -> None:
        """For finalizers: may run at any point, even after the loop closed."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake_event.set)

    def on_poison(self, reason: str) -> None:
        """The controller's callback: a rank died or the replica was poisoned, maybe idle."""
        if self._poison_reason is None:
            self._poison_reason = reason
        self.wake()

    async def stop(self, drain_timeout_s: float) -> None:
        """Let running requests finish for up to `drain_timeout_s`, then abort the rest;
        returns once every request has its terminal event (the tick then exits)."""
        self._stopping = True
        self.wake()
        if drain_timeout_s > 0 and (self._entries or self._inbox):
            self._idle_event.clear()
            try:
                await asyncio.wait_for(self._idle_event.wait(), drain_timeout_s)
            except TimeoutError:
                pass
        self._abort_all = True
        self.wake()

    # ---- the tick -----------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                if self._poison_reason is not None:
                    await self._fail_closed(f"replica poisoned: {self._poison_reason}")
                    return
                self._drain()
                await self._prune()
                self._publish_load()
                if not self._entries:
                    self._idle_event.set()
                    if self._stopping:
                        self._stopped = True
                        self.maintenance.fail("the engine stopped")
                        self._publish_load()  # the last one: idle, state dead
                        return
                if (
                    self.maintenance.ready(bool(self._running))
                    and self._inflight is None
                    and not self._pending_drop
                ):
                    await self.maintenance.run(
                        self._controller, self.prefix
                    )  # no step in flight: `ready` says when
                    continue  # the load it changed is published first
                self._admit()
                if self._inflight is None:
                    if not self.maintenance.frozen:
                        await self._make_room()
                    plan = plan_step(
                        self._plan_inputs(),
                        self._budget,
                        self._force_mixed,
                        KvRoom(self.ledger.free_blocks, self.ledger.block_size),
                    )
                    if not plan.chunks:
                        self._flush_outbox()
                        self._results_at = None  # idle from here: not the scheduler's overhead
                        await self._wait_for_work()
                        continue
                    self._inflight = await self._send(plan)
                await self._advance()
        except ReplicaPoisoned as exc:
            await self._fail_closed(f"replica poisoned: {exc.reason}")
        except asyncio.CancelledError:
            await self._fail_closed("engine task cancelled")
            raise
        except Exception as exc:
            logger.exception("scheduler tick failed")
            await self._fail_closed(f"internal error in the scheduler: {exc!r}")
        finally:
            self._trace.write()

    def _plan_inputs(self) -> list[PlanInput]:
        """What the planner needs of every running request (none while frozen), with the
        drafts each decoding one verifies (speculative decoding)."""
        running = [] if self.maintenance.frozen else [e.request for e in self._running.values()]
        spec = self.spec
        if spec is not None:
            spec.choose(sum(not r.is_prefilling for r in running))
        return [
            PlanInput(
                r.request_id,
                r.prefill_len,
                r.num_computed,
                self.prefix.split_at(r.request_id),
                num_blocks=len(self.ledger.blocks(r.request_id)),
                media=r.media_costs,
                num_drafts=spec.num_drafts(r) if spec is not None and not r.is_prefilling else 0,
            )
            for r in running
        ]

    async def _wait_for_work(self) -> None:
        self._wake_event.clear()
        if (
            self._inbox
            or self._poison_reason is not None
            or (self._abort_all and self._entries)
            or any(e.sink.closed for e in self._entries.values())
        ):
            return
        await self._wake_event.wait()

    def _drain(self) -> None:
        while self._inbox:
            message = self._inbox.popleft()
            if isinstance(message, Submission):
                self._waiting.extend(self._add_entries(message))
            else:
                for request_id in message.request_ids:
                    entry = self._entries.get(request_id)
                    if entry is not None:
                        self._cancel(entry)
        if self._abort_all:
            for entry in list(self._entries.values()):
                self._cancel(entry)

    def _add_entries(self, submission: Submission) -> list[Entry]:
        entries = []
        for request in submission.requests:
            detok = IncrementalDetokenizer.for_params(self._tokenizer, request.params)
            entry = Entry(request, submission.sink, detok)
            self._entries[request.request_id] = entry
            self._notify("queued", entry)
            entries.append(entry)
        return entries

    def _cancel_closed_owners(self) -> None:
        for entry in list(self._entries.values()):
            if entry.sink.closed:
                self._cancel(entry)

    def _cancel(self, entry: Entry) -> None:
        """Idempotent. What ranks hold is dropped before the abort is delivered."""
        request = entry.request
        rid = request.request_id
        if request.is_finished:
            return  # already ended, maybe waiting for its drop
        if rid in self._running:
            del self._running[rid]
        else:
            self._waiting.remove(entry)
            self.prefix.forget(rid)  # a preempted one's awaited prefix
        request.finish("abort")
        event = FinishedEvent(
            request.index,
            "abort",
            request.prompt_len,
            request.num_output_tokens,
            "",
            request.num_cached,
        )
        if request.on_ranks:
            self._hold_until_dropped(rid, [event])
            return
        if rid in self.ledger:
            self._release(rid)
        del self._entries[rid]
        self._deliver(entry, event)

    async def _prune(self) -> None:
        self._cancel_closed_owners()
        if self._inflight is None:  # else they go with the next pipelined step, or after it
            await self._flush_drops()

    async def _flush_drops(self) -> None:
        if not self._pending_drop:
            return
        drops, self._pending_drop = self._pending_drop, {}
        saves = self.prefix.saves_at_end(self._entries[rid].request for rid in drops)
        await self._controller.drop(list(drops), "must_exist", self.prefix.take_evicted(), saves)
        self._dropped(drops)

    def _dropped(self, drops: dict[int, list[Event]]) -> None:
        """Every rank has dropped these requests: release their reservations and deliver
        the events held back for them (the completion commit boundary)."""
        for rid, events in drops.items():
            entry = self._entries.pop(rid)
            self._release(rid)
            for event in events:
                self._deliver(entry, event)

    def _release(self, request_id: int) -> None:
        """What the ranks held for an admitted request is free: its slot, blocks, cache plan."""
        self.ledger.release(request_id)
        self.prefix.forget(request_id)
        if self.spec is not None:
            self.spec.forget(request_id)

    def _state(self) -> EngineState:
        return (
            "dead"
            if self.dead_reason is not None or self._stopped
            else "draining"
            if self._stopping
            else "serving"
        )

    def _snapshot(self) -> LoadSnapshot:
        """Counts as they stand; once failed closed, idle (every reservation is void)."""
        plan, failed = self._last_plan, self.dead_reason is not None
        num_decodes = plan.num_decodes if plan else 0
        decode_tokens = sum(c.num_tokens for c in plan.chunks if c.is_decode) if plan else 0
        m = self.metrics
        dropping = len(self._inflight.drops) if self._inflight is not None else 0
        return LoadSnapshot(
            state=self._state(),
            running=len(self._running) + len(self._pending_drop) + dropping,
            waiting=self.num_queued,
            free_slots=self.ledger.num_slots if failed else self.ledger.free_slots,
            free_blocks=self.ledger.num_blocks if failed else self.ledger.free_blocks,
            num_slots=self.ledger.num_slots,
            num_blocks=self.ledger.num_blocks,
            steps_total=self.metrics.steps_total,
            step_prefill_tokens=plan.num_tokens - decode_tokens if plan else 0,
            step_decode_tokens=num_decodes,
            step_draft_tokens=decode_tokens - num_decodes,
            step_duration_s=self._last_step_s if plan else 0.0,
            prompt_tokens_total=m.prompt_tokens_total,
            generation_tokens_total=m.generation_tokens_total,
            spec_decode_num_drafts_total=m.spec_decode_num_drafts_total,
            spec_decode_num_draft_tokens_total=m.spec_decode_num_draft_tokens_total,
            spec_decode_num_accepted_tokens_total=m.spec_decode_num_accepted_tokens_total,
            spec_decode_accepted_per_position=[
                m.spec_decode_num_accepted_tokens_per_pos.get(position, 0)
                for position in range(self.spec.max_drafts if self.spec else 0)
            ],
        )

    def _publish_load(self) -> None:
        """The single place load leaves the tick: `load()` and every load listener (the
        monitor publisher hooks in here). The previous tick's step is reported once."""
        self._load = self._snapshot()
        self._last_plan = None
        for listener in self.load_listeners:
            try:
                listener(self._load)
            except Exception:
                logger.exception("load listener failed")

    def _admit(self) -> None:
        """In the waiting queue's order; stop at the first that does not fit now (none while
        maintenance holds). Each would fit an empty replica: AsyncEngine refused any other. A
        request takes a slot and the blocks of its prefill (of its lifetime with
        `reserve_lifetime`), leaving free the blocks the running requests' next positions need
        and, while any runs, the watermark."""
        keep_free = 0
        if not self._reserve_lifetime:
            keep_free = self._growth() + (self._watermark_blocks if self._running else 0)
        while self._waiting and self.maintenance.admits:
            entry = self._waiting.head()
            request = entry.request
            first = self._running.get(entry.sink.request_ids[0]) if request.index else None
            if first is not None and self.prefix.saves_for_siblings(first.request):
                return  # choice 0 of its call prefills toward the state it saves for the others
            plan = self.prefix.plan(request)
            num_tokens = self._admit_tokens(request)
            if not self.prefix.make_room(plan, num_tokens, keep_free):
                return
            self.prefix.admit(request, plan, num_tokens)  # takes its slot and blocks
            request.admit(plan.start.num_tokens if plan.start else 0)
            if self.prefix.enabled and not request.num_preemptions:
                self.metrics.prefix_cache_queries_total += request.prompt_len
                self.metrics.prefix_cache_hits_total += request.num_cached
            self._waiting.popleft()
            self._running[request.request_id] = entry
            self._notify("admitted", entry)

    def _admit_tokens(self, request: Request) -> int:
        """The positions whose blocks a request takes when admitted."""
        return request.lifetime_tokens if self._reserve_lifetime else request.prefill_len

    def _growth(self, leaving: Collection[int] = ()) -> int:
        """The blocks the running requests (but `leaving`) must add for their next decode."""
        return sum(
            self.ledger.growth(rid, e.request.num_sent + 1)
            for rid, e in self._running.items()
            if e.request.num_sent >= e.request.prefill_len and rid not in leaving
        )

    async def _make_room(self) -> None:
        """With no step in flight: while the running requests' next decodes need more blocks
        than are free, evict a saved prefix that frees some, else pick the youngest running
        request to preempt; then preempt those picked (see the module docstring)."""
        victims: dict[int, Entry] = {}
        released: list[int] = []  # the victims' blocks, once per holder
        while self.ledger.free_blocks + self.ledger.freed_by(released) < self._growth(victims):
            if self.prefix.evict_for_blocks():
                continue
            rid, entry = max(
                ((rid, e) for rid, e in self._running.items() if rid not in victims),
                key=lambda item: (item[1].request.priority, item[0]),
            )
            victims[rid] = entry
            released += self.ledger.blocks(rid)
        if victims:
            await self._preempt(list(victims.values()), released)

    async def _preempt(self, victims: list[Entry], released: list[int]) -> None:
        """Give back the victims' slots and blocks (youngest first in `victims`; `released`
        their blocks) and queue them again at the front. With prefix caching each keeps its
        state where it stands, oldest first, where the blocks it holds are not needed."""
        saves: list[SaveOnDrop] = []
        if self.prefix.enabled:
            need, kept = self._growth({e.request.request_id for e in victims}), []
            for entry in reversed(victims):
                rid = entry.request.request_id
                hold = self.ledger.blocks(rid)[: self.ledger.blocks_for(entry.request.num_sent)]
                free = self.ledger.free_blocks + self.ledger.freed_by(released, kept + hold)
                if free < need:
                    continue
                save = self.prefix.save_where_it_stands(entry.request, [s.prefix for s in saves])
                if save is not None:
                    saves.append(save)
                    kept += hold
        on_ranks = [e.request.request_id for e in victims if e.request.on_ranks]
        for entry in victims:
            rid = entry.request.request_id
            del self._running[rid]
            self._release(rid)
            entry.request.preempt()
        if on_ranks:
            await self._controller.drop(on_ranks, "must_exist", self.prefix.take_evicted(), saves)
        for entry in victims:
            self.prefix.await_resume(entry.request)
        self._waiting.requeue(victims)
        self.metrics.num_preemptions_total += len(victims)
        for entry in victims:
            self._notify("preempted", entry)

    async def _send(self, plan: StepPlan) -> Step:
        """Dispatch a planned step once the ranks are free."""
        items = []
        prefix = self.prefix
        # saves first: they may evict, and the prefixes its requests start from are pinned until
        # `start_of`
        saves = prefix.saves(
            [
                (self._running[c.request_id].request, c.start + c.num_tokens)
                for c in plan.chunks
                if not c.is_decode
            ]
        )
        if self.spec is not None:
            self.spec.begin_step()
        for chunk in plan.chunks:
            request = self._running[chunk.request_id].request
            num_drafts = propose = 0
            if self.spec is None:
                tokens = request.input_tokens(chunk.start, chunk.num_tokens)
            else:  # a verify item carries its drafts
                tokens, num_drafts, propose = self.spec.item_fields(request, chunk)
            new = None
            if not request.on_ranks:
                spec = request.params.to_spec(request.seed, self._eos_token_ids)
                new = NewRequest(
                    self._admit_tokens(request),
                    spec,
                    prefix.start_of(chunk.request_id),
                    request.multimodal.vision_spans() if request.multimodal else [],
                    request.output_ids,  # sampled before a preemption: the rank counts them
                )
            if chunk.grow:
                self.ledger.grow(chunk.request_id, chunk.grow)
            media = chunk_media(request.multimodal, chunk, new is not None, self.encoder_index)
            request.mark_sent(chunk.start + chunk.num_tokens)
            items.append(
                StepItem(
                    chunk.request_id,
                    chunk.start,
                    tokens,
                    chunk.sample,
                    new,
                    saves.get(chunk.request_id, -1),
                    *request.prompt_logprobs_fields(chunk.start, chunk.num_tokens, chunk.is_decode),
                    media,
                    chunk.grow,
                    num_drafts=num_drafts,
                    propose=propose,
                )
            )
        if self.spec is not None:
            items = self._grow_for_drafts(items)
        self._notify_plan(plan)
        sent_at = time.perf_counter()
        if self._results_at is not None:  # the ranks sat idle since the last step's results
            self.metrics.scheduler_seconds_total += sent_at - self._results_at
        return Step(
            plan, await self._controller.send_step(items, (), prefix.take_evicted()), sent_at, {}
        )

    def _grow_for_drafts(self, items: list[StepItem]) -> list[StepItem]:
        """Items that ask for drafts: the MTP head writes its keys at the positions its drafts
        stand for, up to `propose` - 1 past the item's last (engine/rank/speculative.py), so
        the request's blocks grow to hold them, from those that no running request's next
        decode needs; `propose` shrinks where they are not free (one draft needs none)."""
        spare = max(0, self.ledger.free_blocks - self._growth())  # never negative: ends at 1
        grown = []
        for item in items:
            if item.propose > 1:
                end, propose = item.start + max(1, len(item.token_ids)), item.propose
                # at 1 none: the item's own positions are in its blocks already
                while (extra := self.ledger.growth(item.request_id, end + propose - 1)) > spare:
                    propose -= 1
                if extra:
                    self.ledger.grow(item.request_id, extra)
                    spare -= extra
                if item.new is not None and extra:  # a first chunk takes its blocks with `new`
                    new = msgspec.structs.replace(item.new, reserve_tokens=end + propose - 1)
                    item = msgspec.structs.replace(item, new=new, propose=propose)
                else:
                    item = msgspec.structs.replace(item, grow=item.grow + extra, propose=propose)
            grown.append(item)
        return grown

    def _follow(self, step: Step) -> Step | None:
        """Plan and send the next step behind `step`, which the ranks are running, if it
        needs none of its results (see the module docstring); else None."""
        if (
            not self._pipeline
            or self._stopping
            or self._inbox
            or self.maintenance.frozen
            or not self._controller.can_follow
            or (self.spec is not None and self.spec.active)  # its drafts or positions come back
        ):
            return None
        if self._waiting and (
            self._pending_drop
            or self.ledger.can_admit(self._admit_tokens(self._waiting.head().request))
        ):
            return None  # admission comes first
        chunks = []
        last = []  # requests whose last token `step` samples (max_tokens): dropped right after it
        num_running = 0
        for chunk in step.plan.chunks:
            entry = self._running.get(chunk.request_id)
            if entry is None:
                continue  # ended while planned: dropped after `step`
            if not chunk.sample:
                return None  # a prompt chunked across steps: its next chunk needs planning
            num_running += 1
            request = entry.request
            if request.num_output_tokens + 2 <= request.params.max_tokens:
                position = chunk.start + chunk.num_tokens
                grow = self.ledger.growth(chunk.request_id, position + 1)
                chunks.append(PlannedChunk(chunk.request_id, position, 1, True, True, grow))
            else:
                last.append(chunk.request_id)
        if (
            num_running != len(self._running)
            or not chunks
            or sum(c.grow for c in chunks) > self.ledger.free_blocks
        ):
            return None  # someone admitted is not in `step`, nobody decodes on, or no room
        for chunk in chunks:
            if chunk.grow:
                self.ledger.grow(chunk.request_id, chunk.grow)
        items = [
            StepItem(chunk.request_id, chunk.start, [], True, grow=chunk.grow) for chunk in chunks
        ]
        # their events come when `step` commits (_hold_until_dropped)
        drops = {**self._pending_drop, **{rid: [] for rid in last}}
        saves = self.prefix.saves_at_end(self._entries[rid].request for rid in drops)
        flight = self._controller.follow_step(
            items, list(drops), self.prefix.take_evicted(), saves
        )  # can_follow: sent
        for chunk in chunks:
            self._running[chunk.request_id].request.mark_sent(chunk.start + 1)
        plan = StepPlan(tuple(chunks))
        self._notify_plan(plan)
        self._pending_drop = {}
        self.metrics.pipelined_steps_total += 1
        return Step(plan, flight, time.perf_counter(), drops)

    async def _advance(self) -> None:
        """Await the step in flight: once the gate releases it, hand out the last step's
        tokens and send the next step behind it if it can go; then commit its results."""
        step = self._inflight
        if await step.flight.gate:
            self._flush_outbox()
            follower = self._follow(step)
        else:
            follower = None
        samples = await self._controller.step_result(step.flight)
        self._trace.mark(step.flight.seq, "results")
        self._inflight = follower
        self._commit(step, samples)

    def _commit(self, step: Step, samples: SampleColumns) -> None:
        results_at = time.perf_counter()
        # a pipelined step could start only once the one ahead of it ended
        self._last_step_s = results_at - max(step.sent_at, self._results_at or 0.0)
        self._results_at = results_at
        self.metrics.steps_total += 1
        self.metrics.step_seconds_total += self._last_step_s
        self._last_plan = step.plan
        self._dropped(step.drops)
        # Cancellations that arrived while the step ran win over its results.
        self._drain()
        self._cancel_closed_owners()
        now = time.monotonic()
        rows = itertools.count()  # samples come in step order: one row per chunk that samples
        for chunk in step.plan.chunks:
            row = next(rows) if chunk.sample else -1
            entry = self._entries.get(chunk.request_id)
            if entry is None or entry.request.is_finished:
                continue
            request = entry.request
            verified = chunk.num_tokens - 1 if chunk.is_decode else 0  # its drafts
            accepted: list[Sample] = []  # the drafts it kept, emitted before its sample
            if (outcome := samples.speculative.get(chunk.request_id)) is not None:
                accepted = self.spec.outcome(request, outcome, self.metrics)
            if verified:  # the ranks hold the positions up to the last draft taken
                request.mark_sent(chunk.start + 1 + len(accepted))
            request.advance(chunk.num_tokens - verified)
            if (
                part := samples.prompt_logprobs.get(chunk.request_id)
            ) is not None:  # the chunks that asked
                request.prompt_logprob_parts.append(part)
            if chunk.sample:
                if not chunk.is_decode and not request.output_ids:  # once, resumed or not
                    self.metrics.prompt_tokens_total += request.prompt_len
                if (failure := samples.failed.get(chunk.request_id)) is not None:
                    self._end_failed(entry, failure)
                    continue
                for sample in accepted:
                    self._commit_sample(entry, sample, now)
                    if request.is_finished:  # a stop or max_tokens inside the accepted run
                        break
                    request.advance(1)
                else:  # the step's own sample, unless the run ended before it
                    self._commit_sample(entry, samples.sample(row), now)

    def _commit_sample(self, entry: Entry, sample: Sample, now: float) -> None:
        request = entry.request
        previous = request.last_token_time_s
        if (
            previous is None and request.params.prompt_logprobs is not None
        ):  # before its first token
            entry.sink.put(request.prompt_logprobs_event())
        request.append_token(sample.token_id, now)
        self.metrics.generation_tokens_total += 1
        if previous is None:
            self.metrics.time_to_first_token_s.observe(now - request.arrival_time_s)
            self._notify("first_token", entry)
        else:
            self.metrics.inter_token_latency_s.observe(now - previous)
        token = sample.token_id
        try:
            reason, text = check_stop(request, token, self._eos_token_ids, entry.detokenizer)
        except StopRegexError as exc:
            self._end_failed(entry, str(exc))
            return
        if reason is None:
            self._outbox.append((entry, sample, text))  # text None: made in _flush_outbox
            return
        event = TokenEvent(request.index, token, text, sample.logprob, list(sample.top_logprobs))
        tail = entry.detokenizer.flush()
        request.finish(reason)
        del self._running[request.request_id]
        finished = FinishedEvent(
            request.index,
            reason,
            request.prompt_len,
            request.num_output_tokens,
            tail,
            request.num_cached,
            matched_stop(request, token, entry.detokenizer),
        )
        self._hold_until_dropped(request.request_id, [event, finished])

    def _end_failed(self, entry: Entry, message: str) -> None:
        """A running request went past one of its own bounds: it alone ends, with an
        ErrorEvent once its state is dropped (as a finished request's)."""
        request = entry.request
        request.finish("error")
        del self._running[request.request_id]
        event = ErrorEvent(request.index, message, bound=True)
        self._hold_until_dropped(request.request_id, [event])

    def _hold_until_dropped(self, request_id: int, events: list[Event]) -> None:
        """Hold an ended request's events until every rank has dropped its state: by the step
        in flight, if it already carries the drop (the step before sampled the request's
        last token, by max_tokens), else by the next drop."""
        inflight = self._inflight
        if inflight is not None and request_id in inflight.drops:
            inflight.drops[request_id].extend(events)
        else:
            self._pending_drop[request_id] = events

    def _flush_outbox(self) -> None:
        """Deliver the held token events. They wait from their step's commit until the next
        step is released, because a consumer woken earlier (an SSE write per token) runs on
        this loop before the ranks' gate receipts are read: 64 of them held every step's
        release back by milliseconds. Now they, and the detokenization of requests without
        stop strings, run while the ranks compute."""
        outbox, self._outbox = self._outbox, []
        for entry, sample, text in outbox:
            if (
                text is None
            ):  # a request without stop strings: its text is made here, off the step's path
                text = entry.detokenizer.add(sample.token_id)
            event = TokenEvent(
                entry.request.index,
                sample.token_id,
                text,
                sample.logprob,
                list(sample.top_logprobs),
            )
            entry.sink.put(event)

    def _notify_plan(self, plan: StepPlan) -> None:
        for listener in self.plan_listeners:
            listener(plan)

    def _deliver(self, entry: Entry, event: Event) -> None:
        if self._outbox:  # a request's tokens, in order, before its last (held) one and its end
            self._flush_outbox()
        if (
            isinstance(event, FinishedEvent) and event.reason == "abort"
        ):  # with its held-back text (vLLM too)
            event = msgspec.structs.replace(event, text=entry.detokenizer.flush())
        entry.sink.put(event)
        if isinstance(event, FinishedEvent | ErrorEvent):
            reason = event.reason if isinstance(event, FinishedEvent) else "error"
            self.metrics.request_success_total[reason] += 1
            self.metrics.e2e_request_latency_s.observe(
                time.monotonic() - entry.request.arrival_time_s
            )
            if isinstance(event, FinishedEvent):
                self._notify("finished", entry, reason=event.reason)
            elif event.bound:  # past its own bound while generating
                self._notify("dropped", entry, message=event.message)
            elif self.dead_reason is None:  # refused at admission: it can never fit
                self._notify("rejected", entry, reason="invalid", message=event.message)
            else:
                self._notify("dropped", entry, message=self.dead_reason)

    def _notify(
        self,
        transition: Transition,
        entry: Entry | None = None,
        *,
        client_id: str = "",
        reason: str = "",
        message: str = "",
    ) -> None:
        """The one place lifecycle transitions leave the tick; nearly free without listeners."""
        if not self.lifecycle_listeners:
            return
        request = None
        if entry is not None:
            request, client_id = entry.request, entry.sink.client_id
        event = Lifecycle(transition, time.monotonic(), request, client_id, reason, message)
        for listener in self.lifecycle_listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("lifecycle listener failed")

    async def _fail_closed(self, reason: str) -> None:
        """Exactly one ErrorEvent to every unresolved choice, an idle terminal snapshot,
        replica teardown. New submissions already fail: `dead_reason` is set first."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("engine failed closed: %s", reason)
        self._notify("poisoned", message=reason)
        self.maintenance.fail(reason)
        self._drain_submissions_only()
        message = f"engine failed: {reason}"
        for entry in self._entries.values():
            if not entry.request.is_finished:
                entry.request.finish("error")
            self._deliver(entry, ErrorEvent(entry.request.index, message))
        self._entries.clear()
        self._waiting.clear()
        self._running.clear()
        self._pending_drop.clear()
        self._inflight = None
        self._idle_event.set()
        self._publish_load()
        try:
            await self._controller.shutdown()
        except Exception:
            logger.exception("replica teardown after failure")
        self._notify("terminal", message=reason)

    def _drain_submissions_only(self) -> None:
        """Submissions still in the inbox have owners waiting too: make them entries."""
        while self._inbox:
            message = self._inbox.popleft()
            if isinstance(message, Submission):
                self._add_entries(message)
