"""Step planning: which positions of which admitted requests the next unified step runs.

A pure function of the admitted requests and a budget: no torch, no processes, no clocks;
tested on its own. Admission (who holds a slot and blocks) happens before, in the tick.

Policy (vLLM v1's unified step with chunked prefill, written anew): every decoding request
contributes one token, first, in admission order; the tokens left over go to prefill chunks,
first come first served: a request's prompt is chunked to fit, and a later request gets
tokens only when every earlier prompt has been scheduled to its end.

A prompt's chunk never runs past its `split_at` (the prefix cache saves its state there).

KV blocks: a chunk whose positions pass the blocks its request holds takes more (`grow`) from
the free ones (`KvRoom`), never more than are free: a decode that cannot is left out of the
step, a prompt chunk is cut at its blocks' end. The scheduler preempts before planning so that
every decode fits (engine/scheduler.py); this rule makes a plan that runs a rank out of blocks
impossible whatever it did. Speculative drafts (a decode's positions past its own token) come
last, from the tokens and blocks every decode's own token left: they shrink, never a decode.

Images and video count in the budget as what the vision tower encodes in the step: a chunk
that holds a medium's first token also spends its patches; one that cannot afford them ends
before that token (or, at its start, waits for the next step), so the encoder never stretches
a step past what a prompt chunk of the budget would cost.

`force_mixed` (tests) staggers prefills so that prefill and decode share steps: at most one
request prefills per step, in chunks of at most FORCED_CHUNK_TOKENS tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORCED_CHUNK_TOKENS = 7


@dataclass(frozen=True, slots=True)
class PlanInput:
    """What planning needs of an admitted request. Decoding once num_computed >= prompt_len
    (its newest sampled token is then the next input, at position num_computed)."""

    request_id: int
    prompt_len: int  # positions it computes before it decodes (Request.prefill_len)
    num_computed: int
    split_at: int = 0  # a position a prompt chunk must end at (engine/prefix_cache.py); 0: none
    num_blocks: int = 0  # KV blocks it holds (read only with a KvRoom)
    media: tuple[tuple[int, int], ...] = ()  # (first token, patches) of each image or video
    num_drafts: int = 0  # speculative drafts its decode verifies (engine/speculation.py)

    @property
    def is_decoding(self) -> bool:
        return self.num_computed >= self.prompt_len


@dataclass(frozen=True, slots=True)
class StepBudget:
    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so that every decode fits in a step"
            )


@dataclass(frozen=True, slots=True)
class KvRoom:
    """The KV blocks a step may add to its requests' (those free now) and their size."""

    free_blocks: int
    block_size: int

    def growth(self, req: PlanInput, end: int) -> int:
        """Blocks `req` must add to hold positions up to `end`."""
        return max(0, -(-end // self.block_size) - req.num_blocks)


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    """Positions start .. start+num_tokens-1 of one request; `sample` after the last; `grow`
    KV blocks added to its request's before it runs. A decode chunk of more than one token
    verifies num_tokens - 1 drafts (speculative decoding)."""

    request_id: int
    start: int
    num_tokens: int
    is_decode: bool
    sample: bool
    grow: int = 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    chunks: tuple[PlannedChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decodes(self) -> int:
        return sum(c.is_decode for c in self.chunks)

    @property
    def num_prefills(self) -> int:
        return sum(not c.is_decode for c in self.chunks)

    @property
    def is_mixed(self) -> bool:
        return self.num_decodes > 0 and self.num_prefills > 0


def plan_step(
    admitted: Sequence[PlanInput],
    budget: StepBudget,
    force_mixed: bool = False,
    room: KvRoom | None = None,
) -> StepPlan:
    """One ordered step: decode items (admission order), then prefill chunks (FCFS). Each
    decode verifies the drafts it holds, as many as the tokens and KV blocks left after one
    token for every decode allow. `room` None: every request's blocks hold whatever is
    planned (its lifetime's)."""
    chunks: list[PlannedChunk] = []
    tokens_left = budget.max_num_batched_tokens
    blocks_left = room.free_blocks if room is not None else 0
    decoding: list[tuple[PlanInput, int]] = []  # (request, blocks its own token needs)
    for req in admitted:
        if not req.is_decoding:
            continue
        if len(decoding) == budget.max_num_seqs or tokens_left == 0:
            break
        grow = room.growth(req, req.num_computed + 1) if room is not None else 0
        if grow > blocks_left:
            continue  # no block for its next position: it waits (the scheduler preempts first)
        decoding.append((req, grow))
        tokens_left -= 1
        blocks_left -= grow
    for req, grow in decoding:  # drafts only from what every decode's own token left
        drafts = min(req.num_drafts, tokens_left)
        if room is not None:
            own = grow
            while (grow := room.growth(req, req.num_computed + 1 + drafts)) - own > blocks_left:
                drafts -= 1
            blocks_left -= grow - own
        chunks.append(PlannedChunk(req.request_id, req.num_computed, 1 + drafts, True, True, grow))
        tokens_left -= drafts
    for req in admitted:
        if req.is_decoding:
            continue
        if len(chunks) == budget.max_num_seqs or tokens_left == 0:
            break
        remaining = req.prompt_len - req.num_computed
        size = min(remaining, tokens_left)
        if req.num_computed < req.split_at:
            size = min(size, req.split_at - req.num_computed)
        if force_mixed:
            size = min(size, FORCED_CHUNK_TOKENS)
        if room is not None:
            held = (req.num_blocks + blocks_left) * room.block_size - req.num_computed
            size = min(size, held)
            if size < 1:
                break
        size, encoded = fit_media(req, size, tokens_left)
        if size == 0:
            break  # its next image waits for a step with room for its patches
        grow = room.growth(req, req.num_computed + size) if room is not None else 0
        chunks.append(
            PlannedChunk(req.request_id, req.num_computed, size, False, size == remaining, grow)
        )
        tokens_left -= size + encoded
        blocks_left -= grow
        if force_mixed or size < remaining:
            break  # FCFS: nothing later goes ahead of an unfinished prompt
    return StepPlan(tuple(chunks))


def medium_start_cost(patches: int) -> int:
    """The least budget a step spends on a medium: the chunk of its first token alone, and its
    patches. A medium costing more than max_num_batched_tokens could never be planned."""
    return 1 + patches


def max_medium_patches(max_num_batched_tokens: int) -> int:
    """The most patches a medium may have for a step to start it (`medium_start_cost`)."""
    return max_num_batched_tokens - medium_start_cost(0)


def fit_media(req: PlanInput, size: int, tokens_left: int) -> tuple[int, int]:
    """(chunk size, patches encoded): the chunk of `size` tokens from `req.num_computed`, cut
    before the first image whose patches it cannot afford with the chunk's tokens."""
    start = req.num_computed
    encoded = 0
    for first, patches in req.media:
        if not start <= first < start + size:
            continue
        if first - start + encoded + medium_start_cost(patches) > tokens_left:
            return first - start, encoded
        encoded += patches
        size = min(size, tokens_left - encoded)
    return size, encoded
