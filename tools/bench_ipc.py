"""Control-plane round trip: `python -m tools.bench_ipc [--tp 1,2] [--sizes 1,64,256]`.

For each TP size and step size (decode items, one token each, all sampling) it times
`ReplicaController.run_step` against ranks with a no-op executor: plan check, encode, send
to every rank, gate receipt and release, no-op execute, replies, decode and validation.
In the same run it times the raw ZeroMQ round trip with the same socket kinds (PUSH per rank,
one PULL), the same event-loop integration and the same bytes each way (the command frame
out, rank 0's StepResult frame and the others' Ack frames back), with echo processes that
decode nothing. Writes JSON to bench/results/ with the command, hardware and figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq
import zmq.asyncio

from deltaserve.ipc.channels import PullChannel, PushChannel, ipc_endpoint
from deltaserve.ipc.controller import ReplicaConfig, ReplicaController
from deltaserve.ipc.messages import (
    Ack,
    ExecutorConfig,
    RunUnifiedStep,
    Sample,
    SampleColumns,
    StepItem,
    StepResult,
    command_encoder,
)
from deltaserve.tools.hardware import host_info

SETUP = b"SETUP"
QUIT = b"QUIT"


def decode_items(n: int) -> list[StepItem]:
    return [
        StepItem(request_id=i, start=100 + i, token_ids=[1000 + i], sample=True) for i in range(n)
    ]


def noop_result(n: int) -> StepResult:
    """Rank 0's reply to `decode_items(n)` from the no-op executor."""
    return StepResult(0, 1, SampleColumns.from_samples([Sample(i, 0, 0.0, []) for i in range(n)]))


def figures(samples_s: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples_s)
    return {
        "median_us": round(statistics.median(us), 1),
        "p90_us": round(us[int(0.9 * (len(us) - 1))], 1),
        "n": len(us),
    }


async def time_controller(
    model_dir: str, tp: int, sizes: list[int], iters: int, warmup: int
) -> dict[int, dict]:
    controller = await ReplicaController.start(
        ReplicaConfig(
            ExecutorConfig(model_dir, tp_size=tp, max_num_seqs=8, num_kv_blocks=256),
            noop_executor=True,
        )
    )
    out = {}
    try:
        for n in sizes:
            items = decode_items(n)
            samples = []
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                result = await controller.run_step(items)
                if i >= warmup:
                    samples.append(time.perf_counter() - t0)
            if len(result) != n:
                raise RuntimeError(f"expected {n} samples, got {len(result)}")
            out[n] = figures(samples)
    finally:
        await controller.shutdown()
    return out


async def time_raw(
    tp: int, sizes: list[int], iters: int, warmup: int, zmq_asyncio: bool = False
) -> dict[int, dict]:
    """Raw round trips; replies are read as the controller reads them (one loop callback
    drains the socket), or with zmq.asyncio's awaited recv for comparison."""
    loop = asyncio.get_running_loop()
    run_dir = tempfile.mkdtemp(prefix="deltaserve-bench-")
    ctx = zmq.Context(io_threads=1)
    pushes = [PushChannel(ctx, ipc_endpoint(run_dir, f"cmd{r}"), bind=True) for r in range(tp)]
    pull = PullChannel(ctx, ipc_endpoint(run_dir, "reply"), bind=True)
    state: dict = {"left": 0, "future": None}

    def on_frame(frame: bytes) -> None:
        state["left"] -= 1
        if state["left"] == 0:
            state["future"].set_result(None)

    if zmq_asyncio:
        apull = zmq.asyncio.Socket.shadow(pull.socket.underlying)
    else:
        pull.watch(loop, on_frame)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "deltaserve.tools.bench_ipc", "--echo", run_dir, str(r)]
        )
        for r in range(tp)
    ]

    async def round_trip(frames: list[bytes]) -> None:
        state["left"], state["future"] = tp, loop.create_future()
        for push, frame in zip(pushes, frames, strict=True):
            while not push.send(frame):  # echo not connected yet (set-up only)
                await asyncio.sleep(0.01)
        if zmq_asyncio:
            for _ in range(tp):
                await apull.recv()
        else:
            await state["future"]

    out = {}
    try:
        for n in sizes:
            frame = command_encoder.encode(RunUnifiedStep(1, decode_items(n)))
            acks = [command_encoder.encode(Ack(r, 1)) for r in range(1, tp)]
            replies = [command_encoder.encode(noop_result(n)), *acks]
            await round_trip([SETUP + reply for reply in replies])
            samples = []
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                await round_trip([frame] * tp)
                if i >= warmup:
                    samples.append(time.perf_counter() - t0)
            out[n] = figures(samples)
    finally:
        for push in pushes:
            push.send(QUIT)
        for proc in procs:
            proc.wait(timeout=10)
        if zmq_asyncio:
            apull.close(linger=0)  # the shadow closes the socket; `ctx` terms below
        pull.close()
        for push in pushes:
            push.close()
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def echo(run_dir: str, rank: int) -> None:
    """Raw rank: reply to every frame with the preset reply bytes, decoding nothing."""
    ctx = zmq.Context(io_threads=1)
    pull = PullChannel(ctx, ipc_endpoint(run_dir, f"cmd{rank}"), bind=False)
    push = PushChannel(ctx, ipc_endpoint(run_dir, "reply"), bind=False, linger_ms=1000)
    reply = b""
    while True:
        frame = pull.socket.recv()
        if frame == QUIT:
            break
        if frame.startswith(SETUP):
            reply = frame[len(SETUP) :]
        push.send(reply)
    pull.close()
    push.close()
    ctx.term()


