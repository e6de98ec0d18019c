"""Fault injection for tests: a `FaultPlan` handed to the ranks at spawn.

One rank (`rank`) misbehaves in one way (`kind`) at one command: the command with sequence
number `at_seq`, the `at_step`-th RunUnifiedStep or the `at_drop`-th DropRequests (1-based;
a preemption's drop, where nothing ended before it). A rank with a plan runs the
test harness (ipc/rank_harness.py: the serve loop with the faults attached from outside); it
checks each command (`fires`) and calls the helpers below when the plan fires.

Kinds:
- die_before_receipt: exit after the command arrives, before recording receipt in the gate.
- stall_before_receipt: sleep `stall_s` before recording receipt (the gate times out).
- die_after_release: exit once the gate releases the command, before running it.
- die_mid_step: exit inside the executor call (a module forward hook fires mid-forward).
- stall: sleep `stall_s` after release, past the step timeout.
- malformed_reply: send bytes that are not a Reply instead of the reply.
- duplicate_reply: send the reply twice.
- wrong_rank: reply claiming rank `rank + world_size`.
- wrong_variant: reply with a variant the command does not take.
- failure_reply: run the command, then reply `Failure` in its place (a rank-local error after
  the step's collectives, such as one in rank 0's sampling or in reading the samples back),
  then sleep `stall_s` and go on taking receipts as if it had not failed: the controller reads
  the Failure and then the last receipt of the next command, the order it meets when a peer's
  receipt comes last (overlapped, a rank may take the next receipt before its step fails).
- late_failure: run the command, then take the next command's receipt (if it comes), then
  reply `Failure`: the Failure frame still in transit while a shared-memory receipt is instant.
- bad_token: rank 0's step result with every sampled token id outside the vocabulary (-1).
- diverge: run the command, then drop the first item's request locally, so that this rank's
  state no longer matches the others' and a later command fails.
- close_reply_socket: run the command, close the reply socket instead of replying, then stall.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from deltaserve.ipc.messages import Ack, DropAck, Reply, StepResult, command_encoder

FaultKind = Literal[
    "die_before_receipt",
    "stall_before_receipt",
    "die_after_release",
    "die_mid_step",
    "stall",
    "malformed_reply",
    "duplicate_reply",
    "wrong_rank",
    "wrong_variant",
    "bad_token",
    "failure_reply",
    "late_failure",
    "diverge",
    "close_reply_socket",
]
FAULT_KINDS: tuple[str, ...] = FaultKind.__args__  # type: ignore[attr-defined]
FAULT_EXIT_CODE = 86  # a rank that dies on purpose exits with this code
MALFORMED_FRAME = b"\xc1 not msgpack"  # 0xc1 is never used by msgpack


class FaultPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which rank misbehaves, how, and at which command (exactly one of at_seq / at_step /
    at_drop)."""

    rank: int
    kind: FaultKind
    at_seq: int | None = None
    at_step: int | None = None
    stall_s: float = 600.0  # stall kinds: how long to sleep (the controller kills it first)
    at_drop: int | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"FaultPlan.rank must be >= 0, got {self.rank}")
        whens = [w for w in (self.at_seq, self.at_step, self.at_drop) if w is not None]
        if len(whens) != 1:
            raise ValueError("FaultPlan needs exactly one of at_seq, at_step and at_drop")
        if whens[0] < 1:
            raise ValueError(f"FaultPlan.at_seq/at_step/at_drop must be >= 1, got {whens[0]}")
        if self.stall_s <= 0:
            raise ValueError(f"FaultPlan.stall_s must be > 0, got {self.stall_s}")

    def fires(self, seq: int, step_index: int, drop_index: int = 0) -> bool:
        """True for the command this plan targets; `step_index` (`drop_index`) is the
        command's 1-based count among RunUnifiedSteps (DropRequests), 0 for another command."""
        if self.at_seq is not None:
            return seq == self.at_seq
        if self.at_drop is not None:
            return drop_index == self.at_drop
        return step_index == self.at_step


def die() -> None:
    os._exit(FAULT_EXIT_CODE)


def stall(seconds: float, parent_alive: Callable[[], bool]) -> None:
    """Sleep in short naps, leaving early (exit) if the parent is gone."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not parent_alive():
            os._exit(1)
        time.sleep(0.05)


def arm_die_mid_step(calls_before_death: int = 3) -> None:
    """Exit at the `calls_before_death`-th module forward of this process: inside the
    executor's forward, after the embedding (and its all-reduce) ran."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    count = 0

    def hook(module: object, args: object) -> None:
        nonlocal count
        count += 1
        if count >= calls_before_death:
            die()

    register_module_forward_pre_hook(hook)


def mangled_frames(kind: str, reply: Reply, world_size: int) -> list[bytes]:
    """The frames a reply-corrupting fault sends in place of `reply`."""
    encode = command_encoder.encode
    if kind == "malformed_reply":
        return [MALFORMED_FRAME]
    if kind == "duplicate_reply":
        return [encode(reply), encode(reply)]
    if kind == "wrong_rank":
        return [encode(msgspec.structs.replace(reply, rank=reply.rank + world_size))]
    if kind == "wrong_variant":
        wrong = (
            DropAck(reply.rank, reply.seq, [])
            if isinstance(reply, Ack)
            else Ack(reply.rank, reply.seq)
        )
        return [encode(wrong)]
    if kind == "bad_token" and isinstance(reply, StepResult):
        columns = msgspec.structs.replace(reply.samples, token_ids=[-1] * len(reply.samples))
        return [encode(msgspec.structs.replace(reply, samples=columns))]
    if kind == "bad_token":
        return [encode(reply)]
    raise ValueError(f"fault kind {kind!r} does not change replies")


REPLY_FAULTS = frozenset(
    {"malformed_reply", "duplicate_reply", "wrong_rank", "wrong_variant", "bad_token"}
)
RECEIPT_FAULTS = frozenset({"die_before_receipt", "stall_before_receipt"})


# Just a command's kind and seq (array-like structs ignore trailing fields): receipt faults
# must know which command arrived before the rank records its receipt, which precedes decoding.
# They target gated commands only.
class StepHeader(msgspec.Struct, frozen=True, array_like=True, tag="RunUnifiedStep"):
    seq: int


class DropHeader(msgspec.Struct, frozen=True, array_like=True, tag="DropRequests"):
    seq: int


header_decoder = msgspec.msgpack.Decoder(StepHeader | DropHeader)
