"""Step planning: which positions of which admitted requests the next unified step runs.

A pure function of the admitted requests and a budget: no torch, no processes, no clocks;
tested on its own. Admission (who holds a reservation) happens before, in the tick.

Policy (vLLM v1's unified step with chunked prefill, written anew): every decoding request
contributes one token, first, in admission order; the tokens left over go to prefill chunks,
first come first served: a request's prompt is chunked to fit, and a later request gets
tokens only when every earlier prompt has been scheduled to its end.

A prompt's chunk never runs past its `split_at` (the prefix cache saves its state there).

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
    prompt_len: int
    num_computed: int
    split_at: int = 0  # a position a prompt chunk must end at (engine/prefix_cache.py); 0: none
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
class PlannedChunk:
    """Positions start .. start+num_tokens-1 of one request; `sample` after the last. A decode
    chunk of more than one token verifies num_tokens - 1 drafts (speculative decoding)."""

    request_id: int
    start: int
    num_tokens: int
    is_decode: bool
    sample: bool


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
    admitted: Sequence[PlanInput], budget: StepBudget, force_mixed: bool = False
) -> StepPlan:
    """One ordered step: decode items (admission order; each with the drafts it verifies,
    as many as the budget leaves after one token for every decode), then prefill chunks
    (FCFS)."""
    chunks: list[PlannedChunk] = []
    tokens_left = budget.max_num_batched_tokens
    decoding = [req for req in admitted if req.is_decoding][: budget.max_num_seqs]
    spare = tokens_left - len(decoding)  # tokens for drafts, a decode's own token kept
    for req in decoding:
        if tokens_left == 0:
            break
        drafts = max(0, min(req.num_drafts, spare))
        spare -= drafts
        chunks.append(PlannedChunk(req.request_id, req.num_computed, 1 + drafts, True, True))
        tokens_left -= 1 + drafts
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
        size, encoded = fit_media(req, size, tokens_left)
        if size == 0:
            break  # its next image waits for a step with room for its patches
        chunks.append(
            PlannedChunk(req.request_id, req.num_computed, size, False, size == remaining)
        )
        tokens_left -= size + encoded
        if force_mixed or size < remaining:
            break  # FCFS: nothing later goes ahead of an unfinished prompt
    return StepPlan(tuple(chunks))


def fit_media(req: PlanInput, size: int, tokens_left: int) -> tuple[int, int]:
    """(chunk size, patches encoded): the chunk of `size` tokens from `req.num_computed`, cut
    before the first image whose patches it cannot afford with the chunk's tokens."""
    start = req.num_computed
    encoded = 0
    for first, patches in req.media:
        if not start <= first < start + size:
            continue
        if first - start + 1 + encoded + patches > tokens_left:
            return first - start, encoded
        encoded += patches
        size = min(size, tokens_left - encoded)
    return size, encoded