def frame_bytes(n: int) -> tuple[int, int]:
    command = command_encoder.encode(RunUnifiedStep(1, decode_items(n)))
    reply = command_encoder.encode(noop_result(n))
    return len(command), len(reply)


def hardware() -> dict:
    return {**host_info(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}


async def run(args: argparse.Namespace) -> dict:
    results = []
    for tp in args.tp:
        raw = await time_raw(tp, args.sizes, args.iters, args.warmup)
        ctl = await time_controller(args.model, tp, args.sizes, args.iters, args.warmup)
        raw_aio = await time_raw(tp, args.sizes, args.iters, args.warmup, zmq_asyncio=True)
        for n in args.sizes:
            ratio = ctl[n]["median_us"] / raw[n]["median_us"]
            frames = frame_bytes(n)
            results.append(
                {
                    "tp": tp,
                    "requests": n,
                    "command_bytes": frames[0],
                    "rank0_reply_bytes": frames[1],
                    "controller": ctl[n],
                    "raw_zmq": raw[n],
                    "raw_zmq_asyncio_recv": raw_aio[n],
                    "median_ratio": round(ratio, 2),
                }
            )
            print(
                f"tp={tp} requests={n:4d}  controller median {ctl[n]['median_us']:7.1f} us "
                f"p90 {ctl[n]['p90_us']:7.1f} | raw zmq median {raw[n]['median_us']:7.1f} us "
                f"p90 {raw[n]['p90_us']:7.1f} | x{ratio:.2f} | raw zmq.asyncio median "
                f"{raw_aio[n]['median_us']:7.1f} us",
                flush=True,
            )
    return {"results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256]
    )
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--model",
        default=None,
        help="model dir (only its config.json is read); "
        "default: a tiny checkpoint made in a temp dir",
    )
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--echo", nargs=2, metavar=("RUN_DIR", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo:
        echo(args.echo[0], int(args.echo[1]))
        return
    tmp = None
    if args.model is None:
        tmp = tempfile.mkdtemp(prefix="deltaserve-bench-model-")
        Path(tmp, "config.json").write_text(json.dumps(TINY_CONFIG))
        args.model = tmp
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    hw = hardware()
    try:
        if args.loop == "uvloop":
            import uvloop

            report = uvloop.run(run(args))
        else:
            report = asyncio.run(run(args))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "benchmark": "ipc control-plane round trip (no-op executor) vs raw ZeroMQ",
        "command": " ".join(["python -m tools.bench_ipc", *sys.argv[1:]]),
        "target": "median under 5x the raw round trip and under 300 us at 256 requests, TP=2",
        "started": started,
        "hardware": hw,
        "loop": args.loop,
        "iters": args.iters,
        "warmup": args.warmup,
        **report,
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_ipc-{started.replace(':', '')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


# Only the shape the controller checks before spawning (vocab for plan checks, heads for TP).
TINY_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": True,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}


if __name__ == "__main__":
    main()
