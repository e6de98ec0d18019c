"""Does a monitor slow the engine? `python -m deltaserve.tools.bench_monitor [--out FILE]`.

In one run, two engines on the same checkpoint: A with no monitor publisher (as before
monitors existed), B with one and a subscriber connected to every topic that never reads.
Before the measured rounds both serve `--fill-requests` one-token requests (on B, four
lifecycle messages each), so that the stalled subscriber's queues are full and PUB drops for
it from then on, and both engines have the same history: the rounds measure that state (the
JSON gives messages published vs readable). Rounds alternate A and B (order flipped every
round) on the same workload: `--requests` greedy requests submitted at once, `--max-tokens`
each; per round: steps/s, generated tokens/s, mean step time, the engine process's CPU time
per step (event loop and ZeroMQ threads; not the ranks) and the tick's overhead per step
(wall time per step minus the dispatch-to-replies time: what the event loop adds, where
publishing happens, and independent of how fast the ranks are). Default checkpoint:
the tiny preset (made for the run), whose steps are short: the tick's own cost, where
publishing happens, is as large a share of a step as it gets.

Then B alone, rounds alternating: no subscriber, and a new one that never reads, its queues
filled (through B's publisher) before the round: same engine, same history, so only the
stalled subscriber differs. Last: microseconds per published message with the stalled subscriber
(load and lifecycle), and the scheduler hook's cost with no listener. Writes JSON with the command
and hardware to `--out` (default bench/results/monitor_<device>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import Lifecycle, LoadSnapshot
from deltaserve.engine.monitor import MonitorPublisher
from deltaserve.engine.request import Request
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.tools.hardware import host_info

PROMPT_TOKENS = 32


def hardware() -> dict:
    import torch

    return {
        **host_info(),
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": msgspec.__version__,
    }


async def workload(engine: AsyncEngine, requests: int, max_tokens: int, vocab: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % vocab for j in range(PROMPT_TOKENS)] for i in range(requests)]
    step_s: list[float] = []  # dispatch to replies, per step: the ranks' share of a step

    def on_load(snapshot: LoadSnapshot) -> None:
        if snapshot.step_decode_tokens or snapshot.step_prefill_tokens:
            step_s.append(snapshot.step_duration_s)

    steps0 = engine.scheduler.steps_total
    engine.scheduler.load_listeners.insert(0, on_load)
    cpu0 = time.process_time()  # this process: event loop + ZeroMQ I/O threads, not the ranks
    t0 = time.perf_counter()
    streams = [engine.generate(p, params) for p in prompts]
    tokens = 0
    for stream in streams:
        async for event in stream:
            tokens += hasattr(event, "token_id")
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    engine.scheduler.load_listeners.remove(on_load)
    steps = engine.scheduler.steps_total - steps0
    if tokens != requests * max_tokens:
        raise RuntimeError(f"expected {requests * max_tokens} tokens, got {tokens}")
    return {
        "wall_s": round(wall, 4),
        "steps": steps,
        "steps_per_s": round(steps / wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "mean_step_ms": round(wall / steps * 1e3, 3),
        "engine_cpu_ms_per_step": round(cpu / steps * 1e3, 4),
        "tick_overhead_ms_per_step": round((wall / steps - statistics.mean(step_s)) * 1e3, 4),
    }


async def fill(engine: AsyncEngine, requests: int, vocab: int) -> None:
    """Many short requests (4 lifecycle messages each), in waves under the queue bound."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    wave = min(requests, engine.config.max_queued_requests)
    for start in range(0, requests, wave):
        streams = [engine.generate([(start + i) % vocab] * 4, params) for i in range(wave)]
        for stream in streams:
            async for _ in stream:
                pass


def stalled_subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 10)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def count_readable(sock: zmq.Socket) -> int:
    n = 0
    while sock.poll(200):
        sock.recv_multipart()
        n += 1
    return n


