"""A rank process: `python -m deltaserve.ipc.rank_main`, its RankConfig on stdin.

Start-up: die with the parent, connect the channels, attach the gate, bind the device, join
the process group (gloo on CPU, NCCL on CUDA; file:// rendezvous in the private run dir),
build the Executor, send `Ready` (or `StartupFailed`).
Serve: receive a command, decode it strictly, check its seq; a gated command (step, drop) is
recorded in the gate and runs only once the controller's decision is EXECUTE; reply; repeat
until `Shutdown`. An error becomes a `Failure` reply; nothing here crashes on bad input.

Overlapped steps (`overlap_steps`, on CUDA): a step is queued on the device and left pending;
while it runs the rank waits for a pipelined follower, and if one comes it records the
follower's receipt, queues the follower's forward once released, and only then finishes the
pending step (reads its samples) and replies. So the device runs N+1 right behind N while
the host reads N's samples (vLLM's async scheduling and SGLang's overlap do the same).

Nothing here is for tests: a test's journal and fault plan attach from outside, in
ipc/rank_harness.py, which runs this loop in a subclass (`main(HarnessedRankServer)`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import zmq

from deltaserve.ipc.channels import PullChannel, PushChannel
from deltaserve.ipc.gate import CANCEL, EXECUTE, Doorbell, StartGate
from deltaserve.ipc.launch import RankConfig, rank_config_decoder
from deltaserve.ipc.messages import (
    DECODE_ERRORS,
    GATED_COMMANDS,
    Ack,
    Command,
    DropAck,
    DropRequests,
    Failure,
    LoadWeights,
    Ping,
    Ready,
    RunUnifiedStep,
    SampleColumns,
    Shutdown,
    Sleep,
    Snapshot,
    SnapshotReply,
    StartupFailed,
    StepResult,
    WakeUp,
    command_decoder,
    command_encoder,
)
from deltaserve.ipc.step_trace import StepTrace

if TYPE_CHECKING:  # torch is imported only once the rank builds its executor
    from deltaserve.engine.rank.executor import LaunchedStep

PR_SET_PDEATHSIG = 1
IDLE_POLL_MS = 500  # the serve loop re-checks its parent at least this often
REPLY_LINGER_MS = 2000  # how long a leaving rank tries to flush its last reply
GC_GEN0_THRESHOLD = 20_000  # allocations between young collections (CPython default 700)
# How long a finished pending step's reply may wait for the follower's release. It comes as
# soon as the slowest rank has queued the step and taken the follower's receipt (~0.1 ms on
# the H200; a few ms on a busy CPU, where rank 0 samples after the others), and that rank's
# reply is needed too, so the wait costs nothing while every rank is well; but a rank that
# never records its receipt must not hold the step's results hostage until the gate times out.
RELEASE_HOLD_S = 0.05

log = logging.getLogger("deltaserve.rank")


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that spawned it exits (LESSONS: vLLM 55510)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def warm_cuda_driver(device: str) -> threading.Thread | None:
    """Start the CUDA driver and the device's primary context in a thread while torch imports
    (~4 s on the H200 host). Done after the import, inside torch.cuda.init, it took 0.35 s;
    done ahead, torch's init then took 0.02 s. ctypes lets go of the GIL during the calls, and
    a failure here is left for torch's own init to report."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    ordinal = int(device.partition(":")[2] or 0)

    def start() -> None:
        dev, context = ctypes.c_int(), ctypes.c_void_p()
        if libcuda.cuInit(0) == 0 and libcuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0:
            libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), dev)

    thread = threading.Thread(target=start, name="cuda-driver", daemon=True)
    thread.start()
    return thread


def build_executor(config: RankConfig) -> object:
    if config.noop_executor:
        from deltaserve.ipc.noop_executor import NoopExecutor

        return NoopExecutor(config.executor, config.noop_step_s)
    started = time.monotonic()
    driver = warm_cuda_driver(config.device) if config.device.startswith("cuda") else None
    import torch
    import torch.distributed as dist

    if driver is not None:
        driver.join()
    if config.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(config.device))
        torch.cuda.init()  # the CUDA context, timed here rather than inside the model's build
        backend = "nccl"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp_size))
        backend = "gloo"
    if config.tp_size > 1:
        dist.init_process_group(
            backend,
            init_method=config.dist_init_method,
            rank=config.rank,
            world_size=config.tp_size,
            timeout=timedelta(seconds=config.dist_timeout_s),
        )
    log.info(
        "rank %d: torch on %s ready in %.1f s",
        config.rank,
        config.device,
        time.monotonic() - started,
    )
    from deltaserve.engine.rank.executor import Executor

    return Executor(config.executor)


