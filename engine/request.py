"""One choice of a generate call, as the scheduler tick sees it.

A request is a few stored counters; the rest is derived (nano-vllm `Sequence`, vLLM v1
`Request`). Every status write and counter change is one of the named methods below, so the
lifecycle can be read in one place:

  WAITING --admit--> RUNNING --finish(stop|length|abort|error)--> FINISHED_*
  RUNNING --preempt--> WAITING                        (its state left the ranks: recomputed)
  WAITING --finish(abort|error)--> FINISHED_*         (never reached a rank, or left them)

An admission prefills `prefill_len` positions before the request samples: its prompt, or
after a preemption its prompt and every token sampled before it (vLLM's recompute), so its
stream goes on where it stopped: the next sample is output index `num_output_tokens`, seeded
as it would have been.

Invariants: 0 <= num_computed <= num_tokens; while decoding, num_computed == num_tokens - 1
(the newest sampled token is the next step's input); `on_ranks` once a first chunk was sent
since its admission; num_computed <= num_sent (steps in flight have more of its positions).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from deltaserve.engine.events import PromptLogprobsEvent
from deltaserve.engine.media_prompt import MultimodalPrompt
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.ipc.messages import PromptLogprobs

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED_BY_REASON.values()


_FINISHED_BY_REASON: dict[str, RequestStatus] = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}
# The one mapping from terminal status to the finish reason clients see (OpenAI's names).
FINISH_REASON: dict[RequestStatus, FinishReason] = {s: r for r, s in _FINISHED_BY_REASON.items()}


@dataclass(eq=False, slots=True)
class Request:
    request_id: int  # engine-assigned, never reused
    index: int  # which of the caller's n choices
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # resolved: the caller's seed (+ index) or one drawn at submit
    arrival_time_s: float
    priority: int = 0  # admitted before higher values under the priority policy
    multimodal: MultimodalPrompt | None = None  # a prompt with images or video: their media
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # positions whose state the ranks hold
    num_cached: int = 0  # prompt positions taken from a saved prefix (engine/prefix_cache.py)
    num_preemptions: int = 0  # times its state left the ranks to be recomputed
    resume_len: int = 0  # after a preemption: positions its next admission prefills
    num_sent: int = 0  # positions sent to the ranks: their state covers these once the steps ran
    on_ranks: bool = False  # ranks hold (or are about to hold) state for it
    _output_ids: list[int] = field(default_factory=list)
    # the prompt's logprobs so far, a part per chunk (params.prompt_logprobs; the scheduler's)
    prompt_logprob_parts: list[PromptLogprobs] = field(default_factory=list)
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None

    @property
    def output_ids(self) -> tuple[int, ...]:
        return tuple(self._output_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self._output_ids)

    @property
    def lifetime_tokens(self) -> int:
        """Positions of its whole lifetime: prompt + max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def prefill_len(self) -> int:
        """Positions this admission computes before it samples: the prompt, or after a
        preemption the prompt and the tokens sampled before it."""
        return self.resume_len or len(self.prompt_ids)

    @property
    def prefill_ids(self) -> tuple[int, ...]:
        """The ids at those positions."""
        if not self.resume_len:
            return self.prompt_ids
        return (*self.prompt_ids, *self._output_ids)[: self.resume_len]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASON.get(self.status)

    def input_tokens(self, start: int, num_tokens: int) -> list[int]:
        """Token ids at positions start .. start+num_tokens-1 (prompt, then output)."""
        if start != self.num_computed or start + num_tokens > self.num_tokens:
            raise ValueError(
                f"request {self.request_id}: positions {start}..{start + num_tokens - 1} asked, "
                f"{self.num_computed} computed of {self.num_tokens} known"
            )
        p = len(self.prompt_ids)
        if start + num_tokens <= p:
            return list(self.prompt_ids[start : start + num_tokens])
        return [
            *self.prompt_ids[start:],
            *self._output_ids[max(0, start - p) : start + num_tokens - p],
        ]

    def prompt_logprobs_fields(
        self, start: int, num_tokens: int, is_decode: bool
    ) -> tuple[int, int]:
        """A chunk's (StepItem.prompt_logprobs, next_token): (-1, -1) unless it is a prompt
        chunk of a request with prompt logprobs that has sampled nothing yet (a request
        preempted after its first token has delivered them); the next token only if the
        prompt goes on."""
        k = self.params.prompt_logprobs
        if k is None or is_decode or self._output_ids:
            return -1, -1
        end = start + num_tokens
        return k, self.prompt_ids[end] if end < len(self.prompt_ids) else -1

    def prompt_logprobs_event(self) -> PromptLogprobsEvent:
        """Its chunks' prompt logprobs, in order, as one event."""
        parts = self.prompt_logprob_parts
        return PromptLogprobsEvent(
            self.index,
            [lp for part in parts for lp in part.logprobs],
            [rank for part in parts for rank in part.ranks],
            [top for part in parts for top in part.top_logprobs],
        )

    # ---- transitions -------------------------------------------------------------------

    def admit(self, num_cached: int = 0) -> None:
        """Its first `num_cached` positions come from a saved prefix: computed (counted as
        cached prompt tokens at its first admission only)."""
        self._expect(RequestStatus.WAITING, "admit")
        if not 0 <= num_cached < self.prefill_len:
            raise ValueError(
                f"request {self.request_id}: {num_cached} cached positions of a "
                f"{self.prefill_len}-token prefill"
            )
        self.status = RequestStatus.RUNNING
        self.num_computed = num_cached
        if not self.num_preemptions:
            self.num_cached = num_cached

    def preempt(self) -> None:
        """Its state left the ranks (no step of it in flight): it waits again, and its next
        admission prefills its prompt and every token sampled so far. Prompt logprobs not yet
        delivered are computed again."""
        self._expect(RequestStatus.RUNNING, "preempt")
        if self.on_ranks and self.num_sent != self.num_computed:
            raise ValueError(
                f"request {self.request_id}: preempted with {self.num_sent - self.num_computed} "
                f"positions in flight"
            )
        self.status = RequestStatus.WAITING
        self.resume_len = self.num_tokens
        self.num_computed = self.num_sent = 0
        self.on_ranks = False
        self.num_preemptions += 1
        if not self._output_ids:
            self.prompt_logprob_parts.clear()

    def mark_sent(self, end: int) -> None:
        """A chunk through position `end` - 1 is going to the ranks: from now on they hold its
        state (a pipelined step's position is not yet among `num_tokens`)."""
        self._expect(RequestStatus.RUNNING, "dispatch")
        self.on_ranks = True
        self.num_sent = end

    @property
    def sent_ids(self) -> tuple[int, ...] | None:
        """The ids at the positions sent to the ranks, or None if not all are known yet."""
        if self.num_sent > self.num_tokens:
            return None
        return (*self.prompt_ids, *self._output_ids)[: self.num_sent]

    @property
    def media_costs(self) -> tuple[tuple[int, int], ...]:
        """(first token, patches) of each image or video: the planner's (engine/planner.py)."""
        if self.multimodal is None:
            return ()
        return tuple((item.first, item.num_patches) for item in self.multimodal.media)

    @property
    def cache_ids(self) -> tuple[int, ...]:
        """The prompt as the prefix cache keys it: placeholder tokens stand for their image."""
        return self.prompt_ids if self.multimodal is None else self.multimodal.cache_ids()

    @property
    def sent_cache_ids(self) -> tuple[int, ...] | None:
        """`sent_ids` as the prefix cache keys them (`cache_ids`, then the output)."""
        if self.num_sent > self.num_tokens:
            return None
        return (*self.cache_ids, *self._output_ids)[: self.num_sent]

    @property
    def prefill_cache_ids(self) -> tuple[int, ...]:
        """`prefill_ids` as the prefix cache keys them (`cache_ids`, then the output)."""
        if not self.resume_len:
            return self.cache_ids
        return (*self.cache_ids, *self._output_ids)[: self.resume_len]

    def advance(self, num_tokens: int) -> None:
        """A step ran `num_tokens` more of its positions."""
        self._expect(RequestStatus.RUNNING, "advance")
        if num_tokens < 1 or self.num_computed + num_tokens > self.num_tokens:
            raise ValueError(
                f"request {self.request_id}: cannot advance {num_tokens} from "
                f"{self.num_computed} of {self.num_tokens} positions"
            )
        self.num_computed += num_tokens

    def append_token(self, token_id: int, now_s: float) -> None:
        self._expect(RequestStatus.RUNNING, "append a token")
        if self.num_computed != self.num_tokens:
            raise ValueError(
                f"request {self.request_id}: sampled with {self.num_computed} of "
                f"{self.num_tokens} positions computed"
            )
        self._output_ids.append(token_id)
        if self.first_token_time_s is None:
            self.first_token_time_s = now_s
        self.last_token_time_s = now_s

    def finish(self, reason: FinishReason) -> None:
        if self.status.is_finished:
            raise ValueError(f"request {self.request_id} already {self.status.value}")
        if reason in ("stop", "length") and self.status is not RequestStatus.RUNNING:
            raise ValueError(
                f"request {self.request_id} cannot end with {reason!r} while {self.status.value}"
            )
        self.status = _FINISHED_BY_REASON[reason]

    def _expect(self, status: RequestStatus, action: str) -> None:
        if self.status is not status:
            raise ValueError(
                f"cannot {action} request {self.request_id}: it is {self.status.value}"
            )
