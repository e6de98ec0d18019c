"""The monitor wire schema, version 2: what an engine's ZeroMQ PUB endpoint publishes.

The source of docs/MONITOR.md (tests/test_monitor.py checks that the doc's field tables name
these fields, in this order). Imports only msgspec, so that a monitor process (tools/monitor.py)
loads neither torch nor the engine.

Framing: every message is a two-frame ZeroMQ multipart [topic, body]. The topic frame is
`b"load"`, `b"request"` or `b"replica"` (subscribe by prefix). The body is a msgpack *map*
keyed by field name (msgspec's default layout, not array_like), whose first key `kind` names
the message (a tagged union). Every body carries `schema_version`, `seq` and `time_s`.
Fields may be added within a version (decoders ignore keys they do not know); anything else
changes `schema_version`, which a decoder refuses when it does not know it. Version 2 added
the `preempted` message (a new kind: a version-1 decoder would refuse it).
"""

from __future__ import annotations

from typing import Literal

import msgspec

SCHEMA_VERSION = 2

EngineState = Literal["starting", "serving", "draining", "dead"]


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    schema_version: Literal[2] = SCHEMA_VERSION
    seq: int  # 0, 1, 2 ... per topic and publisher: a gap means this subscriber lost messages
    time_s: float  # wall clock (Unix seconds) at publication


# ---- topic "load" ----------------------------------------------------------------------


class Load(_Message, frozen=True, kw_only=True, tag="load"):
    """The scheduler's load snapshot, taken at the start of a tick: sent at once after a
    step or a change of `state`; an idle tick's only if a count changed, at most 10 a second
    (the newest held one is sent when the interval ends); the newest repeated, step_* 0,
    after a second without one. While `state` is "starting" every count is 0."""

    state: EngineState
    running: int  # requests holding a state slot
    waiting: int  # requests submitted, not yet admitted
    free_slots: int
    free_blocks: int
    num_slots: int
    num_blocks: int
    steps_total: int  # steps run since start
    step_prefill_tokens: int  # the step before this snapshot: prompt tokens it ran
    step_decode_tokens: int  # ... and decode tokens (one per decoding request); 0: no step
    step_duration_s: float  # ... and its time from dispatch to validated replies
    prompt_tokens_total: int  # prompt tokens prefilled since start
    generation_tokens_total: int  # tokens generated since start
    # speculative decoding (engine/speculation.py; all 0 without it): the step's drafts
    # verified, and vLLM's counters since start with acceptance per draft position
    step_draft_tokens: int = 0
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_position: list[int] = []


# ---- topic "request": one choice's life ------------------------------------------------
# queued -> admitted -> first_token -> finished, or queued -> finished (abort while waiting);
# admitted -> preempted -> admitted again (any number of times; first_token comes once);
# queued -> rejected; any of these -> dropped (the engine failed). Exactly one of finished,
# rejected, dropped ends every choice that was queued.


class Queued(_Message, frozen=True, kw_only=True, tag="queued"):
    """A choice entered the scheduler's waiting queue."""

    request_id: int  # the engine's id of this choice: unique, never reused
    client_id: str  # the caller's request id (shared by the n choices of one call)
    index: int  # which of the n choices
    prompt_tokens: int
    max_tokens: int


class Admitted(_Message, frozen=True, kw_only=True, tag="admitted"):
    """It holds a state slot and the KV blocks of its prompt (more as it decodes)."""

    request_id: int
    queue_s: float  # arrival to admission


class Preempted(_Message, frozen=True, kw_only=True, tag="preempted"):
    """It gave back its slot and blocks (others' decodes needed the blocks) and waits again,
    at the front; once admitted again it recomputes its prompt and output, and goes on."""

    request_id: int
    output_tokens: int  # tokens generated before it


class FirstToken(_Message, frozen=True, kw_only=True, tag="first_token"):
    request_id: int
    ttft_s: float  # arrival to the first sampled token


class Finished(_Message, frozen=True, kw_only=True, tag="finished"):
    """Its terminal event reached the caller (after its state was freed on every rank)."""

    request_id: int
    reason: Literal["stop", "length", "abort"]
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None  # None: no token was sampled (aborted early)
    e2e_s: float  # arrival to finish


class Rejected(_Message, frozen=True, kw_only=True, tag="rejected"):
    """Refused: at submission (`request_id` None; not queued) or at admission (it can never
    fit this engine)."""

    request_id: int | None
    client_id: str
    reason: Literal["queue_full", "invalid"]
    message: str


class Dropped(_Message, frozen=True, kw_only=True, tag="dropped"):
    """Ended by an engine failure, or by a bound of its own it went past while generating
    (structured outputs, a stop regex): the caller got an error."""

    request_id: int
    output_tokens: int
    e2e_s: float
    message: str


# ---- topic "replica": the engine's life ------------------------------------------------
# ready -> ... -> shut_down, or ready -> poisoned -> (load, state dead) -> terminal -> shut_down.
# shut_down is always the last message; a start that fails sends terminal, then shut_down.


class Ready(_Message, frozen=True, kw_only=True, tag="ready"):
    model: str  # the model directory
    tp_size: int
    device: str
    num_slots: int
    num_blocks: int
    block_size: int
    max_model_len: int
    startup_s: float


class Poisoned(_Message, frozen=True, kw_only=True, tag="poisoned"):
    """A fatal error: the engine fails closed (every open request is dropped)."""

    reason: str


class Terminal(_Message, frozen=True, kw_only=True, tag="terminal"):
    """The engine is dead for good and its rank processes are gone."""

    reason: str


class ShutDown(_Message, frozen=True, kw_only=True, tag="shut_down"):
    """The engine was shut down by its owner; the endpoint closes."""


MonitorMessage = (
    Load
    | Queued
    | Admitted
    | Preempted
    | FirstToken
    | Finished
    | Rejected
    | Dropped
    | Ready
    | Poisoned
    | Terminal
    | ShutDown
)

TOPICS: dict[type, bytes] = {
    Load: b"load",
    **{
        cls: b"request"
        for cls in (Queued, Admitted, Preempted, FirstToken, Finished, Rejected, Dropped)
    },
    **{cls: b"replica" for cls in (Ready, Poisoned, Terminal, ShutDown)},
}

encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MonitorMessage)


def decode(topic: bytes, body: bytes) -> MonitorMessage:
    """Decode one message strictly; msgspec.ValidationError (a ValueError) names what is
    wrong, including a topic frame that does not match the body's kind."""
    message = _decoder.decode(body)
    if TOPICS[type(message)] != topic:
        raise msgspec.ValidationError(
            f"topic {topic!r} does not carry {type(message).__name__} messages"
        )
    return message
