"""The compile worker: a child process that compiles each constraint and stop regex once,
off the event loop, under a time and a memory limit it cannot get past.

A constraint compiles when llguidance builds its matcher on the model's vocabulary and its
first token mask, within the lexer-state limit and the mask-time bound; a stop regex when its
matcher on the 256 bytes does not match the empty text. The worker answers with the grammar
(engine/guided/grammar.py) or the error; engine/guides.py caches either. A compile that runs
past `compile_timeout_s`, or grows the worker past `max_grammar_memory_mb`, gets the worker
killed (SIGKILL: llguidance cannot be interrupted) and a fresh one started for the next job.
Memory is polled during a job and the job's peak (VmHWM, reset before each job) read after
it, so a compile too quick for the poll is still held to the bound. One job at a time.

Frames on the worker's stdin and stdout: a 4-byte big-endian length, then msgpack.

    python -m deltaserve.engine.grammar_worker SETUP_JSON    (the engine starts it)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import msgspec

from deltaserve.engine.structured_config import StructuredOutputsConfig

log = logging.getLogger("deltaserve.engine")
STARTUP_TIMEOUT_S = 120.0  # reading the vocabulary (a few seconds), not a compile
RSS_POLL_S = 0.02


class Setup(msgspec.Struct, frozen=True):
    """What the worker is started with."""

    tokenizer_json: str  # the model's tokenizer.json
    vocab_size: int  # mask width: the model's vocabulary, padding rows included
    eos_ids: list[int]  # the tokens a finished output may end with
    max_lexer_states: int
    max_mask_ms: float
    parent_pid: int


class Job(msgspec.Struct, frozen=True, array_like=True):
    """`kind`: a constraint's (sampling_params.GUIDED_FIELDS), or "stop_regex"."""

    kind: str
    text: str
    whitespace: str | None = None


class Outcome(msgspec.Struct, frozen=True, array_like=True):
    """The grammar ("" for a stop regex), or the error (non-empty: refused)."""

    grammar: str = ""
    error: str = ""
    compile_ms: float = 0.0
    mask_ms: float = 0.0


class WorkerFailed(RuntimeError):
    """The worker could not start: a server problem, not the request's."""


# ---- the engine's side ------------------------------------------------------------------------


