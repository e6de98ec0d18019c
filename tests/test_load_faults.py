"""Faults under load, against the real `deltaserve serve` process: SIGKILL of a rank, SIGSTOP
of a rank past the step timeout, SIGTERM of the server. In each case:

- every client (streams running, and streams still queued) gets a terminal answer within a
  bound: an error event naming the cause (a rank stopped while the server is idle, too);
- /health never answers 200 once the server has failed or started draining;
- the exit code is right (1 after an engine death, 0 after SIGTERM);
- no process remains (neither the server nor any rank).

CI size: 8 clients over 4 slots. `pytest --long`: 64 clients over 32 slots (figures written to
bench/results/load_suite_long.json).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass

import aiohttp
import pytest
from serve_helpers import ServeProcess, alive, rank_pids, record_long_figures, wait_gone

MODEL = "tiny-faults"
# step_timeout_s: well above a normal step of `slots` requests on a 2-core CPU, short enough
# to bound the SIGSTOP test
QUICK = {"clients": 8, "slots": 4, "step_timeout_s": 5.0}
LONG = {"clients": 64, "slots": 32, "step_timeout_s": 15.0}
LONG_TOKENS = 1500  # requests that cannot finish before the fault strikes
STEP_TIMEOUT_S = 2.0  # the idle test's
SHUTDOWN_TIMEOUT_S = 2.0


@dataclass
class Client:
    max_tokens: int
    chunks: int = 0
    end: str | None = None  # "finished:<reason>", "error:<code>", "http:<status>", "cut:<exc>"
    message: str = ""
    ended_at: float = 0.0


async def run_client(session: aiohttp.ClientSession, url: str, c: Client) -> None:
    payload = {
        "model": MODEL,
        "prompt": "The quick brown fox jumps over the lazy dog. " * 2,
        "max_tokens": c.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(url + "/v1/completions", json=payload) as resp:
            if resp.status != 200:
                c.end, c.message = f"http:{resp.status}", await resp.text()
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    c.end, c.message = f"error:{event['error']['code']}", event["error"]["message"]
                    return
                c.chunks += 1
                for choice in event["choices"]:
                    if choice.get("finish_reason"):
                        c.end = f"finished:{choice['finish_reason']}"
            if c.end is None:
                c.end = "cut:eof"
    except aiohttp.ClientError as exc:
        c.end, c.message = f"cut:{type(exc).__name__}", str(exc)
    finally:
        c.ended_at = time.monotonic()


class HealthPoller:
    """/health every 20 ms: (time, status or None when nothing listens)."""

    def __init__(self, url: str) -> None:
        self.seen: list[tuple[float, int | None]] = []
        self._task = asyncio.ensure_future(self._run(url))

    async def _run(self, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        while True:
            try:
                async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url + "/health") as r:
                    status: int | None = r.status
            except (aiohttp.ClientError, TimeoutError):
                status = None
            self.seen.append((time.monotonic(), status))
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def after(self, t: float) -> list[int | None]:
        return [status for at, status in self.seen if at >= t]


@pytest.fixture
def size(request: pytest.FixtureRequest) -> dict:
    return LONG if request.config.getoption("--long") else QUICK


async def start_loaded(model_dir, size: dict, *extra: str) -> tuple[ServeProcess, list, list]:
    """A server with `clients` long streams open: `slots` running, the rest queued."""
    server = await ServeProcess.start(
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        str(size["slots"]),
        "--max-num-batched-tokens",
        "512",
        *extra,
    )
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    clients = [Client(LONG_TOKENS) for _ in range(size["clients"])]
    tasks = [asyncio.ensure_future(run_client(session, server.url, c)) for c in clients]
    deadline = time.monotonic() + 120
    try:
        while sum(c.chunks > 0 for c in clients) < size["slots"]:  # every slot is decoding
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), (
                [(c.end, c.message) for c in clients],
                server.log(),
            )
            await asyncio.sleep(0.05)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
        await server.kill()
        raise
    return server, tasks, [session, clients]


async def finish(tasks: list, session: aiohttp.ClientSession, bound_s: float) -> None:
    done, pending = await asyncio.wait(tasks, timeout=bound_s)
    for t in pending:
        t.cancel()
    await session.close()
    assert not pending, f"{len(pending)} clients got no terminal answer within {bound_s} s"


async def check_gone(server: ServeProcess, ranks: list[int], exit_code: int) -> None:
    code = await server.wait(30)
    assert code == exit_code, server.log()
    await wait_gone(ranks + [server.proc.pid])
    assert rank_pids(server.proc.pid) == []


@pytest.mark.parametrize("fault", ["sigkill_rank", "sigstop_rank"])
async def test_rank_fault_under_load(tiny_model_dir, size, fault):
    """A rank SIGKILLed (TP=2: the survivor is stuck in a collective) or SIGSTOPped past the
    step timeout (TP=1): every client gets an `engine_dead` error event naming the cause,
    /health is never 200 again, the server exits 1, nothing remains."""
    tp = "2" if fault == "sigkill_rank" else "1"
    step_timeout_s = size["step_timeout_s"]
    server, tasks, (session, clients) = await start_loaded(
        tiny_model_dir, size, "--tp", tp, "--step-timeout", str(step_timeout_s)
    )
    health = HealthPoller(server.url)
    try:
        ranks = rank_pids(server.proc.pid)
        assert len(ranks) == int(tp)
        victim = ranks[-1]
        t_fault = time.monotonic()
        os.kill(victim, signal.SIGKILL if fault == "sigkill_rank" else signal.SIGSTOP)
        bound = 10.0 if fault == "sigkill_rank" else 2 * step_timeout_s + 5.0
        await finish(tasks, session, bound)
        ends = {c.end for c in clients}
        assert ends == {"error:engine_dead"}, [(c.end, c.message) for c in clients]
        cause = "SIGKILL" if fault == "sigkill_rank" else "_timeout_s"
        assert all(cause in c.message for c in clients), clients[0].message
        latest = max(c.ended_at for c in clients) - t_fault
        assert latest < bound
        await check_gone(server, ranks, exit_code=1)
        await health.stop()
        first_down = next(at for at, status in health.seen if at >= t_fault and status != 200)
        after = health.after(first_down)
        assert 200 not in after and set(after) <= {503, None}, after
        assert after[-1] is None  # nothing listens any more
    finally:
        await health.stop()
        await server.kill()
        if fault == "sigstop_rank":
            for pid in ranks:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
    figures = {
        "clients": len(clients),
        "fault": fault,
        "tp": int(tp),
        "terminal_answers": len(clients),
        "latest_terminal_s": round(latest, 2),
        "processes_left": 0,
    }
    print("fault figures:", figures)
    record_long_figures(size is LONG, f"rank_fault_under_load[{fault}]", figures)


async def test_rank_stopped_while_idle(tiny_model_dir):
    """A rank SIGSTOPped between steps (the server idle) is found by the next step's start
    gate within --step-timeout too, not the gate's longer default (10 s): the requests that
    arrive get `engine_dead` errors in time, the server exits 1, nothing remains."""
    server = await ServeProcess.start(
        "--model",
        str(tiny_model_dir),
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "512",
        "--step-timeout",
        str(STEP_TIMEOUT_S),
    )
    try:
        (rank,) = ranks = rank_pids(server.proc.pid)
        os.kill(rank, signal.SIGSTOP)
        session = aiohttp.ClientSession()
        clients = [Client(8) for _ in range(3)]
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(run_client(session, server.url, c)) for c in clients]
        bound = STEP_TIMEOUT_S + 4.0
        await finish(tasks, session, bound)
        assert {c.end for c in clients} == {"error:engine_dead"}, clients
        assert f"gate_timeout_s={STEP_TIMEOUT_S}" in clients[0].message, clients[0].message
        assert max(c.ended_at for c in clients) - t0 < bound
        await check_gone(server, ranks, exit_code=1)
    finally:
        await server.kill()
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_sigterm_under_load(tiny_model_dir, size):
    """SIGTERM drains for --shutdown-timeout: the running and the queued requests (none can
    finish in time) end with an `aborted` error event at the deadline, not before; /health is
    503 (or gone) from then on, the server exits 0, nothing remains."""
    server, tasks, (session, clients) = await start_loaded(
        tiny_model_dir, size, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)
    )
    health = HealthPoller(server.url)
    try:
        ranks = rank_pids(server.proc.pid)
        t_signal = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        bound = SHUTDOWN_TIMEOUT_S + 10.0
        await finish(tasks, session, bound)
        ends = [c.end for c in clients]
        assert set(ends) == {"error:aborted"}, [(c.end, c.message) for c in clients]
        latest = max(c.ended_at for c in clients) - t_signal
        assert SHUTDOWN_TIMEOUT_S - 0.5 < latest < bound
        await check_gone(server, ranks, exit_code=0)
        await health.stop()
        first_down = next(at for at, status in health.seen if at >= t_signal and status != 200)
        after = health.after(first_down)
        assert 200 not in after and set(after) <= {503, None}, after
    finally:
        await health.stop()
        await server.kill()
    figures = {
        "clients": len(clients),
        "fault": "sigterm_server",
        "terminal_answers": len(clients),
        "latest_terminal_s": round(latest, 2),
        "processes_left": 0,
    }
    print("fault figures:", figures)
    record_long_figures(size is LONG, "sigterm_under_load", figures)
