"""Checks the controller makes: plans before dispatch, reply sets after.

A plan error is provable without asking a rank, so it is rejected (`PlanRejected`) and the
replica stays healthy. A reply error means a rank's state or the protocol broke after the
command left, so it is fatal (`ReplyError`; the controller poisons the replica).
Pure functions and one small class: tested without processes (tests/test_ipc_validate.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from deltaserve.ipc.messages import (
    SAMPLING_RANGES,
    Ack,
    Command,
    DropAck,
    DropRequests,
    Failure,
    LoadWeights,
    NewRequest,
    Ping,
    Reply,
    RunUnifiedStep,
    SampleColumns,
    SaveOnDrop,
    Shutdown,
    Sleep,
    Snapshot,
    SnapshotReply,
    StepItem,
    StepResult,
    WakeUp,
)

MAX_LOGPROBS = 20  # vLLM's default max_logprobs (ReplicaConfig.max_logprobs)


class PlanRejected(ValueError):
    """A provably malformed plan; nothing was sent and the replica is healthy."""


class ReplyError(Exception):
    """A reply set that breaks the protocol; fatal to the replica."""


class StepPlan(NamedTuple):
    item_ids: set[int]  # every request in the step
    sampled_ids: list[int]  # those whose item asks for a sample, in step order: the result's
    vocab_size: int  # every sampled token (and alternative) must be an id below it
    # request -> (rows, alternatives) of the chunks that ask
    prompt_logprobs: dict[int, tuple[int, int]]
    # request -> (drafts it verifies, drafts it asks for) of the items that speculate
    speculative: dict[int, tuple[int, int]] = {}


def check_plan(
    items: list[StepItem],
    vocab_size: int,
    drops: list[int] = (),
    max_logprobs: int = MAX_LOGPROBS,
    saves: list[SaveOnDrop] = (),
    max_drafts: int = 0,
) -> StepPlan:
    """Raise PlanRejected for anything wrong with the step that needs no rank state;
    `max_drafts`: speculative decoding's drafts per item at most (0: none)."""
    if not items:
        raise PlanRejected("step has no items")
    check_drop_plan(list(drops), "must_exist", saves)
    item_ids: set[int] = set()
    sampled_ids: list[int] = []
    prompt_logprobs: dict[int, tuple[int, int]] = {}
    speculative: dict[int, tuple[int, int]] = {}
    for item in items:
        rid = item.request_id
        if rid in item_ids:
            raise PlanRejected(f"request {rid} appears twice in one step")
        item_ids.add(rid)
        if item.sample:
            sampled_ids.append(rid)
        tokens = item.token_ids
        start = item.start
        if len(tokens) == 1:
            if not 0 <= tokens[0] < vocab_size:
                raise PlanRejected(
                    f"request {rid}: token id {tokens[0]} "
                    f"outside the vocabulary 0..{vocab_size - 1}"
                )
        elif not tokens:
            if start == 0:
                raise PlanRejected(f"request {rid}: first chunk (start 0) has no token_ids")
        elif min(tokens) < 0 or max(tokens) >= vocab_size:
            bad = next(t for t in tokens if not 0 <= t < vocab_size)
            raise PlanRejected(
                f"request {rid}: token id {bad} outside the vocabulary 0..{vocab_size - 1}"
            )
        if start < 0:
            raise PlanRejected(f"request {rid}: negative start {start}")
        if item.new is None:
            if start == 0:
                raise PlanRejected(f"request {rid}: first chunk (start 0) without `new`")
        elif (start == 0) != (item.new.prefix < 0):
            raise PlanRejected(
                f"request {rid}: `new` on an item starting at {start}; a first chunk starts at 0, "
                f"or where the saved prefix it names ends"
            )
        else:
            _check_new(rid, start + len(tokens), item.new, max_logprobs)
            outputs = item.new.output_ids
            if outputs and (min(outputs) < 0 or max(outputs) >= vocab_size):
                raise PlanRejected(
                    f"request {rid}: an output id outside the vocabulary 0..{vocab_size - 1}"
                )
        if item.save < -1:
            raise PlanRejected(f"request {rid}: save {item.save} names no saved prefix")
        if item.grow < 0 or (item.grow and item.new is not None):
            raise PlanRejected(
                f"request {rid}: grow {item.grow}; a later item may add blocks (>= 0), a first "
                f"chunk takes them with `new`"
            )
        if item.prompt_logprobs != -1 or item.next_token != -1:
            _check_prompt_logprobs(item, vocab_size, max_logprobs)
            prompt_logprobs[rid] = (item.num_prompt_logprobs, item.prompt_logprobs)
        if item.num_drafts or item.propose:
            _check_speculative(item, max_drafts)
            speculative[rid] = (item.num_drafts, item.propose)
    if drops and not item_ids.isdisjoint(drops):
        rid = min(item_ids.intersection(drops))
        raise PlanRejected(f"request {rid} is both dropped and run in one step")
    prefixes = [item.save for item in items if item.save >= 0] + [save.prefix for save in saves]
    if len(set(prefixes)) != len(prefixes):
        raise PlanRejected(f"saved prefix {first_duplicate(prefixes)} is saved twice in one step")
    return StepPlan(item_ids, sampled_ids, vocab_size, prompt_logprobs, speculative)