class GrammarWorker:
    """Runs jobs in the child process, one at a time, starting it when needed."""

    def __init__(self, setup: Setup, config: StructuredOutputsConfig) -> None:
        self._setup = setup
        self._config = config
        self._proc: asyncio.subprocess.Process | None = None
        self._idle_rss = 0  # the worker's resident bytes once started: its baseline
        self._lock = asyncio.Lock()
        self.restarts = 0  # workers killed for a bound, or lost (tests read it)
        self.jobs = 0  # jobs sent

    async def run(self, job: Job) -> Outcome:
        """The job's outcome; an Outcome with the bound named where the worker had to be
        killed. Raises WorkerFailed when no worker can be started."""
        async with self._lock:
            proc = await self._started()
            _reset_peak_rss(proc.pid)
            before = _rss(proc.pid)
            self.jobs += 1
            proc.stdin.write(_frame(msgspec.msgpack.encode(job)))
            read = asyncio.ensure_future(_read_frame(proc.stdout))
            try:
                outcome = await self._watch(proc, read, before)
            finally:
                read.cancel()
            if outcome is not None and _peak_rss(proc.pid) - before > self._limit_bytes:
                self.restarts += 1
                await self._kill()
                return self._too_big
            if outcome is not None:
                grown = _rss(proc.pid) - self._idle_rss
                if grown > self._limit_bytes:
                    log.info("compile worker grew %d MiB over its jobs: replaced", grown >> 20)
                    await self._kill()
                return outcome
            return await self._failed(read)

    async def _watch(
        self, proc: asyncio.subprocess.Process, read: asyncio.Future, before: int
    ) -> Outcome | None:
        """The reply, or None where a bound was crossed or the worker died (`read` says)."""
        config = self._config
        deadline = time.monotonic() + config.compile_timeout_s
        late = Outcome(
            error=f"compiling took longer than compile_timeout_s ({config.compile_timeout_s:g} s)"
        )
        while True:
            wait_s = min(RSS_POLL_S, deadline - time.monotonic())
            done, _ = await asyncio.wait({read}, timeout=max(0.0, wait_s))
            if done:
                frame = read.result() if not read.exception() else None
                if frame is None:
                    return None
                return (
                    late
                    if time.monotonic() > deadline
                    else msgspec.msgpack.decode(frame, type=Outcome)
                )
            if time.monotonic() >= deadline:
                self.restarts += 1
                await self._kill()
                return late
            if _rss(proc.pid) - before > self._limit_bytes:
                self.restarts += 1
                await self._kill()
                return self._too_big

    @property
    def _limit_bytes(self) -> int:
        return self._config.max_grammar_memory_mb * 2**20

    @property
    def _too_big(self) -> Outcome:
        limit = self._config.max_grammar_memory_mb
        return Outcome(error=f"compiling needed more than max_grammar_memory_mb ({limit} MiB)")

    async def _failed(self, read: asyncio.Future) -> Outcome:
        """The worker died mid-job (killed from outside, or a crash in the library)."""
        code = await self._kill()
        self.restarts += 1
        reason = read.exception() if read.done() and not read.cancelled() else None
        log.warning("compile worker died (exit %s, %s): replaced", code, reason)
        return Outcome(error=f"the compiler failed on it (its process exited with {code})")

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        env = {**os.environ, "RAYON_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "deltaserve.engine.grammar_worker",
            msgspec.json.encode(self._setup).decode(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            ready = await asyncio.wait_for(_read_frame(proc.stdout), STARTUP_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError) as exc:
            proc.kill()
            await proc.wait()
            raise WorkerFailed(f"the compile worker did not start: {exc!r}") from None
        if ready != b"ready":
            proc.kill()
            await proc.wait()
            raise WorkerFailed(
                f"the compile worker did not start: {ready.decode(errors='replace')}"
            )
        self._proc, self._idle_rss = proc, _rss(proc.pid)
        return proc

    async def _kill(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.returncode is None:
            proc.kill()
        return await proc.wait()

    @property
    def pid(self) -> int | None:
        """The running worker's process id (tests measure and kill it)."""
        return None if self._proc is None or self._proc.returncode is not None else self._proc.pid

    async def close(self) -> None:
        async with self._lock:
            await self._kill()


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


async def _read_frame(stream: asyncio.StreamReader) -> bytes:
    size = int.from_bytes(await stream.readexactly(4), "big")
    return await stream.readexactly(size)


def _rss(pid: int) -> int:
    """Resident bytes of a process (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _peak_rss(pid: int) -> int:
    """The process's peak resident bytes since its last _reset_peak_rss (0 once gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def _reset_peak_rss(pid: int) -> None:
    """Start the peak over at the present resident size (Linux: clear_refs 5)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


# ---- the worker's side ------------------------------------------------------------------------


def compile_job(job: Job, tokenizer: object, setup: Setup) -> Outcome:
    """One job, in the worker. Every error is the outcome, never an exception."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from deltaserve.engine.guided.grammar import constraint_grammar
    from deltaserve.engine.guided.runtime import byte_tokenizer, error_summary, parser_limits
    from deltaserve.engine.guided.stop_regex import stop_regex_grammar

    limits = parser_limits(setup.max_lexer_states)
    started = time.perf_counter()
    try:
        if job.kind == "stop_regex":
            matcher = LLMatcher(byte_tokenizer(), stop_regex_grammar(job.text), limits=limits)
            if matcher.is_error():
                return Outcome(error=error_summary(matcher.get_error()))
            if matcher.is_accepting():
                return Outcome(error="it matches the empty text: it would stop at once")
            return Outcome(compile_ms=1e3 * (time.perf_counter() - started))
        grammar = constraint_grammar(job.kind, job.text, job.whitespace)
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        compiled = time.perf_counter()
        mask = allocate_token_bitmask(1, setup.vocab_size)
        if not matcher.is_error():
            fill_next_token_bitmask(matcher, mask, 0)
        mask_ms = 1e3 * (time.perf_counter() - compiled)
    except Exception as exc:  # ValueError from the converters; anything else llguidance raises
        return Outcome(error=str(exc) if isinstance(exc, ValueError) else f"{exc!r}")
    if matcher.is_error():
        return Outcome(error=error_summary(matcher.get_error()))
    if not mask.any():
        return Outcome(error="no output can match it")
    if mask_ms > setup.max_mask_ms:
        return Outcome(
            error=f"its first token mask took {mask_ms:.0f} ms; max_mask_ms is "
            f"{setup.max_mask_ms:g} ms"
        )
    return Outcome(grammar, "", 1e3 * (compiled - started), mask_ms)


def main() -> int:
    setup = msgspec.json.decode(sys.argv[1], type=Setup)
    from deltaserve.ipc.rank_main import die_with_parent

    die_with_parent(setup.parent_pid)
    from llguidance import LLTokenizer

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer = LLTokenizer(
        Path(setup.tokenizer_json).read_text(encoding="utf-8"),
        n_vocab=setup.vocab_size,
        eos_token=setup.eos_ids,
    )
    stdout.write(_frame(b"ready"))
    stdout.flush()
    while header := stdin.read(4):
        job = msgspec.msgpack.decode(stdin.read(int.from_bytes(header, "big")), type=Job)
        stdout.write(_frame(msgspec.msgpack.encode(compile_job(job, tokenizer, setup))))
        stdout.flush()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        sys.exit(main())
