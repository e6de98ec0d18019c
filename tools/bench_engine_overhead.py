"""The engine's own time per step, without a model: `python -m tools.bench_engine_overhead
--model DIR [--streams 1 64] [--step-ms 2] [--pipelining on off] [--out DIR]`.

AsyncEngine as users run it (tokenizer, scheduler, controller, real rank processes, real
sockets and gate), except that every rank runs the no-op executor (ipc/noop_executor.py),
which sleeps `--step-ms` per step as a stand-in for the GPU's forward. `streams` greedy
requests decode together (ignore_eos); the time per step beyond `--step-ms` is what the
engine adds, and the step trace (ipc/step_trace.py) splits it into hops. DIR needs only a
config and a tokenizer (any checkpoint folder of tools.make_model will do).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from deltaserve.ipc.replica_config import ReplicaConfig
from deltaserve.tools.hardware import host_info


async def run_streams(
    model: str, streams: int, step_s: float, new_tokens: int, pipeline: bool = True
) -> dict:
    import deltaserve.engine.async_engine as async_engine
    from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams

    # the engine derives its replica's config itself: have it ask for no-op ranks
    real = async_engine.replica_config

    def noop_replica(*args: object) -> ReplicaConfig:
        return dataclasses.replace(real(*args), noop_executor=True, noop_step_s=step_s)

    async_engine.replica_config = noop_replica
    try:
        config = EngineConfig(
            model=model,
            device="cpu",
            max_num_seqs=streams,
            max_model_len=64 + new_tokens,
            async_scheduling=pipeline,
        )
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        async with await AsyncEngine.start(config) as engine:

            async def one(i: int) -> None:
                async for _ in engine.generate(list(range(5 + i, 21 + i)), params):
                    pass

            await asyncio.gather(*(one(i) for i in range(streams)))  # warm-up
            m = engine.metrics
            steps0, sched0, t0 = m.steps_total, m.scheduler_seconds_total, time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(streams)))
            elapsed, steps = time.perf_counter() - t0, m.steps_total - steps0
            return {
                "streams": streams,
                "pipelined": pipeline,
                "step_ms": elapsed / steps * 1e3,
                "steps": steps,
                "engine_overhead_ms": elapsed / steps * 1e3 - step_s * 1e3,
                "scheduler_ms": (m.scheduler_seconds_total - sched0) / steps * 1e3,
            }
    finally:
        async_engine.replica_config = real


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--step-ms", type=float, default=2.0, help="the no-op executor's sleep per step"
    )
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument(
        "--pipelining",
        nargs="+",
        choices=["on", "off"],
        default=["on", "off"],
        help="engine runs with pipelined steps, without, or both",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON report")
    args = parser.parse_args(argv)
    from deltaserve.ipc import step_trace
    from deltaserve.tools.step_trace import hop_table, load

    rows = []
    for streams in args.streams:
        for mode in args.pipelining:
            with tempfile.TemporaryDirectory() as trace_dir:
                # ranks read the variable
                step_trace.TRACE_DIR = os.environ["DELTASERVE_STEP_TRACE"] = trace_dir
                row = asyncio.run(
                    run_streams(
                        args.model, streams, args.step_ms / 1e3, args.new_tokens, mode == "on"
                    )
                )
                row["hops_us"] = hop_table(load(Path(trace_dir))).get(streams, {})
            rows.append(row)
            print(
                f"streams {streams:3d}, pipelining {mode:3s}: {row['step_ms']:.3f} ms per step "
                f"with {args.step_ms} ms of (slept) model work: the engine adds "
                f"{row['engine_overhead_ms']:.3f} ms ({row['scheduler_ms']:.3f} ms scheduler)"
            )
            for hop, us in row["hops_us"].items():
                if hop != "steps":
                    print(f"    {hop:32s} {us:9.1f} us")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"engine_overhead-{time.strftime('%Y-%m-%dT%H%M%S')}.json"
        report = {
            "command": " ".join(["python -m tools.bench_engine_overhead", *sys.argv[1:]]),
            "hardware": host_info(),
            "rows": rows,
        }
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