def _check_speculative(item: StepItem, max_drafts: int) -> None:
    rid = item.request_id
    for name in ("num_drafts", "propose"):
        if not 0 <= getattr(item, name) <= max_drafts:
            raise PlanRejected(
                f"request {rid}: {name} {getattr(item, name)} outside 0..{max_drafts} "
                "(the speculative tokens configured)"
            )
    if not item.sample:
        raise PlanRejected(f"request {rid}: drafts on an item that does not sample")
    if item.num_drafts and (item.new is not None or len(item.token_ids) != 1 + item.num_drafts):
        raise PlanRejected(
            f"request {rid}: {item.num_drafts} drafts on an item of {len(item.token_ids)} tokens "
            "(a verify item is a decode: its last sample, then the drafts)"
        )
    if item.num_drafts and item.prompt_logprobs != -1:
        raise PlanRejected(f"request {rid}: drafts on a chunk that asks for prompt logprobs")


def _check_prompt_logprobs(item: StepItem, vocab_size: int, max_logprobs: int) -> None:
    rid, k = item.request_id, item.prompt_logprobs
    if not -1 <= k <= max_logprobs:
        raise PlanRejected(f"request {rid}: prompt_logprobs {k} outside -1..{max_logprobs}")
    if k == -1:
        raise PlanRejected(f"request {rid}: next_token {item.next_token} without prompt_logprobs")
    if not item.token_ids:
        raise PlanRejected(f"request {rid}: prompt logprobs asked of an item without prompt tokens")
    if item.sample and item.next_token != -1:
        raise PlanRejected(f"request {rid}: a chunk that samples has no next prompt token")
    if not item.sample and not 0 <= item.next_token < vocab_size:
        raise PlanRejected(
            f"request {rid}: next_token {item.next_token} "
            f"outside the vocabulary 0..{vocab_size - 1}"
        )


def first_duplicate(ids: list[int]) -> int:
    seen: set[int] = set()
    return next(rid for rid in ids if rid in seen or seen.add(rid))


def _check_new(rid: int, chunk_len: int, new: NewRequest, max_logprobs: int) -> None:
    reserve = new.reserve_tokens
    if reserve < chunk_len:
        raise PlanRejected(
            f"request {rid}: reserve_tokens {reserve} is less than its first chunk of {chunk_len}"
        )
    spec = new.sampling
    for name, allowed in SAMPLING_RANGES.items():
        value = getattr(spec, name)
        if not math.isfinite(value):  # NaN would compare false; inf is no sampling value
            raise PlanRejected(f"request {rid}: {name} {value} is not a finite number")
        if not allowed.admits(value):
            raise PlanRejected(f"request {rid}: {name} {value} outside {allowed}")
    if spec.top_k < 0:
        raise PlanRejected(f"request {rid}: top_k {spec.top_k} < 0")
    if not 0 <= spec.num_logprobs <= max_logprobs:
        raise PlanRejected(
            f"request {rid}: num_logprobs {spec.num_logprobs} outside 0..{max_logprobs}"
        )


def check_drop_plan(request_ids: list[int], expect: str, saves: list[SaveOnDrop] = ()) -> None:
    if expect not in ("must_exist", "must_be_absent"):
        raise PlanRejected(f"drop expect must be 'must_exist' or 'must_be_absent', got {expect!r}")
    if len(set(request_ids)) != len(request_ids):
        raise PlanRejected(f"request {first_duplicate(request_ids)} appears twice in one drop")
    for save in saves:
        if expect != "must_exist" or save.request_id not in request_ids:
            raise PlanRejected(
                f"request {save.request_id}: its state is saved, "
                "but it is not a drop that must exist"
            )
        if save.prefix < 0 or save.num_tokens < 1:
            raise PlanRejected(
                f"request {save.request_id}: "
                f"saved prefix {save.prefix} of {save.num_tokens} positions"
            )
    for ids, what in (
        ([s.request_id for s in saves], "request"),
        ([s.prefix for s in saves], "saved prefix"),
    ):
        if len(set(ids)) != len(ids):
            raise PlanRejected(f"{what} {first_duplicate(ids)} appears twice in one drop's saves")