@dataclass(slots=True)
class PendingStep:
    """A released step queued on the device whose reply is not yet sent."""

    seq: int
    step: LaunchedStep


class RankServer:
    """The serve loop of one rank; owns its executor, channels and gate view. Tests run a
    subclass (ipc/rank_harness.py) that journals gated commands and injects faults."""

    def __init__(
        self,
        config: RankConfig,
        executor: object,
        commands: PullChannel,
        replies: PushChannel,
        gate: StartGate,
    ) -> None:
        self.config = config
        self.rank = config.rank
        self.executor = executor
        self.commands = commands
        self.replies = replies
        self.gate = gate
        self.receipt_bell = Doorbell(config.receipt_fd)
        self.release_bell = Doorbell(config.release_fd)
        self.expected_seq = 1
        self.ahead: bytes | None = None  # the next frame, its receipt already in the gate
        self.overlap = config.overlap_steps
        self.pending: PendingStep | None = None  # at most one: see launch_step
        self.failed = False  # a Failure was sent: no more receipts (see receive)
        self.trace = StepTrace(f"rank{config.rank}")

    def parent_alive(self) -> bool:
        return os.getppid() == self.config.parent_pid

    def check_parent(self) -> None:
        if not self.parent_alive():
            os._exit(1)

    def send(self, reply: object) -> None:
        if type(reply) is Failure:
            self.failed = True
        self.replies.send(command_encoder.encode(reply))

    def serve(self) -> int:
        while True:
            frame, receipted, self.ahead = self.ahead, self.ahead is not None, None
            if frame is None and self.pending is not None:
                frame = self.follower()
                if frame is None:
                    self.complete_pending()
                    continue
                self.receive(frame)
                receipted = True
            if frame is None:
                frame = self.commands.recv(IDLE_POLL_MS)
            if frame is None:
                self.check_parent()
                continue
            if self.handle(frame, receipted):
                self.trace.write()
                return 0

    def receive(self, frame: bytes) -> None:
        """Put the receipt of the frame `expected_seq` names into the gate: its position in
        the stream (= its seq when nothing was lost) and its crc32, which the controller
        checks against what it sent. It goes in before the frame is decoded, so the
        controller's release overlaps the decode. None after this rank sent a Failure: the
        replica is lost, and the frame may still be on its way to the controller while a
        receipt is seen at once, so a receipt could have the gate release a later command."""
        if self.failed:
            return
        seq = self.expected_seq
        self.trace.mark(seq, "recv")
        self.gate.record_receipt(self.rank, seq, zlib.crc32(frame))
        self.receipt_bell.ring()

    def receive_ahead(self) -> None:
        """Before replying to a step that ran, the receipt of the next frame if it is already
        here (a pipelined follower): the controller then meets it with the reply, and
        releases the follower before it reacts to the step's results, not after. This rank
        has marked the step done, so a receipt still implies the step ahead ended here. Not
        after a failed step: its reply goes first, as the controller must see it to cancel."""
        frame = self.commands.recv_nowait()
        if frame is not None:
            self.receive(frame)
            self.ahead = frame

    def pending_ready(self) -> bool:
        """Whether the device is done with the pending step. A device error counts as done:
        `finish_step` then raises it, and it goes to the controller as the step's Failure
        (rather than ending this loop, and the rank, without a word)."""
        try:
            return self.pending.step.ready()
        except Exception:
            return True

    def follower(self) -> bytes | None:
        """While the pending step runs on the device, the next frame if it comes by then (a
        pipelined follower, sent once the controller saw the step released); None once the
        step is done without one. Polls: a sleep would let the device run dry."""
        while True:
            frame = self.commands.recv_nowait()
            if frame is not None:
                return frame
            if self.pending_ready():
                return self.commands.recv_nowait()
            self.check_parent()

    def await_release_while_pending(self, seq: int) -> None:
        """Wait for the gate's word on `seq` while the pending step runs (polling: the device
        is busy), then at most RELEASE_HOLD_S more (asleep); past that, finish the pending step
        and reply to it before waiting on."""
        hold_until = None
        while not self.gate.decision(seq):
            if self.pending_ready():
                hold_until = hold_until or time.monotonic() + RELEASE_HOLD_S
                left = hold_until - time.monotonic()
                if left <= 0:
                    self.complete_pending()
                    return
                self.release_bell.wait(left)
            self.check_parent()

    def launch_step(self, command: RunUnifiedStep) -> None:
        """Queue a released step on the device and leave it pending. The step pending before
        it is finished and replied to in between: after this one's forward is queued (so the
        device has work while the host reads samples) and before its sampling (whose seeds
        and penalties count that step's samples)."""
        try:
            step = self.executor.launch_step(
                command.items, command.drops, command.evict, command.saves
            )
            self.complete_pending()
            self.executor.launch_sampling(step)
        except Exception as exc:  # a rank-local mismatch (nothing queued) or a device error
            self.complete_pending()  # if it was not yet: the step ahead's reply goes first
            self.reply_step(command.seq, self.failure(command.seq, exc), len(command.items))
            return
        self.pending = PendingStep(command.seq, step)

    def complete_pending(self) -> None:
        """Finish the pending step, if any: wait for its samples and send its reply."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            reply = self.step_reply(pending.seq, pending.step)
        except Exception as exc:
            reply = self.failure(pending.seq, exc)
        self.reply_step(pending.seq, reply, len(pending.step.items))

    def failure(self, seq: int, exc: Exception) -> Failure:
        return Failure(self.rank, seq, f"{type(exc).__name__}: {exc}")

    def reply_step(self, seq: int, reply: object, num_items: int) -> None:
        self.gate.mark_done(self.rank, seq)
        self.trace.mark(seq, "executed", num_items)
        self.send(reply)
        self.trace.mark(seq, "replied")

    def step_reply(self, seq: int, step: LaunchedStep) -> Ack | StepResult:
        """Wait for a launched step's samples (rank 0) and make its reply."""
        samples = self.executor.finish_step(step)
        if self.rank != 0:
            return Ack(self.rank, seq)
        columns = SampleColumns.from_samples(
            samples, step.prompt_logprobs, step.failed, step.speculative
        )
        return StepResult(self.rank, seq, columns)

    def handle(self, frame: bytes, receipted: bool = False) -> bool:
        """Carry out one command frame (its receipt in the gate if `receipted`); True when
        the rank should exit."""
        if not receipted:
            self.receive(frame)
        seq = self.expected_seq
        self.expected_seq = seq + 1
        command = self.decode(frame, seq)
        if command is None:
            return False
        gated = isinstance(command, GATED_COMMANDS)
        if gated and not self.released(command):
            return False
        if self.overlaps(command):
            self.launch_step(command)
            return False
        self.complete_pending()
        try:
            reply = self.execute(command)
        except Exception as exc:  # a rank-local mismatch or a device/collective error
            reply = self.failure(seq, exc)
        is_step = type(command) is RunUnifiedStep
        if gated:
            self.gate.mark_done(self.rank, seq)
        self.trace.mark(seq, "executed", len(command.items) if is_step else 0)
        if is_step and type(reply) is not Failure:
            self.receive_ahead()
        self.send(reply)
        self.trace.mark(seq, "replied")
        return type(command) is Shutdown

    def decode(self, frame: bytes, seq: int) -> Command | None:
        """The command in `frame`, which must carry `seq`; else None, the Failure sent (the
        step pending ahead replied to first)."""
        try:
            command = command_decoder.decode(frame)
        except DECODE_ERRORS as exc:
            self.complete_pending()
            self.send(
                Failure(self.rank, seq, f"malformed command frame ({len(frame)} bytes): {exc}")
            )
            return None
        if command.seq != seq:
            self.complete_pending()
            name = type(command).__name__
            expected = f"expected seq {seq}"
            self.send(
                Failure(
                    self.rank, command.seq, f"{name} seq {command.seq} out of order; {expected}"
                )
            )
            return None
        return command

    def released(self, command: Command) -> bool:
        """Wait for the gate's decision on a gated command; True to run it. Otherwise the
        step pending ahead is replied to and the command withdrawn."""
        seq = command.seq
        if self.pending is not None:
            self.await_release_while_pending(seq)
        decision = self.gate.wait_decision(
            seq, self.release_bell, self.config.release_timeout_s, self.check_parent
        )
        if decision == EXECUTE:
            self.trace.mark(seq, "released")
            return True
        self.complete_pending()
        self.withdraw(command, decision)
        return False

    def withdraw(self, command: Command, decision: int) -> None:
        """A gated command the gate did not release: done here; a Failure too when the gate
        never decided it (CANCEL is the controller's own word)."""
        self.gate.mark_done(self.rank, command.seq)
        if decision != CANCEL:
            name = type(command).__name__
            self.send(
                Failure(self.rank, command.seq, f"gate never decided {name} seq {command.seq}")
            )

    def overlaps(self, command: Command) -> bool:
        """Whether `command` is a step to leave pending on the device (`overlap_steps`)."""
        return self.overlap and type(command) is RunUnifiedStep

    def execute(self, command: Command) -> object:
        rank, seq = self.rank, command.seq
        kind = type(command)
        if kind is RunUnifiedStep:
            step = self.executor.launch_step(
                command.items, command.drops, command.evict, command.saves
            )
            self.executor.launch_sampling(step)
            return self.step_reply(seq, step)
        if kind is DropRequests:
            return DropAck(
                rank, seq, self.executor.drop(command.request_ids, command.evict, command.saves)
            )
        if kind is Snapshot:
            s = self.executor.snapshot()
            return SnapshotReply(
                rank,
                seq,
                list(s.request_ids),
                s.slots_used,
                s.blocks_used,
                s.num_slots,
                s.num_blocks,
                s.state_heads,
                s.kv_heads,
            )
        if kind is LoadWeights:
            self.executor.load_weights(command.model_dir)
        elif kind is Sleep:
            self.executor.sleep(command.level)
        elif kind is WakeUp:
            self.executor.wake_up(command.tags)
        if kind in (LoadWeights, Sleep, WakeUp, Ping, Shutdown):
            return Ack(rank, seq)
        raise TypeError(f"no handler for {kind.__name__}")


