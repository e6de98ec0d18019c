"""Prefix caching for a hybrid model: a prompt that begins with a saved prompt skips its prefill.

A full-attention layer keeps a key and value per position, so vLLM and SGLang can reuse any
run of cached KV blocks. A DeltaNet layer keeps one state for everything it has read: a
prefix can be reused only where that state was saved, at one position (SGLang's hybrid radix
cache and vLLM's hybrid prefix caching meet the same limit). So a prompt's state is saved
(`StepItem.save`, into one of the ranks' prefix state slots):
  - where its prefill ends: the whole prompt (a repeat, or a follow-up to it);
  - where its generation ends (`saves_at_end`, as the ranks drop it: `SaveOnDrop`): its prompt
    and output, which the next turn of the conversation begins with, up to the last position
    the ranks ran (the last token sampled is fed only where a pipelined step ran past it);
  - where it stops matching every recent prompt, at a block boundary, when that is past what
    it could reuse: a system prompt shared by many requests is saved by the second one that
    shows it (one of them, if several are admitted together). Its prefill is split there
    (`split_at`), so the state exists.
  - one position short of its end, for a call of n > 1 choices: choice 0 prefills and saves
    there, the others wait to be admitted until it has, then start there (n prompts cost one
    prefill, as vLLM's parallel sampling shares its prefix blocks).
  - where a preempted request stopped (`save_where_it_stands`), when the scheduler does not
    need the blocks it holds (engine/scheduler.py): its recompute starts there. The prefix a
    preempted request would start from is evicted after every other while it waits.
A later prompt starts from the longest saved prefix that it begins with and that is shorter
than itself (one position at least must run, for the logits): it shares the prefix's full KV
blocks (the ledger counts their holders), the ranks copy the partly filled one, and its
first chunk starts where the prefix ends (`NewRequest.prefix`).

Not reused by requests with a repetition penalty (the ranks count the prompt's tokens for it,
and would miss the prefix's) or with prompt logprobs (every prompt position's logits are needed). On
CUDA a chunk that starts from a prefix replays a prompt graph as a first chunk does
(engine/rank/prompt_graphs.py, `prefix_keys`).

The same positions are saved once: a save of positions held already refreshes that prefix.

Eviction, when a save needs a state slot or an admission needs blocks: whole prompts before
the prefixes saved where prompts part (those are shared, as a radix tree's inner nodes, which
SGLang evicts after its leaves), least recently used first within each; a whole prompt's save
never evicts a shared prefix (it is skipped instead); never a prefix an admitted request waits
to start from (pinned until its first chunk is sent). The ranks forget
an evicted prefix when the next step or drop carries it (`evict`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltaserve.engine.capacity import CapacityLedger
from deltaserve.engine.request import Request
from deltaserve.ipc.messages import SaveOnDrop

if TYPE_CHECKING:
    from deltaserve.engine.kv_events import BlockEvents

SEEN_BLOCKS = 1 << 16  # block hashes of recent prompts kept to find shared prefixes


@dataclass(eq=False, slots=True)
class SavedPrefix:
    prefix_id: int  # the ranks' prefix state slot
    # the ids it was saved from (a prompt, maybe an output): the first num_tokens count
    prompt: tuple[int, ...]
    num_tokens: int
    blocks: list[int]  # the ledger's blocks of those positions, held for it
    key: int  # the chain hash of its full blocks
    shared: bool  # saved where prompts part (else where one ends): evicted last
    pins: int = 0  # admitted requests that start from it and are not yet sent
    # pinned through a flush: the old weights' state, found by no one, evicted first
    stale: bool = False

    def full_blocks(self, block_size: int, private_positions: int = 0) -> list[int]:
        """The blocks a request starting from it shares: full ones, but not those holding its
        last `private_positions` (each request writes its own there: PrefixCache's)."""
        return self.blocks[: (self.num_tokens - private_positions) // block_size]


@dataclass(slots=True)
class PromptPlan:
    """What the cache decided for an admitted request, kept until it ends."""

    hashes: list[int]  # chain hashes of its prompt's full blocks
    start: SavedPrefix | None  # the prefix it starts from
    split_at: int  # a position its prefill stops at to save its state there; 0: none
    pinned: bool = False  # it holds a pin on `start`: admitted, first chunk not yet sent
    splitting: bool = False  # its split is announced (`_splitting`) and not yet saved
    for_siblings: bool = False  # choice 0 of n: split one short of its prompt's end, for the others
    stale: bool = False  # admitted before a flush (new weights): its states are never saved


class PrefixCache:
    def __init__(
        self, num_prefixes: int, ledger: CapacityLedger, private_positions: int = 0
    ) -> None:
        """`num_prefixes` 0: off (nothing hashed, saved or reused; `admit` only reserves).
        `private_positions`: a prefix's last positions whose KV rows each request starting
        from it writes anew, in a copy of their block (with speculative decoding the MTP
        head's keys there depend on the request's next token: engine/rank/mtp.py)."""
        self.enabled = num_prefixes > 0
        self.ledger = ledger
        self.block_size = ledger.block_size
        self.private_positions = private_positions
        self._free_ids = list(range(num_prefixes - 1, -1, -1))
        # by prefix id, least recently used first
        self._saved: OrderedDict[int, SavedPrefix] = OrderedDict()
        self._by_hash: dict[
            int, list[SavedPrefix]
        ] = {}  # chain hash of its full blocks -> prefixes
        self._seen: OrderedDict[int, None] = OrderedDict()  # chain hashes of recent prompts' blocks
        self._plans: dict[int, PromptPlan] = {}  # admitted request id -> its plan
        self._evicted: list[int] = []  # prefix ids the ranks still hold: sent with the next step
        self._splitting: set[int] = set()  # chain hashes where an admitted request will save
        # preempted request id -> the prefix its recompute would start from: evicted last
        self._awaited: dict[int, int] = {}
        # KV-cache events (engine/kv_events.py): told of saves
        self.events: BlockEvents | None = None

    def __len__(self) -> int:
        return len(self._saved)

    def saved_prefixes(self) -> list[SavedPrefix]:
        """The saved prefixes a prompt can start from (not those a flush left pinned)."""
        return [p for p in self._saved.values() if not p.stale]

    # ---- admission ----------------------------------------------------------------------

    def plan(self, request: Request) -> PromptPlan:
        """Hash the request's prefill (its prompt; after a preemption, with its output) and
        find the prefix it could start from (not yet taken)."""
        prompt, bs = request.prefill_cache_ids, self.block_size
        if not self.enabled:
            return PromptPlan([], None, 0)
        hashes = self._hashes(prompt)
        plan = PromptPlan(hashes, None, 0)
        if request.params.repetition_penalty != 1.0 or request.params.prompt_logprobs is not None:
            return plan
        plan.start = self._longest(prompt, hashes)
        if (
            request.index == 0
            and request.params.n > 1
            and not request.output_ids  # its siblings have started: nothing to save for them
            and len(prompt) > bs
            and (plan.start is None or plan.start.num_tokens < len(prompt) - 1)
        ):
            plan.split_at, plan.for_siblings = len(prompt) - 1, True
            return plan
        seen = 0  # leading full blocks (before the last position) an earlier prompt had too
        while seen < (len(prompt) - 1) // bs and hashes[seen] in self._seen:
            seen += 1
        if (
            seen * bs > (plan.start.num_tokens if plan.start else 0)
            and hashes[seen - 1] not in self._splitting
        ):
            plan.split_at = seen * bs
        return plan

    def cached_tokens(self, prompt: tuple[int, ...]) -> int:
        """How many leading tokens of `prompt` a saved prefix holds now (a data-parallel
        engine routes by it, engine/data_parallel.py); 0 when off."""
        if not self.enabled:
            return 0
        found = self._longest(prompt, self._hashes(prompt))
        return 0 if found is None else found.num_tokens

    def _hashes(self, prompt: tuple[int, ...]) -> list[int]:
        """The chain hash of each full block of `prompt`: block i's hashes blocks 0..i."""
        bs, hashes, h = self.block_size, [], 0
        for end in range(bs, len(prompt) + 1, bs):
            h = hash((h, prompt[end - bs : end]))
            hashes.append(h)
        return hashes

    def _longest(self, prompt: tuple[int, ...], hashes: list[int]) -> SavedPrefix | None:
        """The longest saved prefix that `prompt` begins with and is longer than."""
        for full in range(len(hashes), 0, -1):
            found = [
                p
                for p in self._by_hash.get(hashes[full - 1], ())
                if not p.stale
                and p.num_tokens < len(prompt)
                and prompt[: p.num_tokens] == p.prompt[: p.num_tokens]
            ]
            if found:
                return max(found, key=lambda p: p.num_tokens)
        return None

    def make_room(self, plan: PromptPlan, num_tokens: int, keep_free: int = 0) -> bool:
        """Evict unpinned prefixes, least recently used first, until a request admitted with
        `plan` and the blocks of `num_tokens` positions fits, `keep_free` blocks left over."""
        if self.ledger.free_slots < 1:
            return False  # no eviction frees a request slot
        shared = (
            len(plan.start.full_blocks(self.block_size, self.private_positions))
            if plan.start
            else 0
        )
        for prefix in self._victims():
            if self.ledger.can_admit(num_tokens, shared, keep_free):
                return True
            if prefix is not plan.start:
                self._evict(prefix)
        return self.ledger.can_admit(num_tokens, shared, keep_free)

    def evict_for_blocks(self) -> bool:
        """Evict the first unpinned prefix, in eviction order, whose eviction frees a block
        (a running request's growth needs one); False if none would."""
        for prefix in self._victims():
            if self.ledger.freed_by(prefix.blocks):
                self._evict(prefix)
                return True
        return False

    def admit(self, request: Request, plan: PromptPlan, num_tokens: int) -> None:
        """The request is admitted with `plan`: take the blocks of its first `num_tokens`
        positions, and its starting prefix."""
        start = plan.start
        self.ledger.admit(
            request.request_id,
            num_tokens,
            start.full_blocks(self.block_size, self.private_positions) if start else [],
        )
        self._awaited.pop(request.request_id, None)
        if start is not None:
            start.pins += 1
            plan.pinned = True
            self._saved.move_to_end(start.prefix_id)
        if plan.split_at and not plan.for_siblings:
            self._splitting.add(plan.hashes[plan.split_at // self.block_size - 1])
            plan.splitting = True
        for h in plan.hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > SEEN_BLOCKS:
            self._seen.popitem(last=False)
        if self.enabled:
            self._plans[request.request_id] = plan

    # ---- dispatch -----------------------------------------------------------------------

    def start_of(self, request_id: int) -> int:
        """The prefix id a request's first chunk starts from (unpinned now: it is sent), or -1."""
        plan = self._plans.get(request_id)
        if plan is None or plan.start is None:
            return -1
        self._unpin(plan)
        return plan.start.prefix_id

    def split_at(self, request_id: int) -> int:
        plan = self._plans.get(request_id)
        return plan.split_at if plan is not None else 0

    def saves_for_siblings(self, request: Request) -> bool:
        """Whether the other choices of the request's call should wait for the state it
        saves one position short of its prompt's end (its prefill is not there yet)."""
        plan = self._plans.get(request.request_id)
        return plan is not None and plan.for_siblings and request.num_computed < plan.split_at

    def saves(self, chunks: list[tuple[Request, int]]) -> dict[int, int]:
        """For one step's prompt chunks, (request, where the chunk ends): the prefix id each
        request's state is saved in after the step, by request id, where the chunk ends at a
        save point (its split or its prompt's end). Call before `start_of` for the step, as
        the prefixes its requests start from stay pinned until then."""
        saved: dict[int, int] = {}
        for request, end in chunks:
            prefix_id = self.save(request, end, keep=saved.values())
            if prefix_id >= 0:
                saved[request.request_id] = prefix_id
        return saved

    def save(self, request: Request, end: int, keep: Collection[int] = ()) -> int:
        """The prefix id to save the request's state in after its chunk ending at `end`, or
        -1; eviction for the id passes over `keep` (saved in the same step)."""
        plan = self._plans.get(request.request_id)
        if (
            plan is None
            or plan.stale
            or end not in (plan.split_at, request.prefill_len)
            or end < self.block_size
        ):
            return -1
        if end == plan.split_at:
            self._end_split(plan)
        shared = end != request.prefill_len and not plan.for_siblings
        return self._record(
            request,
            request.prefill_cache_ids,
            end,
            plan.hashes[end // self.block_size - 1],
            shared,
            keep,
        )

    def saves_at_end(self, requests: Iterable[Request]) -> list[SaveOnDrop]:
        """For requests whose states the ranks drop next: keep the state of each one that was
        not cancelled, where it covers more than its prompt (which was saved where its prefill
        ended): a conversation's next turn begins with this one's prompt and output."""
        saves: list[SaveOnDrop] = []
        for request in requests:
            if request.num_sent > request.prefill_len and request.finish_reason not in (
                "abort",
                "error",
            ):
                save = self.save_where_it_stands(request, [s.prefix for s in saves])
                if save is not None:
                    saves.append(save)
        return saves

    def save_where_it_stands(self, request: Request, keep: Collection[int]) -> SaveOnDrop | None:
        """Keep the state of a request the ranks drop next over the positions sent to them
        (at the end of its generation, or preempted: its recompute then starts there), or
        None (not cached, too short, not all its ids known, no id to take, or saved already);
        eviction for its id passes over `keep`."""
        plan, end, bs = self._plans.get(request.request_id), request.num_sent, self.block_size
        if plan is None or plan.stale or end < bs or (ids := request.sent_cache_ids) is None:
            return None
        full = end // bs
        if full <= len(plan.hashes):
            key = plan.hashes[full - 1]
        else:  # its output's full blocks, chained on from its prefill's
            key = plan.hashes[-1] if plan.hashes else 0
            for block in range(len(plan.hashes), full):
                key = hash((key, ids[block * bs : (block + 1) * bs]))
        prefix_id = self._record(request, ids, end, key, False, keep)
        return SaveOnDrop(request.request_id, prefix_id, end) if prefix_id >= 0 else None

    def _record(
        self,
        request: Request,
        ids: tuple[int, ...],
        end: int,
        key: int,
        shared: bool,
        keep: Collection[int],
    ) -> int:
        """A prefix id for the request's state over `ids[:end]` (`key`: the chain hash of its
        full blocks), or -1: none to take, or the same positions are saved already (that one
        is now the most recently used)."""
        for saved in self._by_hash.get(key, ()):
            if not saved.stale and saved.num_tokens == end and saved.prompt[:end] == ids[:end]:
                self._saved.move_to_end(saved.prefix_id)
                return -1
        if not self._free_ids and not self._evict_one(keep, shared):
            return -1
        blocks = self.ledger.blocks(request.request_id)[: self.ledger.blocks_for(end)]
        self.ledger.hold(blocks)
        prefix = SavedPrefix(self._free_ids.pop(), ids, end, blocks, key, shared)
        self._saved[prefix.prefix_id] = prefix
        self._by_hash.setdefault(key, []).append(prefix)
        if self.events is not None:
            self.events.saved(prefix)
        return prefix.prefix_id

    def take_evicted(self) -> list[int]:
        """Prefix ids to send as the next step's `evict` (before its saves reuse them)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def await_resume(self, request: Request) -> None:
        """A preempted request waits: the prefix its recompute would start from now (where it
        stopped, or its prompt's) is evicted after every other, until it is admitted again."""
        if self.enabled:
            found = self._longest(
                request.prefill_cache_ids, self._hashes(request.prefill_cache_ids)
            )
            if found is not None:
                self._awaited[request.request_id] = found.prefix_id

    def forget(self, request_id: int) -> None:
        """The request ended (or left the ranks): drop its plan, and the pin of a prefix it
        never started from."""
        self._awaited.pop(request_id, None)
        plan = self._plans.pop(request_id, None)
        if plan is not None:
            self._unpin(plan)
            self._end_split(plan)  # if it ended before its split was saved

    def _end_split(self, plan: PromptPlan) -> None:
        if plan.splitting:
            self._splitting.discard(plan.hashes[plan.split_at // self.block_size - 1])
            plan.splitting = False

    def _unpin(self, plan: PromptPlan) -> None:
        if plan.pinned:
            plan.start.pins -= 1
            plan.pinned = False

    def flush(self) -> None:
        """Forget every saved prefix (new weights make their states stale) but those an
        admitted request waits to start from (pinned: only beside frozen requests, a "keep"
        pause), which no later request finds and which are evicted first once unpinned. The
        ranks free the rest with the next command. Requests admitted already save nothing:
        their states are partly the old weights'."""
        if self.events is not None:
            self.events.cleared()
        for prefix in self._victims():
            self._evict(prefix)
        for prefix in self._saved.values():
            prefix.stale = True
        self._seen.clear()
        for plan in self._plans.values():
            plan.stale = True

    # ---- eviction -----------------------------------------------------------------------

    def _evict_one(self, keep: Collection[int], shared_too: bool) -> bool:
        victim = next(
            (
                p
                for p in self._victims()
                if p.prefix_id not in keep and (shared_too or not p.shared)
            ),
            None,
        )
        if victim is not None:
            self._evict(victim)
        return victim is not None

    def _victims(self) -> list[SavedPrefix]:
        """The unpinned prefixes in eviction order."""
        awaited = set(self._awaited.values())
        ready = [p for p in self._saved.values() if p.pins == 0 and p.prefix_id not in awaited]
        return (
            [p for p in ready if p.stale]
            + [p for p in ready if not (p.shared or p.stale)]
            + [p for p in ready if p.shared and not p.stale]
            + [p for p in self._saved.values() if p.pins == 0 and p.prefix_id in awaited]
        )

    def _evict(self, prefix: SavedPrefix) -> None:
        for request_id in [r for r, p in self._awaited.items() if p == prefix.prefix_id]:
            del self._awaited[request_id]
        del self._saved[prefix.prefix_id]
        group = self._by_hash[prefix.key]
        group.remove(prefix)
        if not group:
            del self._by_hash[prefix.key]
        self.ledger.let_go(prefix.blocks)
        self._free_ids.append(prefix.prefix_id)
        self._evicted.append(prefix.prefix_id)
        if self.events is not None:
            self.events.evicted(prefix)