# (variant rank 0 sends, variant the other ranks send), by command
EXPECTED_REPLY: dict[type, tuple[type, type]] = {
    RunUnifiedStep: (StepResult, Ack),
    DropRequests: (DropAck, DropAck),
    Ping: (Ack, Ack),
    Snapshot: (SnapshotReply, SnapshotReply),
    LoadWeights: (Ack, Ack),
    Sleep: (Ack, Ack),
    WakeUp: (Ack, Ack),
    Shutdown: (Ack, Ack),
}


class ReplySet:
    """The replies to one command: exactly one per rank, each of the expected variant."""

    __slots__ = (
        "command",
        "name",
        "seq",
        "num_ranks",
        "plan",
        "replies",
        "missing",
        "samples",
        "_want",
    )

    def __init__(self, command: Command, num_ranks: int, plan: StepPlan | None = None) -> None:
        self.command = command
        self.name = type(command).__name__
        self.seq = command.seq
        self.num_ranks = num_ranks
        self.plan = plan
        self.replies: list[Reply | None] = [None] * num_ranks
        self.missing = num_ranks
        self.samples: SampleColumns | None = None  # rank 0's, aligned on arrival
        self._want = EXPECTED_REPLY[type(command)]

    def add(self, reply: Reply) -> bool:
        """Take one reply (whose seq the caller matched); True once every rank has replied."""
        rank = reply.rank
        kind = type(reply)
        if not 0 <= rank < self.num_ranks:
            raise ReplyError(
                f"{kind.__name__} for {self.name} seq {self.seq} claims rank {rank}, "
                f"outside 0..{self.num_ranks - 1}"
            )
        if self.replies[rank] is not None:
            raise ReplyError(f"rank {rank} sent a second reply to {self.name} seq {self.seq}")
        if kind is Failure:
            raise ReplyError(f"rank {rank} failed {self.name} seq {self.seq}: {reply.reason}")
        want = self._want[0] if rank == 0 else self._want[1]
        if kind is not want:
            raise ReplyError(
                f"rank {rank} replied {kind.__name__} to {self.name} seq {self.seq}; "
                f"expected {want.__name__}"
            )
        if kind is StepResult:  # checked now, while the other ranks' acks are on their way
            self.samples = align_samples(reply.samples, self.plan)
        self.replies[rank] = reply
        self.missing -= 1
        return self.missing == 0

    def missing_ranks(self) -> list[int]:
        return [rank for rank, reply in enumerate(self.replies) if reply is None]

    def result(self) -> object:
        """The command's result once complete: rank 0's samples in step order (step), the
        replies by rank (snapshot), else None. Raises ReplyError if the set is inconsistent."""
        kind = type(self.command)
        if kind is RunUnifiedStep:
            return self.samples
        if kind is DropRequests:
            check_drop_acks(self.command, self.replies)
            return None
        if kind is Snapshot:
            return list(self.replies)
        return None


def align_samples(samples: SampleColumns, plan: StepPlan) -> SampleColumns:
    """Rank 0's samples matched to the step by request id, returned in the step's order.

    Any order is accepted, but every sampled item needs exactly one sample and nothing else
    may have one; alternatives only for sampled requests; every token id in the vocabulary.
    In the usual case the ids already come in step order, and one list comparison proves it.
    """
    want = plan.sampled_ids
    if samples.request_ids != want:
        samples = _reorder(samples, plan)
    tokens = samples.token_ids
    if tokens and (min(tokens) < 0 or max(tokens) >= plan.vocab_size):
        row = next(r for r, t in enumerate(tokens) if not 0 <= t < plan.vocab_size)
        raise ReplyError(
            f"rank 0 sampled token {tokens[row]} for request {want[row]}, outside the "
            f"vocabulary 0..{plan.vocab_size - 1}"
        )
    if samples.prompt_logprobs or plan.prompt_logprobs:
        _check_prompt_logprob_rows(samples, plan)
    if samples.speculative or plan.speculative:
        _check_speculative_outcomes(samples, plan)
    if samples.failed and not samples.failed.keys() <= set(want):
        rid = min(samples.failed.keys() - set(want))
        raise ReplyError(f"rank 0 reported request {rid} failed, which has no sample in the step")
    top = samples.top_logprobs
    if top:
        if not top.keys() <= set(want):
            rid = min(top.keys() - set(want))
            raise ReplyError(f"rank 0 returned top logprobs for request {rid}, which has no sample")
        for rid, pairs in top.items():
            if any(not 0 <= t < plan.vocab_size for t, _ in pairs):
                raise ReplyError(
                    f"rank 0 returned a top logprob for request {rid} outside the vocabulary"
                )
    return samples


def _check_same_requests(got: dict, want: dict, what: str) -> None:
    """Rank 0 returned `what` for exactly the requests that asked."""
    if got.keys() != want.keys():
        extra, missing = sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys())
        raise ReplyError(
            f"rank 0 returned {what} for request(s) {extra} that asked none, "
            f"and none for {missing} that asked"
        )


