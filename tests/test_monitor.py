"""Monitors attach over ZeroMQ: load snapshots and lifecycle events (docs/MONITOR.md).

- a plain pyzmq + msgspec subscriber sees, for every request, queued -> admitted ->
  first_token -> finished in order, with no gap in `seq`, and load messages that are the
  engine's own snapshots, whose step token counts add up to the prompts and outputs;
- after a rank dies mid-step it sees poisoned, then an idle load with state dead, then
  terminal, then (after shutdown) shut_down;
- a subscriber that never reads costs the publisher nothing: sends stay fast and messages
  are dropped, not queued;
- `deltaserve monitor --json` against a live `deltaserve serve` prints decodable messages;
- the doc's field tables match the schema Structs.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
import pytest_asyncio
import zmq
from engine_helpers import drain

from deltaserve.engine import monitor_schema as schema
from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import ErrorEvent, FinishedEvent, LoadSnapshot, TokenEvent
from deltaserve.engine.monitor import MonitorPublisher
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.ipc.faults import FaultPlan

module_loop = pytest.mark.asyncio(loop_scope="module")  # the engine fixture's loop

FATAL_STEP = 5  # the rank dies inside this step, after the request's first token
DELTASERVE = str(Path(sys.executable).with_name("deltaserve"))
DOC = Path(__file__).resolve().parents[1] / "docs" / "MONITOR.md"
COMMON = ("schema_version", "seq", "time_s")


class Subscriber:
    """A monitor as another program would write one: a SUB socket in its own thread; each
    message is kept as (topic, plain msgpack dict, typed Struct)."""

    def __init__(self, endpoint: str) -> None:
        self.messages: list[tuple[bytes, dict, schema.MonitorMessage]] = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                topic, body = self._sock.recv_multipart()
                self.messages.append(
                    (topic, msgspec.msgpack.decode(body), schema.decode(topic, body))
                )

    def typed(self, cls=object) -> list:
        return [m for _, _, m in list(self.messages) if isinstance(m, cls)]

    async def wait_for(self, predicate, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(predicate(m) for m in self.typed()):
            assert time.monotonic() < deadline, f"not seen; last: {self.typed()[-5:]}"
            await asyncio.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def step_free(load) -> tuple:
    """A load's fields but the step_* ones (a heartbeat repeats a snapshot with them 0)."""
    skip = {"step_prefill_tokens", "step_decode_tokens", "step_duration_s"}
    return tuple((f, getattr(load, f)) for f in LoadSnapshot.__struct_fields__ if f not in skip)


async def start_engine(model_dir: Path, folder: Path, fault: FaultPlan | None) -> AsyncEngine:
    """The tiny engine publishing on an ipc:// endpoint in `folder`."""
    config = EngineConfig(
        model=str(model_dir),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        num_kv_blocks=64,
        startup_timeout_s=90.0,
        monitor_endpoint=f"ipc://{folder}/monitor",
        fault=fault,
    )
    return await AsyncEngine.start(config)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir, tmp_path_factory):
    engine = await start_engine(tiny_model_dir, tmp_path_factory.mktemp("mon"), None)
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="module")
def subscriber(engine):
    sub = Subscriber(engine.monitor_endpoint)
    yield sub
    sub.close()


