"""Rank processes: the rank's whole configuration, the spawn, the kill; freeing a replica.

A rank is `python -m deltaserve.ipc.rank_main` (ipc/rank_harness.py under a test's fault plan
or journal), its `RankConfig` msgspec-encoded on stdin (no pickle, no fork of the event-loop
process's state). The controller keeps a pidfd per rank
to notice its death from the event loop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys

import msgspec
import zmq

from deltaserve.ipc.channels import close_context
from deltaserve.ipc.faults import FaultPlan
from deltaserve.ipc.gate import Doorbell, StartGate
from deltaserve.ipc.messages import ExecutorConfig


class RankConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a rank process needs, sent by the controller on the rank's stdin: what its
    executor runs (`executor`, which holds the rank's place: rank, tp_size, device) and how
    the process talks to the controller."""

    executor: ExecutorConfig
    parent_pid: int  # the rank exits if its parent changes (it also has PR_SET_PDEATHSIG)
    command_endpoint: str
    reply_endpoint: str
    gate_name: str
    receipt_fd: int  # eventfd shared by all ranks: rung after recording a receipt
    release_fd: int  # eventfd of this rank: rung by the controller after a decision
    release_timeout_s: float  # longest wait for a gate decision
    dist_init_method: str  # file:// in the run dir
    dist_timeout_s: float
    overlap_steps: bool = False  # queue a pipelined follower before finishing the step ahead
    noop_executor: bool = False  # benchmarks only
    noop_step_s: float = 0.0  # the no-op executor sleeps this long per step (a GPU stand-in)
    # tests only: either one starts the rank in the harness (ipc/rank_harness.py)
    journal_path: str | None = None  # append-only log of gated commands
    fault: FaultPlan | None = None
    log_level: int = 20  # the server's deltaserve logger level (logging.INFO by default)

    @property
    def rank(self) -> int:
        return self.executor.rank

    @property
    def tp_size(self) -> int:
        return self.executor.tp_size

    @property
    def device(self) -> str:
        return self.executor.device


rank_config_decoder = msgspec.msgpack.Decoder(RankConfig)


def spawn_rank(config: RankConfig) -> subprocess.Popen:
    """Start one rank; its stdout/stderr are the controller's."""
    env = dict(os.environ)
    if config.device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    else:  # keep Triton autotuning results (fla's prefill kernels) on disk: a restart skips them
        env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    # a fault plan or a journal: the test harness around the serve loop (ipc/rank_harness.py)
    tested = config.fault is not None or config.journal_path is not None
    module = "deltaserve.ipc.rank_harness" if tested else "deltaserve.ipc.rank_main"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, f"--rank={config.rank}"],
        stdin=subprocess.PIPE,
        pass_fds=(config.receipt_fd, config.release_fd),
        env=env,
    )
    try:
        proc.stdin.write(msgspec.msgpack.encode(config))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at once; the controller sees its exit
    return proc


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


async def await_exits(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Whether every process exited within `timeout_s` (polled: the loop stays free)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while any(proc.poll() is None for proc in procs):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def kill_all(procs: list[subprocess.Popen], pidfds: list[int]) -> None:
    """SIGKILL every rank still running, through its pidfd (no pid-reuse race)."""
    for proc, pidfd in zip(procs, pidfds, strict=True):
        if proc.poll() is None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass


def free_replica(
    gate: StartGate,
    run_dir: str,
    ctx: zmq.Context,
    sockets: list[zmq.Socket],
    fds: list[int],
    bells: list[Doorbell],
) -> list[Exception]:
    """Free what a replica holds besides its ranks, each step on its own (one that fails must
    not leave the segment or the run dir behind); idempotent (`fds` are emptied as closed).
    Returns the steps' errors."""
    steps = [
        lambda: gate.close(unlink=True),
        lambda: shutil.rmtree(run_dir, ignore_errors=True),
        lambda: close_context(ctx, sockets),
        *(bell.close for bell in bells),
    ]
    steps += [lambda: os.close(fds.pop()) for _ in fds]  # popped: never closed twice
    errors = []
    for step in steps:
        try:
            step()
        except Exception as exc:
            errors.append(exc)
    return errors


def emergency_cleanup(procs: list[subprocess.Popen], *held: object) -> None:
    """Last resort, a weakref.finalize callback (the controller was dropped without shutdown,
    or the program exits first): kill its ranks, then `free_replica(*held)`. It holds those
    objects itself, so none is in the controller's garbage cycle, where their own __del__
    would run in any order: the zmq context's then waits forever on the cycle's sockets still
    open, SharedMemory's fails (BufferError) while the gate's view of it is alive."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    errors = free_replica(*held)
    if errors:
        raise errors[0]