async def engine_rounds(args: argparse.Namespace, model: str, vocab: int) -> dict:
    base = dict(
        model=model,
        device=args.device,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(512, args.requests),
        max_model_len=PROMPT_TOKENS + args.max_tokens + 16,
        startup_timeout_s=180.0,
    )
    plain = await AsyncEngine.start(EngineConfig(**base))
    monitored = await AsyncEngine.start(EngineConfig(**base, monitor_endpoint="auto"))
    ctx = zmq.Context()
    sub = stalled_subscriber(ctx, monitored.monitor_endpoint)
    engines = {"no_monitor": plain, "monitor_stalled_subscriber": monitored}
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        await asyncio.sleep(0.5)  # the subscription reaches the publisher
        for engine in engines.values():
            await fill(engine, args.fill_requests, vocab)
        for engine in engines.values():  # warm-up
            await workload(engine, args.requests, args.max_tokens, vocab)
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                fig = await workload(engines[name], args.requests, args.max_tokens, vocab)
                rounds[name].append(fig)
                print(
                    f"round {r} {name:28s} {fig['steps_per_s']:8.1f} steps/s "
                    f"{fig['tokens_per_s']:9.1f} tok/s  step {fig['mean_step_ms']:.3f} ms  engine "
                    f"cpu {fig['engine_cpu_ms_per_step']:.3f} ms/step, tick overhead "
                    f"{fig['tick_overhead_ms_per_step']:.3f} ms/step",
                    flush=True,
                )
        published = monitored._monitor.num_published  # the publisher's own count
        readable = count_readable(sub)
        sub.close()
        same_engine = await same_engine_rounds(monitored, ctx, args, vocab)
    finally:
        sub.close()
        ctx.term()
        await plain.shutdown()
        await monitored.shutdown()
    summary = summarize(rounds)
    a, b = summary["no_monitor"], summary["monitor_stalled_subscriber"]
    ratio = b["median_steps_per_s"] / a["median_steps_per_s"]
    cpu_delta = b["median_engine_cpu_ms_per_step"] - a["median_engine_cpu_ms_per_step"]
    tick_delta = b["median_tick_overhead_ms_per_step"] - a["median_tick_overhead_ms_per_step"]
    return {
        "rounds": rounds,
        "summary": summary,
        "monitored_over_plain_steps_per_s": round(ratio, 4),
        "monitor_engine_cpu_ms_per_step": round(cpu_delta, 4),
        "monitor_tick_overhead_ms_per_step": round(tick_delta, 4),
        "stalled_subscriber": {
            "messages_published": published,
            "readable_after_run": readable,
        },
        "same_engine": same_engine,
    }


async def same_engine_rounds(
    engine: AsyncEngine, ctx: zmq.Context, args: argparse.Namespace, vocab: int
) -> dict:
    """The monitored engine alone, rounds alternating: no subscriber, and a fresh subscriber
    that never reads, its queues filled first by 30,000 messages through the engine's own
    publisher. Same engine, same history: only the stalled subscriber differs."""
    req = Request(
        request_id=0,
        index=0,
        prompt_ids=(1,),
        params=SamplingParams(),
        seed=0,
        arrival_time_s=time.monotonic(),
    )
    filler = Lifecycle("admitted", time.monotonic(), req)
    rounds: dict[str, list[dict]] = {"no_subscriber": [], "stalled_full_subscriber": []}
    for r in range(args.rounds):
        order = list(rounds) if r % 2 == 0 else list(reversed(rounds))
        for name in order:
            sub = None
            if name == "stalled_full_subscriber":
                sub = stalled_subscriber(ctx, engine.monitor_endpoint)
                await asyncio.sleep(0.3)  # subscribed
                for _ in range(30_000):
                    engine._monitor.on_lifecycle(filler)
                await asyncio.sleep(0.2)
            fig = await workload(engine, args.requests, args.max_tokens, vocab)
            if sub is not None:
                fig["readable_after_round"] = count_readable(sub)
                sub.close()
            rounds[name].append(fig)
            print(
                f"same engine, round {r} {name:24s} step {fig['mean_step_ms']:.3f} ms  engine cpu "
                f"{fig['engine_cpu_ms_per_step']:.3f} ms/step, tick overhead "
                f"{fig['tick_overhead_ms_per_step']:.3f} ms/step",
                flush=True,
            )
    return {"rounds": rounds, "summary": summarize(rounds)}


def summarize(rounds: dict[str, list[dict]]) -> dict:
    summary = {}
    for name, figs in rounds.items():
        summary[name] = {
            "median_steps_per_s": statistics.median(f["steps_per_s"] for f in figs),
            "median_tokens_per_s": statistics.median(f["tokens_per_s"] for f in figs),
            "median_step_ms": statistics.median(f["mean_step_ms"] for f in figs),
            "median_engine_cpu_ms_per_step": statistics.median(
                f["engine_cpu_ms_per_step"] for f in figs
            ),
            "median_tick_overhead_ms_per_step": statistics.median(
                f["tick_overhead_ms_per_step"] for f in figs
            ),
        }
    return summary