@module_loop
async def test_lifecycle_in_order_and_loads_are_the_engines(engine, subscriber):
    """Six requests (two wait for a slot, long prompts are chunked) and one refused at
    submission: every message decodes as plain msgpack with the documented keys, no seq
    gap, each request's transitions in order with the numbers its stream saw, and the load
    messages are the engine's snapshots, their step token counts adding up to the work."""
    await subscriber.wait_for(lambda m: isinstance(m, schema.Load))  # connected
    engine_loads: list[LoadSnapshot] = [engine.load()]  # idle: a heartbeat repeats it
    engine.scheduler.load_listeners.append(engine_loads.append)
    start = len(subscriber.messages)
    prompts = [[100 + i] * (3 + 9 * i) for i in range(6)]  # 3..48 tokens: some are chunked
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    streams = [engine.generate(p, params, request_id=f"client-{i}") for i, p in enumerate(prompts)]
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([1] * 300, params, request_id="too-long")
    finals = []
    for stream in streams:
        events = await asyncio.wait_for(drain(stream), 60)
        assert isinstance(events[-1], FinishedEvent)
        finals.append((stream.request_ids[0], events[-1]))
    await subscriber.wait_for(
        lambda m: (
            isinstance(m, schema.Load)
            and m.running == 0
            and m.steps_total == engine.scheduler.metrics.steps_total
        )
    )

    # Plain msgpack maps carry exactly the documented keys, `kind` first.
    for topic, raw, typed in subscriber.messages:
        assert list(raw) == ["kind", *COMMON, *type(typed).__struct_fields__[3:]]
        assert (
            raw["kind"] == type(typed).__struct_config__.tag
            and raw["schema_version"] == schema.SCHEMA_VERSION
        )
        assert topic == schema.TOPICS[type(typed)]
    # No message lost: seq has no gap on any topic.
    for topic in (b"load", b"request"):
        seqs = [d["seq"] for t, d, _ in subscriber.messages if t == topic]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), topic

    events = subscriber.typed(
        schema.Queued
        | schema.Admitted
        | schema.FirstToken
        | schema.Finished
        | schema.Rejected
        | schema.Dropped
    )
    for i, ((rid, fin), prompt) in enumerate(zip(finals, prompts, strict=True)):
        mine = [e for e in events if getattr(e, "request_id", None) == rid]
        assert [e.__struct_config__.tag for e in mine] == [
            "queued",
            "admitted",
            "first_token",
            "finished",
        ]
        queued, admitted, first, finished = mine
        assert (queued.client_id, queued.prompt_tokens, queued.max_tokens) == (
            f"client-{i}",
            len(prompt),
            8,
        )
        assert (finished.reason, finished.prompt_tokens, finished.output_tokens) == (
            fin.reason,
            fin.prompt_tokens,
            fin.output_tokens,
        )
        assert 0 <= admitted.queue_s <= first.ttft_s == finished.ttft_s <= finished.e2e_s
    (rejected,) = [e for e in events if isinstance(e, schema.Rejected)]
    assert (rejected.request_id, rejected.client_id, rejected.reason) == (
        None,
        "too-long",
        "invalid",
    )
    assert "max_model_len" in rejected.message

    # Loads: each is one of the engine's snapshots (a heartbeat: with step_* zero), every
    # snapshot after a step went out, and the step token counts add up to the work done.
    wire = [m for _, _, m in subscriber.messages[start:] if isinstance(m, schema.Load)]
    for m in wire:
        matches = [s for s in engine_loads if step_free(s) == step_free(m)]
        assert matches, m
        if m.step_decode_tokens or m.step_prefill_tokens:
            assert any(
                (s.step_prefill_tokens, s.step_decode_tokens, s.step_duration_s)
                == (m.step_prefill_tokens, m.step_decode_tokens, m.step_duration_s)
                for s in matches
            )
    stepped = [s for s in engine_loads if s.step_prefill_tokens or s.step_decode_tokens]
    wire_stepped = [m for m in wire if m.step_prefill_tokens or m.step_decode_tokens]
    assert [m.steps_total for m in wire_stepped] == [s.steps_total for s in stepped]
    assert sum(m.step_prefill_tokens for m in wire_stepped) == sum(len(p) for p in prompts)
    assert sum(m.step_decode_tokens for m in wire_stepped) == len(prompts) * (8 - 1)
    assert max(m.running for m in wire) == 4  # max_num_seqs: two waited
    assert max(m.waiting for m in wire) >= 2
    last = wire[-1]
    assert step_free(last) == step_free(engine.load())
    assert (last.state, last.running, last.waiting, last.free_slots, last.free_blocks) == (
        "serving",
        0,
        0,
        last.num_slots,
        last.num_blocks,
    )
    assert last.generation_tokens_total - engine_loads[0].generation_tokens_total == 8 * len(
        prompts
    )
    engine.scheduler.load_listeners.remove(engine_loads.append)


