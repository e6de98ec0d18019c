"""A rank under test: `python -m deltaserve.ipc.rank_harness`, started instead of rank_main
when its RankConfig carries a `fault` plan or a `journal_path` (ipc/launch.py decides).

`HarnessedRankServer` is the production serve loop (ipc/rank_main.py) with the test's
instruments around it, attached by overriding the loop's own steps (receive, decode,
released, withdraw, overlaps, send), so that the production loop has no test branches:
- the journal: an append-only log of gated commands (`recv`, `exec`, `reply`, `cancel`,
  `timeout`, `die` lines of `event seq name`), how a fault test sees that a surviving rank
  never ran a step;
- the fault plan (ipc/faults.py): this rank misbehaves once, at the command the plan names.
  Before a receipt: it dies or stalls. After the gate's release: it dies, stalls or arms a
  death inside the forward. At the reply: it mangles it, fails, or drifts from its peers.
  The targeted step runs to its end (not left pending), and this rank takes no receipt ahead
  of its reply; under a receipt fault it takes none ahead of any reply, so it meets each
  frame as it would one at a time.
"""

from __future__ import annotations

import os
import sys

from deltaserve.ipc import faults
from deltaserve.ipc.gate import CANCEL
from deltaserve.ipc.messages import (
    DECODE_ERRORS,
    Command,
    DropRequests,
    Failure,
    RunUnifiedStep,
    command_encoder,
)
from deltaserve.ipc.rank_main import IDLE_POLL_MS, RankServer, main


class HarnessedRankServer(RankServer):
    """RankServer with a journal of gated commands and this rank's fault plan, if any."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        plan = self.config.fault
        self.fault = plan if plan is not None and plan.rank == self.rank else None
        self.journal_fd = -1
        if self.config.journal_path:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            self.journal_fd = os.open(self.config.journal_path, flags, 0o600)
        self.num_steps = 0  # RunUnifiedSteps decoded so far (FaultPlan.at_step counts them)
        self.num_drops = 0  # DropRequests decoded so far (FaultPlan.at_drop counts them)
        self.armed: Command | None = None  # the command the plan fires on, until its reply
        self.unreplied: dict[int, str] = {}  # released gated commands by seq: their names
        self.receipt_fault = self.fault is not None and self.fault.kind in faults.RECEIPT_FAULTS

    def journal(self, event: str, seq: int, name: str) -> None:
        if self.journal_fd >= 0:
            os.write(self.journal_fd, f"{event} {seq} {name}\n".encode())

    # ---- receipts ------------------------------------------------------------------------

    def receive(self, frame: bytes) -> None:
        if not self.failed and self.receipt_fault:
            self.strike_before_receipt(frame)
        super().receive(frame)

    def receive_ahead(self) -> None:
        if not self.receipt_fault and self.armed is None:
            super().receive_ahead()

    def follower(self) -> bytes | None:
        return None if self.receipt_fault else super().follower()

    def strike_before_receipt(self, frame: bytes) -> None:
        """Receipt faults need the command's kind and seq before the frame is decoded."""
        try:
            header = faults.header_decoder.decode(frame)
        except DECODE_ERRORS:
            return
        is_step = type(header) is faults.StepHeader
        is_drop = type(header) is faults.DropHeader
        if not self.fault.fires(
            header.seq, self.num_steps + 1 if is_step else 0, self.num_drops + 1 if is_drop else 0
        ):
            return
        if self.fault.kind == "die_before_receipt":
            self.journal("die", header.seq, type(header).__name__)
            faults.die()
        if self.fault.kind == "stall_before_receipt":
            faults.stall(self.fault.stall_s, self.parent_alive)

    # ---- the command's way through the loop ----------------------------------------------

    def decode(self, frame: bytes, seq: int) -> Command | None:
        command = super().decode(frame, seq)
        if command is None:
            return None
        is_step = type(command) is RunUnifiedStep
        is_drop = type(command) is DropRequests
        self.num_steps += is_step
        self.num_drops += is_drop
        if self.fault is not None and self.fault.fires(
            seq, self.num_steps if is_step else 0, self.num_drops if is_drop else 0
        ):
            self.armed = command
        return command

    def released(self, command: Command) -> bool:
        name = type(command).__name__
        self.journal("recv", command.seq, name)
        if not super().released(command):
            return False
        if command is self.armed:
            self.strike_after_release()
        self.journal("exec", command.seq, name)
        self.unreplied[command.seq] = name
        return True

    def withdraw(self, command: Command, decision: int) -> None:
        if command is self.armed:
            self.armed = None
        event = "cancel" if decision == CANCEL else "timeout"
        self.journal(event, command.seq, type(command).__name__)
        super().withdraw(command, decision)

    def overlaps(self, command: Command) -> bool:
        return command is not self.armed and super().overlaps(command)

    def send(self, reply: object) -> None:
        name = self.unreplied.pop(reply.seq, None)
        armed = self.armed
        if armed is not None and reply.seq == armed.seq:
            self.armed = None
            self.strike_at_reply(armed, reply)
            return
        if name is not None:
            self.journal("reply", reply.seq, name)
        super().send(reply)

    # ---- the faults ----------------------------------------------------------------------

    def strike_after_release(self) -> None:
        kind = self.fault.kind
        if kind == "die_after_release":
            faults.die()
        elif kind == "stall":
            faults.stall(self.fault.stall_s, self.parent_alive)
        elif kind == "die_mid_step":
            faults.arm_die_mid_step()

    def strike_at_reply(self, command: Command, reply: object) -> None:
        """Send what the plan sends in place of `command`'s `reply`."""
        kind = self.fault.kind
        if kind in faults.REPLY_FAULTS:
            for frame in faults.mangled_frames(kind, reply, self.config.tp_size):
                self.replies.send(frame)
            return
        if kind == "close_reply_socket":
            self.replies.close()
            faults.stall(self.fault.stall_s, self.parent_alive)
            os._exit(1)
        if kind == "die_mid_step":
            faults.die()  # the executor ran no module (no-op executor): die now
        if kind == "failure_reply":  # sent raw: this rank is not marked failed
            failure = Failure(self.rank, command.seq, "injected failure")
            self.replies.send(command_encoder.encode(failure))
            faults.stall(self.fault.stall_s, self.parent_alive)
            return
        if kind == "late_failure":
            failure = Failure(self.rank, command.seq, "injected failure, delivered late")
            self.failed = True  # decided: the frame is what comes late
            frame = self.commands.recv(IDLE_POLL_MS)
            if frame is not None:
                self.receive(frame)
                self.ahead = frame
            self.send(failure)
            return
        if kind == "diverge" and type(command) is RunUnifiedStep:
            self.executor.drop([command.items[0].request_id])
        self.send(reply)


if __name__ == "__main__":
    sys.exit(main(HarnessedRankServer))
