"""Prefix caching, measured: the same two workloads through `AsyncEngine` with it off and on.

- conversation: `--turns` turns, one at a time; a turn's prompt is the last turn's prompt, its
  answer and `--turn-len` new tokens (token ids, so nothing is re-tokenized); the first turn
  has `--first-len` tokens. Time to first token per turn.
- shared prefix: `--shared-requests` prompts of one `--shared-len`-token prefix and
  `--suffix-len` tokens of their own, `--concurrency` at a time, after one warm-up that has
  only the prefix's tokens in common with them. Time to first token and wall time.
- parallel sampling: one call of `--n` choices (seeded, temperature 1) of a fresh
  `--shared-len`-token prompt: time to every choice's first token, and wall time.
Greedy with ignore_eos (but the parallel sampling), `--output-len` tokens each; the answers of the
two runs are compared token by token. In bf16 a prefill split elsewhere rounds differently, and on
random weights a greedy answer parts at the first token it tips: so a third run, prefix caching off
and prompts chunked by `--baseline-chunk` tokens, measures how much that alone changes the answers.

    python -m tools.bench_prefix --model DIR --device cuda --out bench/results/prefix_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import FinishedEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.tools.hardware import host_info


async def timed(engine: AsyncEngine, prompt: list[int], output_len: int) -> dict[str, Any]:
    """One request: its answer, time to first token and cached prompt tokens."""
    start = time.perf_counter()
    first, tokens, cached = None, [], 0
    async for event in engine.generate(
        prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter() - start
            tokens.append(event.token_id)
        elif isinstance(event, FinishedEvent):
            cached = event.cached_tokens
        else:
            raise RuntimeError(f"request failed: {event}")
    return {
        "ttft_s": first,
        "e2e_s": time.perf_counter() - start,
        "tokens": tokens,
        "cached": cached,
        "prompt_len": len(prompt),
    }


async def conversation(
    engine: AsyncEngine, args: argparse.Namespace, rng: random.Random
) -> list[dict]:
    prompt = [rng.randrange(1000, 100_000) for _ in range(args.first_len)]
    turns = []
    for _ in range(args.turns):
        turn = await timed(engine, prompt, args.output_len)
        turns.append(turn)
        prompt = (
            prompt + turn["tokens"] + [rng.randrange(1000, 100_000) for _ in range(args.turn_len)]
        )
    return turns


async def shared_prefix(
    engine: AsyncEngine, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    prefix = [rng.randrange(1000, 100_000) for _ in range(args.shared_len)]

    def own() -> list[int]:
        return prefix + [rng.randrange(1000, 100_000) for _ in range(args.suffix_len)]

    await timed(engine, own(), args.output_len)  # warm-up: the first to show the prefix
    prompts = [own() for _ in range(args.shared_requests)]
    limit = asyncio.Semaphore(args.concurrency)

    async def one(p: list[int]) -> dict[str, Any]:
        async with limit:
            return await timed(engine, p, args.output_len)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return {"wall_s": time.perf_counter() - start, "requests": results}


async def parallel_sampling(
    engine: AsyncEngine, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    prompt = [rng.randrange(1000, 100_000) for _ in range(args.shared_len)]
    params = SamplingParams(
        max_tokens=args.output_len, temperature=1.0, seed=args.seed, n=args.n, ignore_eos=True
    )
    start, firsts, cached = time.perf_counter(), {}, []
    async for event in engine.generate(prompt, params):
        if isinstance(event, TokenEvent):
            firsts.setdefault(event.index, time.perf_counter() - start)
        elif isinstance(event, FinishedEvent):
            cached.append(event.cached_tokens)
        else:
            raise RuntimeError(f"request failed: {event}")
    return {
        "n": args.n,
        "last_first_token_s": max(firsts.values()),
        "wall_s": time.perf_counter() - start,
        "cached": sorted(cached),
    }


async def run(args: argparse.Namespace, enable: bool, chunk: int | None = None) -> dict[str, Any]:
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.concurrency,
        enable_prefix_caching=enable,
        max_num_batched_tokens=chunk,
    )
    engine = await AsyncEngine.start(config)
    try:
        rng = random.Random(args.seed)
        await timed(engine, [rng.randrange(1000, 100_000) for _ in range(64)], 4)  # compile, warm
        return {
            "conversation": await conversation(engine, args, rng),
            "shared": await shared_prefix(engine, args, rng),
            "parallel": await parallel_sampling(engine, args, rng),
        }
    finally:
        await engine.shutdown()


def same(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Of two runs' answers: the share of equal tokens, and of equal first tokens."""
    out = {}
    for name, ra, rb in (
        ("conversation", a["conversation"], b["conversation"]),
        ("shared", a["shared"]["requests"], b["shared"]["requests"]),
    ):
        pairs = [
            (x, y)
            for u, v in zip(ra, rb, strict=True)
            for x, y in zip(u["tokens"], v["tokens"], strict=True)
        ]
        out[f"{name}_tokens"] = sum(x == y for x, y in pairs) / len(pairs)
        out[f"{name}_first_tokens"] = sum(
            u["tokens"][0] == v["tokens"][0] for u, v in zip(ra, rb, strict=True)
        ) / len(ra)
    return out