@module_loop
async def test_fatal_fault_poisoned_then_dead_load_then_terminal(tiny_model_dir, tmp_path):
    """Rank 0 dies inside step FATAL_STEP with a request running (its own engine: the
    module's serves the other tests whatever their order)."""
    fault = FaultPlan(rank=0, kind="die_mid_step", at_step=FATAL_STEP)
    engine = await start_engine(tiny_model_dir, tmp_path, fault)
    subscriber = Subscriber(engine.monitor_endpoint)
    try:
        await fatal_fault_seen(engine, subscriber)
    finally:
        subscriber.close()
        await engine.shutdown()


async def fatal_fault_seen(engine: AsyncEngine, subscriber: Subscriber) -> None:
    await subscriber.wait_for(lambda m: isinstance(m, schema.Load))  # connected
    stream = engine.generate(
        [5, 6, 7], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    )
    events = await asyncio.wait_for(drain(stream), 60)
    assert isinstance(events[-1], ErrorEvent) and all(
        isinstance(e, TokenEvent) for e in events[:-1]
    )
    await subscriber.wait_for(lambda m: isinstance(m, schema.Terminal))
    msgs = subscriber.typed()
    kinds = [m.__struct_config__.tag for m in msgs]
    poisoned = kinds.index("poisoned")
    dead = next(i for i, m in enumerate(msgs) if isinstance(m, schema.Load) and m.state == "dead")
    terminal = kinds.index("terminal")
    assert poisoned < dead < terminal and kinds.count("terminal") == 1
    assert "rank 0" in msgs[poisoned].reason and msgs[terminal].reason == msgs[poisoned].reason
    assert all(m.state != "dead" for m in msgs[:dead] if isinstance(m, schema.Load))
    d = msgs[dead]
    assert (d.running, d.waiting, d.free_slots, d.free_blocks) == (0, 0, d.num_slots, d.num_blocks)
    rid = stream.request_ids[0]
    mine = [m for m in msgs if getattr(m, "request_id", None) == rid]
    assert [m.__struct_config__.tag for m in mine] == [
        "queued",
        "admitted",
        "first_token",
        "dropped",
    ]
    assert mine[-1].output_tokens == len(events) - 1 and "rank 0" in mine[-1].message
    assert poisoned < msgs.index(mine[-1]) < dead
    await engine.shutdown()
    await subscriber.wait_for(lambda m: isinstance(m, schema.ShutDown), 10)
    assert isinstance(subscriber.typed()[-1], schema.ShutDown)


@module_loop
async def test_a_subscriber_that_never_reads_does_not_slow_publishing(tmp_path):
    """200k load messages with a stalled subscriber connected: every send returns at once
    (NOBLOCK; PUB drops at the high-water mark) and what the subscriber can read later is
    bounded by the queues, not the number sent."""
    publisher = MonitorPublisher(f"ipc://{tmp_path}/pub", heartbeat_s=60.0)
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 100)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(publisher.endpoint)
    try:
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        base = LoadSnapshot(
            running=3,
            waiting=1,
            free_slots=1,
            free_blocks=10,
            num_slots=4,
            num_blocks=64,
            steps_total=0,
            step_decode_tokens=3,
        )
        n = 200_000
        snaps = [msgspec.structs.replace(base, steps_total=i + 1) for i in range(n)]
        t0 = time.perf_counter()
        for s in snaps:
            publisher.on_load(s)  # a blocking send would hang here once the queues are full
        per_message_us = (time.perf_counter() - t0) / n * 1e6
        assert per_message_us < 50, per_message_us
        await asyncio.sleep(0.3)
        received = 0
        while stalled.poll(200):
            stalled.recv_multipart()
            received += 1
        assert 0 < received < n // 4, received  # dropped, not queued for it
    finally:
        stalled.close(linger=0)
        ctx.term()
        await publisher.aclose()