def _check_prompt_logprob_rows(samples: SampleColumns, plan: StepPlan) -> None:
    got, want = samples.prompt_logprobs, plan.prompt_logprobs
    _check_same_requests(got, want, "prompt logprobs")
    for rid, part in got.items():
        rows, k = want[rid]
        if len(part.logprobs) != rows or any(len(top) != k for top in part.top_logprobs):
            raise ReplyError(
                f"rank 0 returned {len(part.logprobs)} prompt logprob rows for request {rid}, "
                f"not {rows} of {k} alternatives each"
            )
        if part.ranks and min(part.ranks) < 1:
            raise ReplyError(f"rank 0 returned a prompt token rank below 1 for request {rid}")
        if any(not 0 <= t < plan.vocab_size for top in part.top_logprobs for t, _ in top):
            raise ReplyError(
                f"rank 0 returned a prompt logprob for request {rid} outside the vocabulary"
            )


def _check_speculative_outcomes(samples: SampleColumns, plan: StepPlan) -> None:
    """One outcome per item that speculated, within what it asked: no more drafts accepted
    than it verified, a logprob per accepted draft (and alternatives, if any, for each), no
    more drafts than it asked for, each in the vocabulary."""
    got, want = samples.speculative, plan.speculative
    _check_same_requests(got, want, "speculative outcomes")
    for rid, outcome in got.items():
        verified, asked = want[rid]
        accepted = outcome.accepted
        if not 0 <= accepted <= verified or len(outcome.logprobs) != accepted:
            raise ReplyError(
                f"rank 0 accepted {accepted} of request {rid}'s {verified} drafts, with "
                f"{len(outcome.logprobs)} logprobs"
            )
        if len(outcome.top_logprobs) not in (0, accepted):
            raise ReplyError(
                f"rank 0 returned {len(outcome.top_logprobs)} lists of alternatives for request "
                f"{rid}'s {accepted} accepted drafts"
            )
        tokens = [t for top in outcome.top_logprobs for t, _ in top] + outcome.drafts
        if len(outcome.drafts) > asked or any(not 0 <= t < plan.vocab_size for t in tokens):
            raise ReplyError(
                f"rank 0 returned {len(outcome.drafts)} drafts for request {rid}, which asked "
                f"for {asked}, or a token outside the vocabulary"
            )


def _reorder(samples: SampleColumns, plan: StepPlan) -> SampleColumns:
    ids, want = samples.request_ids, plan.sampled_ids
    row_of = dict(zip(ids, range(len(ids)), strict=True))
    if len(row_of) != len(ids):
        raise ReplyError(f"rank 0 returned two samples for request {first_duplicate(ids)}")
    wanted = set(want)
    if row_of.keys() != wanted:
        for rid in sorted(row_of.keys() - wanted):
            if rid in plan.item_ids:
                raise ReplyError(
                    f"rank 0 returned a sample for request {rid}, whose item asked for none "
                    f"(not its final chunk)"
                )
            raise ReplyError(
                f"rank 0 returned a sample for request {rid}, which is not in the step"
            )
        missing = sorted(wanted - row_of.keys())
        raise ReplyError(f"rank 0 returned no sample for request(s) {missing}")
    rows = [row_of[rid] for rid in want]
    tokens, logprobs = samples.token_ids, samples.logprobs
    return SampleColumns(
        list(want),
        [tokens[r] for r in rows],
        [logprobs[r] for r in rows],
        samples.top_logprobs,
        samples.prompt_logprobs,
        samples.failed,
        samples.speculative,
    )


def check_drop_acks(command: DropRequests, replies: list[DropAck]) -> None:
    """Every rank must answer as the scheduler expects for every id; a mixed answer means
    the ranks diverged, a uniform unexpected one that the scheduler and ranks did."""
    ids = command.request_ids
    want = command.expect == "must_exist"
    for reply in replies:
        if len(reply.existed) != len(ids):
            raise ReplyError(
                f"rank {reply.rank} answered {len(reply.existed)} flags to DropRequests seq "
                f"{command.seq} of {len(ids)} requests"
            )
    if all((all(r.existed) if want else not any(r.existed)) for r in replies):
        return
    for i, rid in enumerate(ids):
        held = [r.rank for r in replies if r.existed[i]]
        if 0 < len(held) < len(replies):
            lacking = [r.rank for r in replies if not r.existed[i]]
            raise ReplyError(
                f"ranks disagree on request {rid}: "
                f"rank(s) {held} held it, rank(s) {lacking} did not"
            )
        if bool(held) != want:
            state = "no rank held it" if want else "every rank still held it"
            raise ReplyError(f"request {rid} dropped with expect={command.expect}, but {state}")
