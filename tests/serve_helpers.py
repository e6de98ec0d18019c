"""Helpers shared by the tests that run a server: a real `deltaserve serve` subprocess on a
free port, an in-process server (engine + aiohttp app), the rank processes of a parent found
from /proc, and "nothing leaked" checks.

Imported as `serve_helpers` (pytest puts tests/ on sys.path; tests/ has no __init__.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.http.listen import start_server
from deltaserve.http.server import ServerConfig, build_app

DELTASERVE = str(Path(sys.executable).with_name("deltaserve"))
REPO_ROOT = Path(__file__).resolve().parent.parent
LONG_FIGURES = REPO_ROOT / "bench" / "results" / "load_suite_long.json"


# ---- /metrics ----------------------------------------------------------------------------


def metric_samples(text: str, model: str) -> dict[str, float]:
    """A /metrics exposition read by prometheus_client's parser (a reference independent of
    our writer): `name{label="value",...}` (labels sorted, `model_name` left out) -> value.
    Every series must carry `model_name="<model>"`."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name", None) == model, sample
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            values[sample.name + (f"{{{inner}}}" if inner else "")] = sample.value
    return values


# ---- processes ---------------------------------------------------------------------------


def rank_pids(parent_pid: int) -> list[int]:
    """Live rank processes (`python -m deltaserve.ipc.rank_main`, or the test harness
    `deltaserve.ipc.rank_harness`) whose parent is `parent_pid`."""
    try:
        children = psutil.Process(parent_pid).children()
    except psutil.NoSuchProcess:  # the parent is gone: no process is its child any more
        return []
    pids = []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE and any(
                arg.startswith("deltaserve.ipc.rank_") for arg in child.cmdline()
            ):
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(pids)


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie waits only to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def wait_gone(pids: list[int], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, (
            f"processes still alive: {[p for p in pids if alive(p)]}"
        )
        await asyncio.sleep(0.05)


# ---- HTTP --------------------------------------------------------------------------------


async def get(url: str, headers: dict | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, await r.text()


async def health(url: str) -> int | None:
    """/health's status, or None when nothing listens any more."""
    try:
        return (await get(url + "/health"))[0]
    except aiohttp.ClientConnectionError:
        return None


class ServeProcess:
    """`deltaserve serve --port 0 ...` with stderr collected; `url` once it logged its
    ready line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            m = re.search(r"ready: serving .* at (https?://[\d.]+:\d+|unix:\S+)/v1", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    @classmethod
    async def start(
        cls, *args: str, env: dict | None = None, timeout_s: float = 180
    ) -> ServeProcess:
        proc = await asyncio.create_subprocess_exec(
            DELTASERVE,
            "serve",
            "--port",
            "0",
            *args,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group, as a service manager starts it
        )
        self = cls(proc)
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        finally:
            if self.url is None:
                await self.kill()
        assert self.url is not None, "server did not become ready:\n" + self.log()
        return self

    def log(self, lines: int = 40) -> str:
        return "\n".join(self.lines[-lines:])

    async def wait(self, timeout_s: float) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        await self._reader
        return code

    async def kill(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`: a server killed outright cannot remove its
        replica's run folder."""
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


# ---- in-process server -------------------------------------------------------------------


@dataclass
class InProcessServer:
    engine: Any  # an AsyncEngine, or a DataParallelEngine
    url: str  # http://127.0.0.1:PORT


@contextlib.asynccontextmanager
async def in_process_server(
    config: EngineConfig, server_config: ServerConfig
) -> AsyncIterator[InProcessServer]:
    """A real engine (rank processes, ZeroMQ, shared memory) behind the aiohttp app on a
    free loopback port, served from this event loop."""
    engine = await AsyncEngine.start(config)
    try:
        async with serving(engine, server_config) as server:
            yield server
    finally:
        await engine.shutdown()


@contextlib.asynccontextmanager
async def serving(engine: Any, server_config: ServerConfig) -> AsyncIterator[InProcessServer]:
    """The aiohttp app over a started engine (one AsyncEngine, or several replicas' engine)
    on a free loopback port; the engine is the caller's to shut down."""
    runner, _ = await start_server(build_app(engine, server_config), "127.0.0.1", 0)
    try:
        yield InProcessServer(engine, f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def openai_client(
    server: InProcessServer, api_key: str = "none"
) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client on `server`'s /v1, failing fast: no retries, a minute's timeout."""
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60
    )
    try:
        yield client
    finally:
        await client.close()


async def wait_idle(engine: AsyncEngine, timeout_s: float = 10.0, prefixes: bool = False) -> None:
    """Until the scheduler holds nothing; then every slot and block must be free in the
    scheduler's ledger and on every rank. With `prefixes` (prefix caching) the saved prefixes
    may hold full blocks: every rank then holds what the ledger says they do."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = engine.load()
        if load.running == 0 and load.waiting == 0:
            break
        assert time.monotonic() < deadline, f"engine not idle after {timeout_s}s: {load}"
        await asyncio.sleep(0.02)
    held = load.num_blocks - load.free_blocks if prefixes else 0
    assert load.free_slots == load.num_slots and load.num_blocks - load.free_blocks == held, load
    for snap in await engine.rank_snapshots():
        assert snap.request_ids == [] and snap.slots_used == 0 and snap.blocks_used == held, snap


def source_tree() -> str:
    """The commit the suite ran at, "+changes" where the checkout differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()

    # not this record
    changed = git("status", "--porcelain", "--", ".", f":!{LONG_FIGURES.relative_to(REPO_ROOT)}")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if changed else "")


def record_long_figures(is_long: bool, name: str, figures: dict) -> None:
    """With `pytest --long`, keep a test's figures (requests, disconnects, faults, leaks) in
    bench/results/load_suite_long.json, one entry per test."""
    if not is_long:
        return
    data = json.loads(LONG_FIGURES.read_text()) if LONG_FIGURES.exists() else {}
    data["command"] = (
        "python -m pytest --long --timeout 5400 -q tests/test_load.py tests/test_load_faults.py"
    )
    data["hardware"] = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    entry = {
        **figures,
        "tree": source_tree(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    data.pop("tree", None)  # once one field for the whole file, which later runs left stale
    data.setdefault("tests", {})[name] = entry
    LONG_FIGURES.parent.mkdir(parents=True, exist_ok=True)
    LONG_FIGURES.write_text(json.dumps(data, indent=1) + "\n")