@module_loop
async def test_deltaserve_monitor_json_against_a_live_server(tiny_model_dir):
    serve = await asyncio.create_subprocess_exec(
        DELTASERVE,
        "serve",
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--port",
        "0",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "64",
        "--max-num-seqs",
        "4",
        stderr=asyncio.subprocess.PIPE,
    )
    monitor = None
    log: list[str] = []
    ready = asyncio.get_running_loop().create_future()

    async def read_log() -> None:  # all of it, so that the pipe never fills
        async for raw in serve.stderr:
            log.append(raw.decode())
            m = re.search(
                r"ready: serving .* at (http://[\d.]+:\d+)/v1 .*monitor: (ipc://\S+)\)", log[-1]
            )
            if m and not ready.done():
                ready.set_result(m.groups())
        if not ready.done():
            ready.set_exception(AssertionError("serve exited:\n" + "".join(log)))

    reader = asyncio.ensure_future(read_log())
    try:
        url, endpoint = await asyncio.wait_for(ready, 120)
        folder = os.path.dirname(endpoint.removeprefix("ipc://"))
        assert (
            stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and os.stat(folder).st_uid == os.getuid()
        )
        monitor = await asyncio.create_subprocess_exec(
            DELTASERVE,
            "monitor",
            endpoint,
            "--json",
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
        messages = []

        async def read_until(predicate) -> None:
            while not messages or not predicate(messages[-1]):
                line = await asyncio.wait_for(monitor.stdout.readline(), 30)
                assert line, "monitor exited"
                messages.append(msgspec.json.decode(line, type=schema.MonitorMessage))

        await read_until(lambda m: isinstance(m, schema.Load))  # heartbeat: attached
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0}
            async with http.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                completion = await r.json()
        await read_until(lambda m: isinstance(m, schema.Finished))
        queued = next(m for m in messages if isinstance(m, schema.Queued))
        assert queued.client_id == completion["id"]
        finished = messages[-1]
        assert (finished.request_id, finished.reason, finished.output_tokens) == (
            queued.request_id,
            "length",
            completion["usage"]["completion_tokens"],
        )
        serve.send_signal(signal.SIGTERM)
        await read_until(lambda m: isinstance(m, schema.ShutDown))
        states = [m.state for m in messages if isinstance(m, schema.Load)]
        changes = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
        assert changes[-3:] == ["serving", "draining", "dead"], states
        assert await asyncio.wait_for(serve.wait(), 30) == 0, "".join(log)
        assert not os.path.exists(endpoint.removeprefix("ipc://"))  # the socket file is gone
        monitor.send_signal(signal.SIGINT)
        # the process's exit (on Python 3.11 wait() also waits for its stdout's end)
        for _ in range(300):
            if monitor.returncode is not None:
                break
            await asyncio.sleep(0.1)
        else:  # its threads' stacks to the test's output (PYTHONFAULTHANDLER), then fail
            monitor.send_signal(signal.SIGABRT)
            await asyncio.sleep(1)
        assert monitor.returncode == 0
    finally:
        for proc in (serve, monitor):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
        await reader


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_monitor_stops_on_a_signal_even_started_with_sigint_ignored(sig, tmp_path):
    """A parent that ignores SIGINT (a shell's background job; in CI, something in the test
    process) passes that on: the monitor must still end on ^C or SIGTERM, with status 0."""
    proc = subprocess.Popen(
        [DELTASERVE, "monitor", f"ipc://{tmp_path}/no-engine", "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        time.sleep(3)  # past its start-up, into its poll loop
        assert proc.poll() is None
        proc.send_signal(sig)
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()


def test_doc_tables_match_the_schema():
    """docs/MONITOR.md has a `### kind` section per message, whose table lists the
    Struct's fields after the common ones, in order; the common table lists those."""
    text = DOC.read_text()
    sections = dict(re.findall(r"^### `(\w+)`\n(.*?)(?=^##|\Z)", text, flags=re.S | re.M))
    keys = {k: re.findall(r"^\| `(\w+)` \|", body, flags=re.M) for k, body in sections.items()}
    messages = schema.MonitorMessage.__args__
    assert set(keys) == {cls.__struct_config__.tag for cls in messages}
    for cls in messages:
        assert cls.__struct_fields__[: len(COMMON)] == COMMON
        assert keys[cls.__struct_config__.tag] == list(cls.__struct_fields__[len(COMMON) :]), cls
    common = re.search(r"Every body carries these keys:\n\n(.*?)\n\n", text, flags=re.S).group(1)
    assert re.findall(r"^\| `(\w+)` \|", common, flags=re.M) == ["kind", *COMMON]


def test_monitor_view_renders_a_session():
    """The live view's model, fed a short session, renders its state, rates and events."""
    from rich.console import Console

    from deltaserve.tools.monitor import MonitorView

    view = MonitorView("ipc:///x")
    t = 1_800_000_000.0
    load = dict(
        running=1,
        waiting=0,
        free_slots=3,
        free_blocks=60,
        num_slots=4,
        num_blocks=64,
        step_prefill_tokens=0,
        step_decode_tokens=1,
        step_duration_s=0.004,
        prompt_tokens_total=5,
    )
    view.update(
        b"replica",
        schema.Ready(
            seq=0,
            time_s=t,
            model="/m/tiny",
            tp_size=2,
            device="cpu",
            num_slots=4,
            num_blocks=64,
            block_size=16,
            max_model_len=256,
            startup_s=3.5,
        ),
    )
    view.update(
        b"load",
        schema.Load(
            seq=0, time_s=t, state="serving", steps_total=1, generation_tokens_total=0, **load
        ),
    )
    view.update(
        b"load",
        schema.Load(
            seq=3,
            time_s=t + 2,
            state="serving",
            steps_total=50,
            generation_tokens_total=100,
            **load,
        ),
    )
    view.update(
        b"request",
        schema.Finished(
            seq=0,
            time_s=t + 2,
            request_id=7,
            reason="stop",
            prompt_tokens=5,
            output_tokens=9,
            ttft_s=0.02,
            e2e_s=0.3,
        ),
    )
    view.update(b"replica", schema.Poisoned(seq=1, time_s=t + 3, reason="rank 1 died"))
    assert view.num_lost == 2 and view.rates() == (50.0, 0.0)
    console = Console(record=True, width=150)
    console.print(view.render())
    text = console.export_text()
    for expected in (
        "serving",
        "/m/tiny",
        "lost 2",
        "1/4",
        "0p+1d 4.0 ms",
        "50.0",
        "#7 stop: 5+9 tokens",
        "poisoned  rank 1 died",
        "stop 1",
    ):
        assert expected in text, (expected, text)
    # A time no clock shows is listed, not a crash; heartbeats missing: the view says so.
    view.update(b"replica", schema.Terminal(seq=2, time_s=float("nan"), reason="x"))
    view.last_message_s -= 10
    console.print(view.render())
    text = console.export_text()
    assert "time nan" in text and "silent for 10 s (was serving)" in text, text


def test_monitor_says_when_nothing_is_at_its_ipc_path(tmp_path):
    """`deltaserve monitor ipc://WRONG` waited in silence (zmq connects to a path that does not
    exist yet and waits); it now says what it waits for, and still waits (an engine may bind
    the path later)."""
    endpoint = f"ipc://{tmp_path}/nowhere"
    with subprocess.Popen(
        [sys.executable, "-m", "deltaserve.tools.cli", "monitor", endpoint, "--json"],
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            line = proc.stderr.readline()
            assert f"nothing at {tmp_path}/nowhere yet: waiting for an engine" in line, line
            assert proc.poll() is None  # still waiting
        finally:
            proc.kill()
