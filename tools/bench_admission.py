"""How many chat requests without max_tokens run at once, and their output tokens/s, with
admission by what a request needs now (preempting when blocks run out) against whole-lifetime
reservation (`--reserve-lifetime`), in one process, one engine after the other.

    python -m tools.bench_admission --model /tmp/m4b --make-preset 4b --max-model-len 32k \\
        --out bench/results/admission_h100_4b.json                              (GPU)
    python -m tools.bench_admission --model /tmp/tiny --device cpu --max-model-len 512 \\
        --num-kv-blocks 64 --num-requests 8 --input-len 20 --output-len 16 --out /tmp/a.json

Each request is what a chat client sends without max_tokens: its default max_tokens is the
rest of the longest sequence (max_model_len, or the cache if smaller), as the HTTP server sets
it. A random checkpoint never ends by EOS, so each consumer stops reading after its own
length (drawn around `--output-len`; the engine then aborts it), which the engine cannot
know beforehand, as it cannot know where a real model's EOS falls. Reported per mode: the
largest number of requests running at once (the load snapshots'), output tokens/s over the
run, requests finished, preemptions, and the KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from deltaserve.engine.config_flags import human_readable_int
from deltaserve.tools.hardware import git_commit, host_info


async def run_mode(args: argparse.Namespace, reserve_lifetime: bool) -> dict:
    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.events import TokenEvent
    from deltaserve.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        max_queued_requests=args.num_requests,
        max_queued_tokens=args.num_requests * (args.input_len + 1),
        reserve_lifetime=reserve_lifetime,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.kv_cache_dtype != "auto",
    )
    started = time.perf_counter()
    engine = await AsyncEngine.start(config)
    startup_s = time.perf_counter() - started
    running: list[int] = []
    engine.scheduler.load_listeners.append(lambda load: running.append(load.running))
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(
        max(1, int(args.output_len * 0.5)), int(args.output_len * 1.5) + 1, args.num_requests
    )
    prompts = [rng.integers(1000, 200_000, args.input_len).tolist() for _ in lengths]
    longest = engine.longest_sequence

    async def chat(prompt: list[int], length: int) -> int:
        params = SamplingParams(max_tokens=longest - len(prompt), temperature=0.0, ignore_eos=True)
        stream, tokens = engine.generate(prompt, params), 0
        async for event in stream:
            tokens += isinstance(event, TokenEvent)
            if tokens == length:
                await stream.aclose()  # where a real model's EOS would have come
                break
        return tokens

    try:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(
            *(chat(p, int(n)) for p, n in zip(prompts, lengths, strict=True))
        )
        duration = time.perf_counter() - t0
        metrics, load = engine.metrics, engine.load()
    finally:
        await engine.shutdown()
    return {
        "reserve_lifetime": reserve_lifetime,
        "startup_s": startup_s,
        "duration_s": duration,
        "requests": len(tokens),
        "output_tokens": int(sum(tokens)),
        "output_tokens_per_s": sum(tokens) / duration,
        "max_concurrency": max(running),
        "preemptions": metrics.num_preemptions_total,
        "num_kv_blocks": load.num_blocks,
        "num_slots": load.num_slots,
        "longest_sequence": longest,
        "default_max_tokens": longest - args.input_len,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--make-preset", default=None, help="make a random checkpoint there first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=human_readable_int, default=32768)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: what memory allows")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens of each chat")
    p.add_argument("--output-len", type=int, default=512, help="mean tokens read of each")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--modes", nargs="+", choices=("lifetime", "present"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON result path")
    args = p.parse_args(argv)
    if args.make_preset and not (Path(args.model) / "config.json").exists():
        from deltaserve.tools.make_model import make_model

        dtype = "fp32" if args.device == "cpu" else "bf16"
        make_model(args.model, preset=args.make_preset, dtype=dtype, seed=0, device=args.device)
    result = {
        "command": " ".join([sys.executable, "-m", "tools.bench_admission", *sys.argv[1:]]),
        "hardware": host_info(),
        "git_commit": git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "modes": {},
    }
    for mode in args.modes or ("lifetime", "present"):
        result["modes"][mode] = row = asyncio.run(run_mode(args, mode == "lifetime"))
        print(json.dumps({mode: row}), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
