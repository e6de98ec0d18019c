"""What a generate call's stream yields, the engine's errors, its load snapshot, and the
lifecycle transitions the scheduler reports to its listeners (monitors).

Every choice of a request ends with exactly one terminal event: `FinishedEvent` or
`ErrorEvent`. Events are msgspec Structs so that monitors and the HTTP layer can encode them
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import msgspec

from deltaserve.engine.monitor_schema import EngineState

if TYPE_CHECKING:
    from deltaserve.engine.request import Request


class TokenEvent(msgspec.Struct, frozen=True):
    """One generated token of choice `index`. `text` is the detokenized delta; it may be ""
    (half a character, or text held back while a stop string could still be matching).
    `logprob` is of the model's raw distribution; `top_logprobs` holds the best alternatives,
    best first, when the request asked for logprobs."""

    index: int
    token_id: int
    text: str
    logprob: float
    top_logprobs: list[tuple[int, float]]


class PromptLogprobsEvent(msgspec.Struct, frozen=True):
    """The prompt's logprobs of choice `index` (a request with `prompt_logprobs`), before its
    first TokenEvent. Entry i is prompt token i+1's (the first has none, as in vLLM):
    its logprob and rank (1 + how many tokens the model found likelier) under the model's
    raw distribution at the position before it, and the best `prompt_logprobs` alternatives
    there, best first, as (token_id, logprob) pairs."""

    index: int
    token_logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]


class FinishedEvent(msgspec.Struct, frozen=True):
    """Choice `index` ended normally. `text` is any withheld text, flushed at the end."""

    index: int
    reason: Literal["stop", "length", "abort"]
    prompt_tokens: int
    output_tokens: int
    text: str
    cached_tokens: int = 0  # prompt tokens taken from a saved prefix (prefix caching)
    # vLLM's stop_reason: the stop string that ended it, or the stop_token_ids id; None for
    # an EOS, max_tokens or an abort
    stop_reason: str | int | None = None


class ErrorEvent(msgspec.Struct, frozen=True):
    """Choice `index` ended by a failure (engine death, an impossible request). `bound`: the
    request went past one of its own bounds while generating (structured outputs, a stop
    regex), which `message` names: it alone ended, the engine serves on."""

    index: int
    message: str
    bound: bool = False


Event = PromptLogprobsEvent | TokenEvent | FinishedEvent | ErrorEvent


class LoadSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler's view, taken once per tick (and a last, idle one when the engine dies
    or stops). Monitors receive it as a `Load` message (engine/monitor_schema.py).

    `state`: serving, draining (shutdown called, running requests finishing) or dead (failed
    closed, or stopped; nothing more will run). The step_* fields describe the step the
    previous tick ran, all zero if it ran none."""

    state: EngineState = "serving"
    running: int  # admitted requests (holding a slot), including those awaiting their drop
    waiting: int  # submitted, not admitted
    free_slots: int
    free_blocks: int
    num_slots: int
    num_blocks: int
    steps_total: int
    step_prefill_tokens: int = 0
    step_decode_tokens: int = 0
    step_draft_tokens: int = 0  # speculative decoding's drafts the step verified
    step_duration_s: float = 0.0  # dispatch to validated replies
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # speculative decoding (engine/speculation.py): vLLM's counters, and how often each draft
    # position was accepted
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_position: list[int] = []

    @property
    def is_dead(self) -> bool:
        return self.state == "dead"


Transition = Literal[
    "queued",
    "admitted",
    "preempted",  # gave back its slot and blocks; waits to be admitted again
    "first_token",
    "finished",
    "rejected",
    "dropped",  # a request's
    "poisoned",
    "terminal",  # the engine's: failing closed, and done tearing down
]


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """One transition, for `lifecycle_listeners`. `request` is None for the engine's own
    transitions and for a submission refused before it got an engine id; `reason` is the
    finish reason, or "queue_full" / "invalid" for rejected; `message` says why for
    rejected, dropped, poisoned and terminal. `time_s` is monotonic."""

    transition: Transition
    time_s: float
    request: Request | None = None
    client_id: str = ""
    reason: str = ""
    message: str = ""


class EngineDeadError(RuntimeError):
    """The engine is dead (its replica failed) or shut down: it takes no more requests."""


class NoWeightsError(RuntimeError):
    """A level-2 sleep discarded the weights and none loaded since: generating now would
    answer from garbage memory, so nothing is admitted (HTTP 503) until new ones load."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; try again later (HTTP 429)."""
