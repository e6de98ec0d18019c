"""The replica controller: the event loop's handle on one replica's rank processes.

It spawns the ranks, sends each command (same bytes to every rank), runs the start gate for
state-changing commands, collects exactly one reply per rank and validates the set
(ipc/validate.py). Anything fatal poisons the replica: the first reason is kept, every later
call raises ReplicaPoisoned at once, `on_poison` is called once, and the ranks are killed
from here (never from inside a collective). Nothing here blocks the event loop: replies,
gate receipts and rank deaths (pidfds) all arrive as loop callbacks.

Commands go one at a time, except that a step may follow a released step (`follow_step`;
ipc/flights.py has the rule); the follower's gate timer starts when the flight ahead ends.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import weakref
import zlib
from collections.abc import Callable
from typing import Literal

import msgspec
import zmq

from deltaserve.engine.model_config import ModelConfig
from deltaserve.ipc.channels import PullChannel, PushChannel, ipc_endpoint
from deltaserve.ipc.flights import Flight, Flights
from deltaserve.ipc.gate import CANCEL, EXECUTE, Doorbell, StartGate
from deltaserve.ipc.launch import (
    await_exits,
    describe_exit,
    emergency_cleanup,
    free_replica,
    kill_all,
    spawn_rank,
)
from deltaserve.ipc.messages import (
    DECODE_ERRORS,
    GATED_COMMANDS,
    Command,
    DropRequests,
    Failure,
    LoadWeights,
    Ping,
    Ready,
    RunUnifiedStep,
    SampleColumns,
    SaveOnDrop,
    Shutdown,
    Sleep,
    Snapshot,
    SnapshotReply,
    StartupFailed,
    StepItem,
    WakeUp,
    command_encoder,
    reply_decoder,
    startup_decoder,
)
from deltaserve.ipc.replica_config import ReplicaConfig, ReplicaPoisoned, ReplicaStartupError
from deltaserve.ipc.step_trace import StepTrace
from deltaserve.ipc.validate import (
    PlanRejected,
    ReplyError,
    ReplySet,
    StepPlan,
    check_drop_plan,
    check_plan,
)

__all__ = [
    "PlanRejected",
    "ReplicaConfig",
    "ReplicaController",
    "ReplicaPoisoned",
    "ReplicaStartupError",
]

CANCEL_GRACE_S = 1.0  # after a Cancel, how long ranks that got the command may take to ack it
# A rank's Failure is often a peer's death seen through a collective ("connection reset by
# peer") before that peer's exit is visible; hold a Failure back this long so that the death,
# if there is one, is the reason the replica is poisoned with.
FAILURE_HOLD_S = 0.25
EXIT_WAIT_S = 5.0  # how long to wait for killed (or shut down) ranks to be reaped
SHUTDOWN_ACK_S = 10.0  # how long a graceful shutdown waits for every rank's ack


class ReplicaController:
    """Use `await ReplicaController.start(config)`; see the module docstring."""

    def __init__(
        self,
        config: ReplicaConfig,
        model_config: ModelConfig,
        devices: list[str],
        on_poison: Callable[[str], None] | None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tp_size = config.tp_size
        self.num_slots = self.num_blocks = self.block_size = 0
        self._devices = devices
        self._on_poison = on_poison
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()  # held from a command's send until no flight is left
        self._callers_waiting = 0  # commands waiting for the lock: no step may cut in line
        self._seq = 0
        self.trace = StepTrace("controller")
        self._flights = Flights()
        self._held_failure: str | None = None
        self._poison_reason: str | None = None
        self._starting = True
        self._ready: list[Ready | None] = [None] * config.tp_size
        self._startup: asyncio.Future = self._loop.create_future()
        self._stopping = False
        self._closed = False
        self._teardown_task: asyncio.Task | None = None
        self._shutdown_task: asyncio.Task | None = None
        self._procs: list = []
        self._pidfds: list[int] = []
        self._run_dir = tempfile.mkdtemp(prefix="deltaserve-")  # 0700, unique per replica
        try:
            self._gate = StartGate.create(config.tp_size)
        except BaseException:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            raise
        self._receipt_bell = Doorbell()
        self._release_bells = [Doorbell() for _ in range(config.tp_size)]
        self._ctx, sockets = zmq.Context(io_threads=1), []
        self._held = (
            self._gate,
            self._run_dir,
            self._ctx,
            sockets,
            self._pidfds,
            [self._receipt_bell, *self._release_bells],
        )  # free_replica's arguments
        # if the owner never shuts down: kill the ranks, free all (ipc/launch.py says why here)
        self._finalizer = weakref.finalize(self, emergency_cleanup, self._procs, *self._held)
        try:
            self._replies = PullChannel(self._ctx, ipc_endpoint(self._run_dir, "reply"), bind=True)
            self._commands = [
                PushChannel(self._ctx, ipc_endpoint(self._run_dir, f"cmd{r}"), bind=True)
                for r in range(config.tp_size)
            ]
        except BaseException:
            self._finalizer()  # the sockets made are still alive: ctx.destroy closes them
            raise
        sockets += [self._replies.socket, *(channel.socket for channel in self._commands)]

    # ---- public API -------------------------------------------------------------------

    @classmethod
    async def start(
        cls, config: ReplicaConfig, on_poison: Callable[[str], None] | None = None
    ) -> ReplicaController:
        """Check the config against the model and machine, spawn the ranks, wait for all of
        them to be Ready. On any failure everything started is torn down and this raises."""
        model_config = ModelConfig.from_model_dir(config.executor.model)
        model_config.check_tp_size(config.tp_size)
        devices = config.rank_devices()
        self = cls(config, model_config, devices, on_poison)
        try:
            await self._launch()
        except BaseException as exc:
            if self._poison_reason is None:
                self._poison(f"start-up interrupted: {exc!r}")
            await self._await_teardown()
            if isinstance(exc, ReplicaPoisoned):
                raise ReplicaStartupError(
                    f"replica failed to start: {self._poison_reason}"
                ) from None
            raise
        return self

    @property
    def poison_reason(self) -> str | None:
        return self._poison_reason

    @property
    def last_seq(self) -> int:
        """Sequence number of the last command sent (rejected plans send nothing)."""
        return self._seq

    @property
    def rank_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    @property
    def exit_codes(self) -> list[int | None]:
        return [proc.returncode for proc in self._procs]

    @property
    def run_dir(self) -> str:
        return self._run_dir

    @property
    def gate_name(self) -> str:
        return self._gate.name

    async def run_step(self, items: list[StepItem]) -> SampleColumns:
        """Run one unified step on every rank; rank 0's samples, matched by request id and
        returned in step order (row i: the i-th item with `sample` set)."""
        return await self.step_result(await self.send_step(items))

    async def send_step(
        self,
        items: list[StepItem],
        drops: list[int] = (),
        evict: list[int] = (),
        saves: list[SaveOnDrop] = (),
    ) -> Flight:
        """Send one unified step once no other command is in flight, and return without
        waiting for it: await `flight.gate` (released?) and `step_result(flight)`."""
        self._check_open()
        plan = self._check_plan(items, drops, saves)
        await self._acquire()
        return self._begin(
            RunUnifiedStep(self._seq + 1, items, list(drops), list(evict), list(saves)), plan
        )

    def _check_plan(
        self, items: list[StepItem], drops: list[int], saves: list[SaveOnDrop]
    ) -> StepPlan:
        """`check_plan` within this replica's vocabulary and bounds."""
        return check_plan(
            items,
            self.model_config.vocab_size,
            drops,
            self.config.max_logprobs,
            saves,
            self.config.executor.num_speculative_tokens,
        )

    @property
    def can_follow(self) -> bool:
        """`follow_step` would send now: the one command in flight is a step the gate has
        released, and no other command waits its turn."""
        return not self._callers_waiting and self._flights.can_follow()

    def follow_step(
        self,
        items: list[StepItem],
        drops: list[int] = (),
        evict: list[int] = (),
        saves: list[SaveOnDrop] = (),
    ) -> Flight | None:
        """Send a step behind the one step in flight, which the gate has already released:
        the ranks take it up as soon as they finish that one, so the engine's work between
        steps overlaps the device's. Returns None, having sent nothing, unless `can_follow`.
        Its items may leave `token_ids` empty: the ranks then use the token they sample in
        the step in flight."""
        self._check_open()
        plan = self._check_plan(items, drops, saves)
        if not self.can_follow:
            return None
        return self._begin(
            RunUnifiedStep(self._seq + 1, items, list(drops), list(evict), list(saves)), plan
        )

    async def step_result(self, flight: Flight) -> SampleColumns:
        """The samples of a step sent with `send_step` or `follow_step`."""
        return await self._finish(flight)

    async def drop(
        self,
        request_ids: list[int],
        expect: Literal["must_exist", "must_be_absent"],
        evict: list[int] = (),
        saves: list[SaveOnDrop] = (),
    ) -> None:
        self._check_open()
        check_drop_plan(request_ids, expect, saves)
        if request_ids or evict:
            await self._call(
                lambda seq: DropRequests(seq, list(request_ids), expect, list(evict), list(saves))
            )

    async def maintain(self, command: LoadWeights | Sleep | WakeUp) -> None:
        """A command of the engine's maintenance (engine/maintenance.py), `seq` set here."""
        self._check_open()
        await self._call(lambda seq: msgspec.structs.replace(command, seq=seq))

    async def snapshot(self) -> list[SnapshotReply]:
        self._check_open()
        return await self._call(Snapshot)

    async def ping(self) -> None:
        self._check_open()
        await self._call(Ping)

    async def shutdown(self) -> None:
        """Stop the ranks (gracefully if healthy), free everything; idempotent."""
        if self._shutdown_task is None:
            self._shutdown_task = self._loop.create_task(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    # ---- start-up ------------------------------------------------------------------------

    async def _launch(self) -> None:
        config, loop = self.config, self._loop
        self._replies.watch(loop, self._on_frame)
        loop.add_reader(self._receipt_bell.fd, self._on_receipt_bell)
        deadline = loop.time() + config.startup_timeout_s
        timer = loop.call_at(deadline, self._on_startup_timeout)
        try:
            for rank in range(self.tp_size):
                self._spawn(rank)
            await self._startup
            self._check_capacity()
            await self._call(Ping, patient_until=deadline)  # every command pipe is up
        finally:
            timer.cancel()
        self._starting = False

    def _spawn(self, rank: int) -> None:
        proc = spawn_rank(
            self.config.rank_config(
                rank,
                self._devices[rank],
                self._run_dir,
                command_endpoint=self._commands[rank].endpoint,
                reply_endpoint=self._replies.endpoint,
                gate_name=self._gate.name,
                receipt_fd=self._receipt_bell.fd,
                release_fd=self._release_bells[rank].fd,
            )
        )
        self._procs.append(proc)
        pidfd = os.pidfd_open(proc.pid)
        self._pidfds.append(pidfd)
        self._loop.add_reader(pidfd, self._on_rank_exit, rank)

    def _on_startup_frame(self, frame: bytes) -> None:
        try:
            msg = startup_decoder.decode(frame)
        except DECODE_ERRORS as exc:
            self._poison(f"malformed start-up frame ({len(frame)} bytes): {exc}")
            return
        if not 0 <= msg.rank < self.tp_size or self._ready[msg.rank] is not None:
            self._poison(f"start-up message {msg!r} from an unknown or repeated rank")
        elif type(msg) is StartupFailed:
            self._poison(f"rank {msg.rank} failed to start: {msg.reason}", confirm_deaths=False)
        else:
            self._ready[msg.rank] = msg
            if all(ready is not None for ready in self._ready):
                self._startup.set_result(None)

    def _check_capacity(self) -> None:
        first = self._ready[0]
        capacity = (first.num_slots, first.num_blocks, first.block_size)
        for ready in self._ready:
            if (ready.num_slots, ready.num_blocks, ready.block_size) != capacity:
                raise self._fail(
                    f"ranks disagree on capacity: rank 0 has {first}, rank {ready.rank} has {ready}"
                )
        self.num_slots, self.num_blocks, self.block_size = capacity

    def _on_startup_timeout(self) -> None:
        if self._starting:
            waiting = [r for r, ready in enumerate(self._ready) if ready is None]
            self._poison(
                f"rank(s) {waiting or 'all'} not ready within startup_timeout_s="
                f"{self.config.startup_timeout_s}"
            )

    # ---- one command ---------------------------------------------------------------------

    def _check_open(self, stopping_ok: bool = False) -> None:
        if self._poison_reason is not None:
            raise ReplicaPoisoned(self._poison_reason)
        if (self._stopping and not stopping_ok) or self._closed:
            raise ReplicaPoisoned("replica is shut down")

    async def _call(
        self,
        make: Callable[[int], Command],
        plan: StepPlan | None = None,
        patient_until: float | None = None,
        stopping_ok: bool = False,
    ) -> object:
        """Send one command, wait for (and validate) every rank's reply. One at a time; a
        caller that is cancelled leaves the command to finish (or time out) on its own."""
        await self._acquire(stopping_ok)
        flight = self._begin(make(self._seq + 1), plan, patient=patient_until is not None)
        unsent = flight.unsent
        if (
            patient_until is not None and unsent
        ):  # start-up: a rank's socket may still be connecting
            while unsent and self._loop.time() < patient_until and not flight.future.done():
                await asyncio.sleep(0.002)
                unsent = [rank for rank in unsent if not self._commands[rank].send(flight.frame)]
            if unsent:
                self._poison_unsent(flight, unsent)
        return await self._finish(flight)

    async def _acquire(self, stopping_ok: bool = False) -> None:
        self._callers_waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._callers_waiting -= 1
        try:
            self._check_open(stopping_ok)
        except BaseException:
            self._lock.release()
            raise

    def _begin(self, command: Command, plan: StepPlan | None, patient: bool = False) -> Flight:
        """Send `command` to every rank as a new flight (the lock is held). Ranks whose
        channel refuses the frame are left in `flight.unsent` if `patient`, else poison."""
        try:
            frame = command_encoder.encode(command)
        except BaseException:
            if not self._flights:
                self._lock.release()
            raise
        self._seq = command.seq
        self.trace.mark(command.seq, "call")
        gated = isinstance(command, GATED_COMMANDS)
        flight = Flight(
            ReplySet(command, self.tp_size, plan),
            self._loop.create_future(),
            self._loop.create_future(),
            gated,
            frame,
        )
        if gated:
            flight.digest = zlib.crc32(frame)
        else:
            flight.released = True
            flight.gate.set_result(True)
        self._flights.add(flight)
        flight.future.add_done_callback(self._end_flight)
        if len(self._flights) == 1:  # a follower's timer starts when the flight ahead ends
            self._start_timer(flight)
        flight.unsent = [
            rank for rank, channel in enumerate(self._commands) if not channel.send(frame)
        ]
        if flight.unsent and not patient:
            self._poison_unsent(flight, flight.unsent)
        self.trace.mark(command.seq, "sent")
        return flight

    def _poison_unsent(self, flight: Flight, unsent: list[int]) -> None:
        self._poison(
            f"could not deliver {flight.replies.name} seq {flight.seq} to rank {unsent[0]}: "
            f"its command channel has no live peer"
        )

    def _start_timer(self, flight: Flight) -> None:
        """Bound the wait for the gate (a gated command not yet released), else the reply."""
        if flight.gated and not flight.released:
            timeout = self._gate_timeout_s
        else:
            timeout = self.config.step_timeout_s
        if flight.timer is not None:
            flight.timer.cancel()
        flight.timer = self._loop.call_later(timeout, self._on_flight_timeout, flight)

    async def _finish(self, flight: Flight) -> object:
        """The flight's result; on poison, raise at once: the caller (the scheduler failing
        closed) tells every owner first, then awaits the teardown through `shutdown`."""
        try:
            return await asyncio.shield(flight.future)
        except ReplicaPoisoned:
            raise ReplicaPoisoned(self._poison_reason or "replica is shut down") from None

    def _end_flight(self, future: asyncio.Future) -> None:
        was_oldest = self._flights.end(future)
        if was_oldest is None:
            return
        if not self._flights:
            self._lock.release()
        elif was_oldest and not future.cancelled() and future.exception() is None:
            self._start_timer(self._flights.oldest)  # the follower's turn

    def _on_receipt_bell(self) -> None:
        self._receipt_bell.drain()
        flight = self._flights.newest  # only the newest flight can be waiting for the gate
        if flight is None or not flight.gated or flight.released or flight.future.done():
            return
        if self._held_failure is not None:  # a rank failed: no step after it; the poison cancels
            return
        seq = flight.replies.seq
        for rank in range(self.tp_size):
            receipt = self._gate.receipt(rank)
            if receipt is None or receipt[0] != seq:
                return
            if receipt[1] != flight.digest:
                self._poison(
                    f"rank {rank} received different bytes for {flight.replies.name} seq {seq} "
                    f"(crc32 {receipt[1]:#010x}, sent {flight.digest:#010x})"
                )
                return
        self._gate.decide(seq, EXECUTE)
        for bell in self._release_bells:
            bell.ring()
        flight.released = True
        flight.gate.set_result(True)
        if len(self._flights) == 1:  # else: timed when the one ahead ends (_end_flight)
            self._start_timer(flight)

    def _on_frame(self, frame: bytes) -> None:
        if self._poison_reason is not None or self._closed:
            return
        try:
            if not self._startup.done():
                self._on_startup_frame(frame)
                return
            try:
                reply = reply_decoder.decode(frame)
            except DECODE_ERRORS as exc:
                self._poison(f"malformed reply frame ({len(frame)} bytes): {exc}")
                return
            flight = self._flights.by_seq(reply.seq)
            if type(reply) is Failure:
                what = f"seq {reply.seq}"
                if flight is not None:
                    what = f"{flight.replies.name} {what}"
                self._hold_failure(f"rank {reply.rank} failed {what}: {reply.reason}")
                return
            if flight is None:
                self._poison(self._flights.stray_reason(reply, self.tp_size))
                return
            if flight.gated and not flight.released:
                self._poison(
                    f"rank {reply.rank} replied to {flight.replies.name} seq {reply.seq} "
                    f"before the gate released it"
                )
                return
            if flight.replies.add(reply) and not flight.future.done():
                self.trace.mark(reply.seq, "replies")
                flight.future.set_result(flight.replies.result())
        except ReplyError as exc:
            self._poison(str(exc))
        except Exception as exc:  # never let a reader callback die
            self._poison(f"controller error on a reply frame: {exc!r}")

    def _hold_failure(self, reason: str) -> None:
        """Poison with a rank's Failure after FAILURE_HOLD_S, unless something (a rank's
        death) poisons first; later Failures add nothing. Meanwhile the gate releases nothing."""
        if self._held_failure is None:
            self._held_failure = reason
            self._loop.call_later(FAILURE_HOLD_S, self._poison, reason)

    @property
    def _gate_timeout_s(self) -> float:
        """A step timeout shorter than the gate's bounds the receipt wait too: a rank stopped
        between steps is not noticed later than one stopped mid-step."""
        return min(self.config.gate_timeout_s, self.config.step_timeout_s)

    def _on_flight_timeout(self, flight: Flight) -> None:
        if flight not in self._flights or flight.future.done():
            return
        replies = flight.replies
        if flight.gated and not flight.released:
            late = [
                r
                for r in range(self.tp_size)
                if (receipt := self._gate.receipt(r)) is None or receipt[0] != replies.seq
            ]
            self._poison(
                f"rank(s) {late} did not receive {replies.name} seq {replies.seq} within "
                f"gate_timeout_s={self._gate_timeout_s}"
            )
        else:
            self._poison(
                f"no reply from rank(s) {replies.missing_ranks()} to {replies.name} seq "
                f"{replies.seq} within step_timeout_s={self.config.step_timeout_s}"
            )

    # ---- poison and teardown ---------------------------------------------------------------

    def _on_rank_exit(self, rank: int) -> None:
        self._loop.remove_reader(self._pidfds[rank])
        code = self._procs[rank].poll()
        if self._stopping or self._closed:
            return
        reason = f"rank {rank} (pid {self._procs[rank].pid}) {describe_exit(code or 0)}"
        if self._starting:  # its StartupFailed, if it sent one, says more: let it arrive
            self._loop.call_later(FAILURE_HOLD_S, self._poison, reason, False)
            return
        if self._held_failure is not None:
            reason += f"; then: {self._held_failure}"
        self._poison(reason, confirm_deaths=False)

    def _fail(self, reason: str) -> ReplicaPoisoned:
        self._poison(reason)
        return ReplicaPoisoned(self._poison_reason)

    def _poison(self, reason: str, confirm_deaths: bool = True) -> None:
        """Keep the first reason, cancel an unreleased gate, fail the waiters, notify, and
        start tearing the ranks down."""
        if self._poison_reason is not None or self._closed:
            return
        if confirm_deaths:  # a rank that died explains the rest (confirmed by exit code)
            for rank, proc in enumerate(self._procs):
                code = proc.poll()
                if code is not None and not self._stopping:
                    reason = f"rank {rank} (pid {proc.pid}) {describe_exit(code)}; then: {reason}"
                    break
        self._poison_reason = reason
        cancelled_seq = None
        newest = self._flights.newest
        if newest is not None and newest.gated and not newest.released:
            cancelled_seq = newest.seq
            self._gate.decide(cancelled_seq, CANCEL)
            for bell in self._release_bells:
                bell.ring()
        self._flights.fail_all(reason)
        if not self._startup.done():
            self._startup.set_exception(ReplicaPoisoned(reason))
            self._startup.exception()  # retrieved here; _launch may be past awaiting it
        if self._on_poison is not None and not self._starting and not self._stopping:
            self._loop.call_soon(self._notify_poison, reason)
        self._teardown_task = self._loop.create_task(self._teardown(cancelled_seq))

    def _notify_poison(self, reason: str) -> None:
        try:
            self._on_poison(reason)
        except Exception as exc:  # the callback's bug must not stop the teardown
            self._loop.call_exception_handler(
                {"message": "on_poison callback failed", "exception": exc}
            )

    async def _await_teardown(self) -> None:
        if self._teardown_task is None:
            self._teardown_task = self._loop.create_task(self._teardown(None))
        await asyncio.shield(self._teardown_task)

    async def _teardown(self, cancelled_seq: int | None) -> None:
        try:
            if cancelled_seq is not None:
                await self._await_cancel_acks(cancelled_seq)
            kill_all(self._procs, self._pidfds)
            await await_exits(self._procs, EXIT_WAIT_S)
        finally:
            self._release()

    async def _await_cancel_acks(self, seq: int) -> None:
        """Give live ranks a moment to see the Cancel (so none is killed mid-decision)."""
        deadline = self._loop.time() + CANCEL_GRACE_S
        while self._loop.time() < deadline:
            if all(
                proc.poll() is not None or self._gate.done_seq(rank) == seq
                for rank, proc in enumerate(self._procs)
            ):
                return
            await asyncio.sleep(0.002)

    def _release(self) -> None:
        """Free everything this replica holds, each step on its own: one that fails (a loop
        already closed, say) must not leave the segment or the run dir behind."""
        if self._closed:
            return
        self._closed = True
        self.trace.write()
        # e.g. a Shutdown never acked
        self._flights.fail_all(self._poison_reason or "replica is shut down")
        errors, readers = [], (*self._pidfds, self._receipt_bell.fd)
        for step in [
            *(lambda fd=fd: self._loop.remove_reader(fd) for fd in readers),
            self._replies.close,
        ]:
            try:  # the loop's readers (the replies' too), then free_replica: each step on its own
                step()
            except Exception as exc:
                errors.append(exc)
        for exc in errors + free_replica(*self._held):
            self._loop.call_exception_handler(
                {"message": "replica teardown step failed", "exception": exc}
            )
        if all(proc.returncode is not None for proc in self._procs):
            self._finalizer.detach()

    async def _shutdown(self) -> None:
        if self._poison_reason is None and not self._closed:
            self._stopping = True
            try:
                await asyncio.wait_for(self._call(Shutdown, stopping_ok=True), SHUTDOWN_ACK_S)
            except (ReplicaPoisoned, TimeoutError):
                pass
            await await_exits(self._procs, EXIT_WAIT_S)
        await self._await_teardown()
