"""The scheduler's side of speculative decoding (engine/rank/speculative.py does the ranks'):
which drafts each step verifies and asks for, what a step's outcome emits, and when
speculation is worth it.

A step that samples a request may ask the ranks for drafts (`StepItem.propose`): the MTP
head's guesses of the tokens after the one sampled, returned with the step's results. The
request's next step verifies them: its decode item carries its last token and the drafts
(`num_drafts`); the ranks keep the positions up to the last accepted draft and return how
many were accepted, each emitted before the step's own sample, and the next drafts. A
request's drafts are used by its next step or never (a step that ran without them makes
them stale).

Adaptive (never slower than without speculation by more than the probes cost): no drafts in
a step whose decoding batch is at or above `SpeculativeConfig.off_at_batch` (verification
would cost more than it saves, measured by tools/bench_mtp.py), and per draft position the
running acceptance rate decides how many positions pay for themselves (`MIN_REACH`); with
none paying, one step in PROBE_STEPS drafts one token to measure again. Since speculation
never changes a token (the ranks emit what the target samples), turning it up or down is
free of any effect on the output.
"""

from __future__ import annotations

from collections.abc import Callable

from deltaserve.engine.metrics import EngineMetrics
from deltaserve.engine.planner import PlannedChunk
from deltaserve.engine.request import Request
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.ipc.messages import Sample, SpecOutcome

# The chance that a draft position is reached and accepted at which drafting it pays: a draft
# step's cost (the head's layer and the lm_head read, ~1/5 of a 4B decode step at batch 1 by
# the roofline) plus a verify row's, against a decode step. tools/bench_mtp.py
# reports the measured break-even; this is its roofline estimate until an H100 run sets it.
MIN_REACH = 0.25
PROBE_STEPS = 32  # with no position paying, one step in this many drafts one token
ACCEPTANCE_MEMORY = 0.9  # each step's acceptance rates weigh 1 - this in the running ones


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.max_drafts = config.num_speculative_tokens
        # per draft position: the running share of drafts accepted once reached (optimistic
        # at start, so that the first steps speculate and measure)
        self.acceptance = [1.0] * self.max_drafts
        self.step_drafts = 0  # drafts per request of the step being planned (`choose`)
        self.active = False  # the step last sent verifies or asks for drafts (never followed)
        self._drafts: dict[int, list[int]] = {}  # request id -> drafts for its next step
        self._sent: dict[int, list[int]] = {}  # request id -> drafts its step in flight verifies
        self._steps_off = 0
        self.forced_drafts: int | None = None  # benchmarks only (`force`)
        self.proposer: Callable[[Request, int, list[int]], list[int]] | None = None

    def force(
        self,
        num_drafts: int | None,
        proposer: Callable[[Request, int, list[int]], list[int]] | None = None,
    ) -> None:
        """Benchmarks only (tools/bench_mtp.py): `num_drafts` per step whatever the batch and
        the acceptance (None: adaptive again), and drafts replaced by `proposer(request,
        first output index they stand for, the head's drafts)`. The head still runs: its cost
        is measured; the output stays the target's whatever the drafts."""
        if num_drafts is not None and not 0 <= num_drafts <= self.max_drafts:
            raise ValueError(f"num_drafts {num_drafts} outside 0..{self.max_drafts}")
        self.forced_drafts, self.proposer = num_drafts, proposer
        self.acceptance = [1.0] * self.max_drafts  # a new workload: measured afresh
        self._steps_off = 0

    def choose(self, num_decoding: int) -> int:
        """Drafts per request for a step of `num_decoding` decoding requests."""
        if self.forced_drafts is not None:
            self.step_drafts = self.forced_drafts
            return self.forced_drafts
        drafts = 0
        if num_decoding < self.config.off_at_batch:
            reach = 1.0
            for rate in self.acceptance:
                reach *= rate
                if reach < MIN_REACH:
                    break
                drafts += 1
            if drafts == 0:  # a probe now and then measures the acceptance again
                self._steps_off += 1
                if self._steps_off >= PROBE_STEPS:
                    self._steps_off, drafts = 0, 1
        self.step_drafts = drafts
        return drafts

    def num_drafts(self, request: Request) -> int:
        """Drafts the planned step verifies for a decoding request: those it holds, at most
        the step's and what its max_tokens leaves room for (the step emits one more)."""
        room = request.params.max_tokens - request.num_output_tokens - 1
        return max(0, min(len(self._drafts.get(request.request_id, ())), self.step_drafts, room))

    def item_fields(self, request: Request, chunk: PlannedChunk) -> tuple[list[int], int, int]:
        """A chunk's (token ids, num_drafts, propose): a verify item is its last token and
        its drafts; a chunk that samples asks for the step's drafts where max_tokens leaves
        room for more than the token it samples. The request's drafts are spent."""
        drafts = self._drafts.pop(request.request_id, [])
        verified = chunk.num_tokens - 1 if chunk.is_decode else 0
        tokens = request.input_tokens(chunk.start, chunk.num_tokens - verified)
        tokens += drafts[:verified]
        if verified:
            self._sent[request.request_id] = drafts[:verified]
        room = request.params.max_tokens - request.num_output_tokens - 1 - verified
        propose = min(self.step_drafts, room) if chunk.sample and room > 0 else 0
        self.active = self.active or bool(verified or propose)
        return tokens, verified, max(0, propose)

    def outcome(
        self, request: Request, outcome: SpecOutcome, metrics: EngineMetrics
    ) -> list[Sample]:
        """The step's outcome for a request: its accepted drafts as samples (emitted before
        the step's own), its next drafts kept; the counters and acceptance rates updated."""
        sent = self._sent.pop(request.request_id, [])
        accepted = outcome.accepted
        drafts = list(outcome.drafts)
        if self.proposer is not None and drafts:  # they stand for the tokens after this step's
            drafts = self.proposer(request, request.num_output_tokens + accepted + 1, drafts)
        self._drafts[request.request_id] = drafts
        if sent:
            metrics.spec_decode_num_drafts_total += 1
            metrics.spec_decode_num_draft_tokens_total += len(sent)
            metrics.spec_decode_num_accepted_tokens_total += accepted
            per_position = metrics.spec_decode_num_accepted_tokens_per_pos
            for position in range(accepted):
                per_position[position] = per_position.get(position, 0) + 1
            self._measure(len(sent), accepted)
        tops = outcome.top_logprobs or [[] for _ in range(accepted)]
        return [
            Sample(request.request_id, token, logprob, top)
            for token, logprob, top in zip(sent[:accepted], outcome.logprobs, tops, strict=True)
        ]

    def begin_step(self) -> None:
        """A step's items are about to be made: `active` is about that step from now on."""
        self.active = False

    def forget(self, request_id: int) -> None:
        self._drafts.pop(request_id, None)
        self._sent.pop(request_id, None)

    def _measure(self, verified: int, accepted: int) -> None:
        """One verify's outcome in the running acceptance rates: positions 0 .. accepted were
        reached, the first `accepted` of them taken."""
        for position in range(min(verified, accepted + 1)):
            taken = float(position < accepted)
            rate = self.acceptance[position]
            self.acceptance[position] = ACCEPTANCE_MEMORY * rate + (1 - ACCEPTANCE_MEMORY) * taken