def summary(off: dict[str, Any], on: dict[str, Any], chunked: dict[str, Any]) -> dict[str, Any]:
    conv = [
        {
            "turn": i,
            "prompt_len": a["prompt_len"],
            "cached": b["cached"],
            "ttft_off_ms": 1e3 * a["ttft_s"],
            "ttft_on_ms": 1e3 * b["ttft_s"],
            "speedup": a["ttft_s"] / b["ttft_s"],
        }
        for i, (a, b) in enumerate(zip(off["conversation"], on["conversation"], strict=True))
    ]
    shared = {}
    for name, result in (("off", off["shared"]), ("on", on["shared"])):
        ttfts = [1e3 * r["ttft_s"] for r in result["requests"]]
        shared[name] = {
            "wall_s": result["wall_s"],
            "ttft_mean_ms": statistics.mean(ttfts),
            "ttft_median_ms": statistics.median(ttfts),
            "cached_mean": statistics.mean(r["cached"] for r in result["requests"]),
        }
    return {
        "conversation": conv,
        "shared": shared,
        "parallel": {"off": off["parallel"], "on": on["parallel"]},
        "same_off_on": same(off, on),
        "same_off_chunked": same(off, chunked),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=4096)
    p.add_argument("--turn-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--shared-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--shared-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="choices of the parallel-sampling call")
    p.add_argument("--baseline-chunk", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    off = asyncio.run(run(args, False))
    on = asyncio.run(run(args, True))
    chunked = asyncio.run(run(args, False, args.baseline_chunk))
    result = summary(off, on, chunked)
    record = {
        "command": " ".join(["python -m tools.bench_prefix", *sys.argv[1:]]),
        "hardware": host_info(),
        "args": vars(args),
        **result,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(
        f"{'turn':>4} {'prompt':>7} {'cached':>7} {'ttft off ms':>12} {'ttft on ms':>11} {'x':>6}"
    )
    for row in result["conversation"]:
        print(
            f"{row['turn']:>4} {row['prompt_len']:>7} {row['cached']:>7} "
            f"{row['ttft_off_ms']:>12.1f} {row['ttft_on_ms']:>11.1f} {row['speedup']:>6.2f}"
        )
    for name, s in result["shared"].items():
        print(
            f"shared {name}: wall {s['wall_s']:.2f} s, ttft mean {s['ttft_mean_ms']:.1f} ms, "
            f"median {s['ttft_median_ms']:.1f} ms, cached mean {s['cached_mean']:.0f}"
        )
    for name, r in result["parallel"].items():
        print(
            f"parallel sampling {name}: n {r['n']}, every first token after "
            f"{r['last_first_token_s']:.3f} s, wall {r['wall_s']:.2f} s, cached {r['cached']}"
        )
    for name in ("same_off_on", "same_off_chunked"):
        print(name, " ".join(f"{k} {v:.3f}" for k, v in result[name].items()))


if __name__ == "__main__":
    main()