def main(server: type[RankServer] = RankServer) -> int:
    """Run a rank: start up, then `server`'s loop until Shutdown (tests pass a harness)."""
    config = rank_config_decoder.decode(sys.stdin.buffer.read())
    die_with_parent(config.parent_pid)
    # The controller decides when ranks stop (a shutdown command, else SIGKILL by pidfd). A ^C,
    # or a SIGTERM sent to the whole process group (systemd's default stop, `timeout`,
    # `kill -TERM -PGID`), is the server's to handle: it drains first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # deltaserve's own lines (the memory budget) at the server's level on stderr, other
    # libraries' warnings
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("deltaserve").setLevel(config.log_level)
    # its time stamp against the server's marks the spawn
    log.info("rank %d: process up", config.rank)
    ctx = zmq.Context(io_threads=1)
    replies = PushChannel(ctx, config.reply_endpoint, bind=False, linger_ms=REPLY_LINGER_MS)
    try:
        commands = PullChannel(ctx, config.command_endpoint, bind=False)
        gate = StartGate.attach(config.gate_name, config.tp_size)
        executor = build_executor(config)
    except Exception as exc:
        replies.send(
            command_encoder.encode(StartupFailed(config.rank, f"{type(exc).__name__}: {exc}"))
        )
        replies.close()
        ctx.term()
        return 1
    # Start-up objects (torch, the model) never die: keep them out of every collection, and
    # let the short-lived objects of a step die by refcount before a collection looks.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)
    executor.watch_late_compiles()
    replies.send(
        command_encoder.encode(
            Ready(config.rank, executor.num_slots, executor.num_blocks, executor.block_size)
        )
    )
    code = server(config, executor, commands, replies, gate).serve()
    commands.close()
    replies.close()  # lingers until the Shutdown ack is out
    ctx.term()
    os._exit(code)  # skip interpreter teardown: torch and process-group destructors can block


if __name__ == "__main__":
    sys.exit(main())