async def publish_costs(n: int) -> dict:
    """Microseconds per message with a stalled subscriber; the no-listener hook in ns."""
    run_dir = tempfile.mkdtemp(prefix="deltaserve-bench-")
    publisher = MonitorPublisher(f"ipc://{run_dir}/pub", heartbeat_s=3600.0)
    ctx = zmq.Context()
    sub = stalled_subscriber(ctx, publisher.endpoint)
    await asyncio.sleep(0.3)
    try:
        snap = LoadSnapshot(
            running=16,
            waiting=3,
            free_slots=0,
            free_blocks=100,
            num_slots=16,
            num_blocks=400,
            steps_total=0,
            step_decode_tokens=16,
        )
        snaps = [msgspec.structs.replace(snap, steps_total=i + 1) for i in range(n)]
        t0 = time.perf_counter()
        for s in snaps:
            publisher.on_load(s)
        load_us = (time.perf_counter() - t0) / n * 1e6
        req = Request(
            request_id=1,
            index=0,
            prompt_ids=tuple(range(32)),
            params=SamplingParams(),
            seed=0,
            arrival_time_s=time.monotonic(),
        )
        req.first_token_time_s = req.arrival_time_s + 0.01
        event = Lifecycle("finished", time.monotonic(), req, "client", "length")
        t0 = time.perf_counter()
        for _ in range(n):
            publisher.on_lifecycle(event)
        finished_us = (time.perf_counter() - t0) / n * 1e6
        readable = count_readable(sub)
    finally:
        sub.close()
        ctx.term()
        await publisher.aclose()
    return {
        "messages": n,
        "load_us_per_message": round(load_us, 2),
        "finished_us_per_message": round(finished_us, 2),
        "readable_by_stalled_subscriber": readable,
        "no_listener_notify_ns": round(await notify_cost_ns(n), 1),
    }


async def notify_cost_ns(n: int) -> float:
    """Scheduler._notify with no lifecycle listener (the tick's cost without a monitor)."""
    from deltaserve.engine.scheduler import Scheduler

    class _Controller:  # only what Scheduler.__init__ reads
        num_slots, num_blocks, block_size = 4, 64, 16

    from deltaserve.engine.planner import StepBudget

    sched = Scheduler(_Controller(), None, frozenset(), StepBudget(64, 4), 256)
    t0 = time.perf_counter()
    for _ in range(n):
        sched._notify("admitted")
    return (time.perf_counter() - t0) / n * 1e9


def default_model() -> str:
    from deltaserve.tools.make_model import make_model

    out = Path(tempfile.mkdtemp(prefix="deltaserve-bench-model-"))
    return str(make_model(out, preset="tiny", dtype="fp32", seed=0))


async def run(args: argparse.Namespace) -> dict:
    model = args.model or default_model()
    vocab = json.loads((Path(model) / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    engine = await engine_rounds(args, model, vocab)
    micro = await publish_costs(args.micro_messages)
    print(
        f"monitored / plain steps/s (medians): {engine['monitored_over_plain_steps_per_s']:.4f}; "
        f"per step, monitored - plain: engine cpu {engine['monitor_engine_cpu_ms_per_step']:.4f} "
        f"ms, tick overhead {engine['monitor_tick_overhead_ms_per_step']:.4f} ms"
    )
    same = engine["same_engine"]["summary"]
    print(
        "same engine, tick overhead ms/step (medians): no subscriber "
        f"{same['no_subscriber']['median_tick_overhead_ms_per_step']:.4f}, stalled full subscriber "
        f"{same['stalled_full_subscriber']['median_tick_overhead_ms_per_step']:.4f}"
    )
    print(
        f"publish: load {micro['load_us_per_message']} us/msg, finished "
        f"{micro['finished_us_per_message']} us/msg; no-listener hook "
        f"{micro['no_listener_notify_ns']} ns"
    )
    return {
        "model": model if args.model else "tiny preset, fp32 (made for this run)",
        "engine": engine,
        "publisher": micro,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_monitor", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint; default: the tiny preset")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--fill-requests",
        type=int,
        default=4000,
        help="one-token requests each engine serves first (fills B's stalled queues)",
    )
    p.add_argument("--micro-messages", type=int, default=100_000)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    hw = hardware()
    figures = asyncio.run(run(args))
    result = {
        "command": " ".join(
            [
                Path(sys.executable).name,
                "-m",
                "deltaserve.tools.bench_monitor",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "date_utc": started,
        "hardware": hw,
        "conditions": {
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "prompt_tokens": PROMPT_TOKENS,
            "rounds": args.rounds,
            "device": args.device,
            "fill_requests": args.fill_requests,
            "stalled_subscriber": "SUB to every topic, RCVHWM 10, never reads",
        },
        **figures,
    }
    out = Path(args.out or f"bench/results/monitor_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
