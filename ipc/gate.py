"""The start gate: a state-changing command runs on no rank until every rank has it.

One shared-memory segment per replica (unique name, unlinked at teardown) holds uint64 words,
each writer on its own 64-byte line:

    line 0      [decision, release_seq]           the controller only
    line 1 + r  [receipt_tag, receipt_seq, done]  rank r only

Protocol for gated command `seq`: rank r writes its receipt (seq and a crc32 of the frame; it
does so for every frame, before decoding it) and rings the controller's doorbell; when every
rank's receipt carries `seq` and the controller's digest, the controller publishes
`decision = EXECUTE`, else (a rank died, a send failed, the gate timed out) `CANCEL`, and rings
every rank's doorbell. A rank runs the command only after reading EXECUTE for its `seq`, and
writes `done = seq` when it has finished (run or cancelled). A rank checks the decision once
before it sleeps (the release often lands while it decodes): no spinning on two shared cores.

Memory ordering (LESSONS, vLLM 29389/27858): a writer stores the payload word first and the
sequence word last; a reader reads the sequence, the payload, the sequence again, and trusts
the payload only if both reads give `seq`. The payload words also carry `seq` themselves
(`decision = seq * 4 + code`, `receipt_tag = seq low bits << 32 | crc`), so a stale payload
is caught even on a CPU that reorders stores. Each word is one aligned 8-byte ctypes store.

Doorbells are eventfds that only wake sleepers: the words above are the truth, so a lost or
spurious ring costs one re-check, never a wrong decision. Every wait is bounded.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import select
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

EXECUTE = 1
CANCEL = 2
LINE_WORDS = 8  # 64 bytes
WAKE_POLL_S = 0.1  # a sleeping rank re-checks liveness at least this often


def gate_bytes(num_ranks: int) -> int:
    return 8 * LINE_WORDS * (num_ranks + 1)


class StartGate:
    """The shared words of one replica's gate; the controller creates, ranks attach."""

    def __init__(self, buffer: memoryview | mmap.mmap, num_ranks: int, name: str) -> None:
        self.name = name
        self.num_ranks = num_ranks
        # unsigned: a receipt tag sets the top bit from seq 2**31 on (a signed word wrapped it)
        self._words = (ctypes.c_uint64 * (LINE_WORDS * (num_ranks + 1))).from_buffer(buffer)
        self._shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None

    @classmethod
    def create(cls, num_ranks: int) -> StartGate:
        name = f"deltaserve-gate-{os.getpid()}-{secrets.token_hex(6)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=gate_bytes(num_ranks))
        shm.buf[:] = bytes(len(shm.buf))
        gate = cls(shm.buf, num_ranks, name)
        gate._shm = shm
        return gate

    @classmethod
    def attach(cls, name: str, num_ranks: int) -> StartGate:
        """Map an existing gate. Plain mmap of /dev/shm, not SharedMemory: the latter would
        start a resource tracker in the rank that unlinks the segment when the rank exits."""
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            mm = mmap.mmap(fd, gate_bytes(num_ranks))
        finally:
            os.close(fd)
        gate = cls(mm, num_ranks, name)
        gate._mmap = mm
        return gate

    # ---- controller side -------------------------------------------------------------

    def decide(self, seq: int, decision: int) -> None:
        self._words[0] = seq * 4 + decision  # payload first
        self._words[1] = seq  # then the sequence word

    def receipt(self, rank: int) -> tuple[int, int] | None:
        """(seq, crc32) that rank last recorded, or None while its words are mid-update."""
        base = LINE_WORDS * (rank + 1)
        seq = self._words[base + 1]
        tag = self._words[base]
        if self._words[base + 1] != seq or (tag >> 32) != (seq & 0xFFFFFFFF):
            return None
        return seq, tag & 0xFFFFFFFF

    def done_seq(self, rank: int) -> int:
        return self._words[LINE_WORDS * (rank + 1) + 2]

    # ---- rank side ---------------------------------------------------------------------

    def record_receipt(self, rank: int, seq: int, crc: int) -> None:
        base = LINE_WORDS * (rank + 1)
        self._words[base] = ((seq & 0xFFFFFFFF) << 32) | crc  # payload first
        self._words[base + 1] = seq

    def mark_done(self, rank: int, seq: int) -> None:
        self._words[LINE_WORDS * (rank + 1) + 2] = seq

    def decision(self, seq: int) -> int:
        """EXECUTE or CANCEL once the controller has decided `seq`, else 0."""
        if self._words[1] != seq:
            return 0
        word = self._words[0]
        if self._words[1] != seq or (word >> 2) != seq:
            return 0
        return word & 3

    def wait_decision(
        self, seq: int, bell: Doorbell, timeout_s: float, check_alive: Callable[[], None]
    ) -> int:
        """Sleep on `bell` until `seq` is decided (EXECUTE/CANCEL) or `timeout_s` passes (0).
        Calls `check_alive` at least every WAKE_POLL_S."""
        decision = self.decision(seq)
        deadline = time.monotonic() + timeout_s
        while not decision:
            left = deadline - time.monotonic()
            if left <= 0:
                return 0
            bell.wait(min(left, WAKE_POLL_S))
            check_alive()
            decision = self.decision(seq)
        return decision

    # ---- teardown ----------------------------------------------------------------------

    def close(self, unlink: bool = False) -> None:
        """Drop this process's mapping (the view first: it pins the mapping open); the
        creator also unlinks the segment, through SharedMemory so that its resource tracker
        forgets it. Idempotent."""
        self._words = None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.close()
            if unlink:
                try:
                    shm.unlink()
                except FileNotFoundError:  # removed by hand: the tracker would still warn
                    resource_tracker.unregister(shm._name, "shared_memory")
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


class Doorbell:
    """An eventfd: `ring` wakes whoever sleeps in `wait` (or has the fd in its event loop)."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if fd is None else fd
        self._poll: select.poll | None = None

    def ring(self) -> None:
        os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def wait(self, timeout_s: float) -> None:
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)
        self._poll.poll(max(0.0, timeout_s) * 1000.0)
        self.drain()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
