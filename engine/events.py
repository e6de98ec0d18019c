"""What a generate call's stream yields, the engine's errors, and its load snapshot.

Every choice of a request ends with exactly one terminal event: `FinishedEvent` or
`ErrorEvent`. Events are msgspec Structs so that monitors and the HTTP layer can encode them
as they are.
"""

from __future__ import annotations

from typing import Literal

import msgspec


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


class FinishedEvent(msgspec.Struct, frozen=True):
    """Choice `index` ended normally. `text` is any withheld text, flushed at the end."""

    index: int
    reason: Literal["stop", "length", "abort"]
    prompt_tokens: int
    output_tokens: int
    text: str


class ErrorEvent(msgspec.Struct, frozen=True):
    """Choice `index` ended by a failure (engine death, an impossible request)."""

    index: int
    message: str


Event = TokenEvent | FinishedEvent | ErrorEvent


class LoadSnapshot(msgspec.Struct, frozen=True):
    """The scheduler's view, taken once per tick (and a last, idle one when the engine dies).
    Schema version 1; monitors receive it msgspec-encoded."""

    running: int  # admitted requests (holding a slot)
    waiting: int  # submitted, not admitted
    free_slots: int
    free_blocks: int
    num_slots: int
    num_blocks: int
    steps_total: int
    is_dead: bool = False
    schema_version: int = 1


class EngineDeadError(RuntimeError):
    """The engine is dead (its replica failed) or shut down: it takes no more requests."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; try again later (HTTP 429)."""
