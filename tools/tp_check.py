"""Greedy tokens of the engine at tensor-parallel size N against size 1, on any devices:
`python -m tools.tp_check --model DIR --tp 2 --device cuda --dtype bfloat16 [--out FILE]`;
with `--against eager-prompts`, size N against size N with prompts run eagerly (no prompt
CUDA graphs), which must agree exactly, in bf16 too.

Two prompts (a repeated short one and a 90-token one), 24 tokens each, ignore_eos; prints both
runs' tokens and whether they agree. On GPUs this exercises NCCL, the sharded weights and the
decode CUDA graphs with their all-reduces inside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

PROMPTS = ([5, 6, 7, 8, 9] * 8, list(range(100, 190)))


async def greedy_tokens(model: str, tp: int, device: str, dtype: str, prompt_graph_tokens: int) -> tuple[list[list[int]], int]:
    """Each prompt's tokens, and how many steps were pipelined (their decode inputs, rank 0's
    samples, broadcast to the other ranks)."""
    from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams

    config = EngineConfig(model=model, device=device, dtype=dtype, tp_size=tp, max_num_seqs=4, max_model_len=256,
                          prompt_graph_tokens=prompt_graph_tokens)  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with await AsyncEngine.start(config) as engine:
        tokens = [[e.token_id async for e in engine.generate(p, params) if hasattr(e, "token_id")] for p in PROMPTS]
        return tokens, engine.metrics.pipelined_steps_total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--against", choices=["tp1", "eager-prompts"], default="tp1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    other = ("tp1", 1, 2048) if args.against == "tp1" else (f"tp{args.tp}-eager-prompts", args.tp, 0)
    runs, pipelined = {}, {}
    for label, tp, graph_tokens in ((f"tp{args.tp}", args.tp, 2048), other):
        started = time.monotonic()
        runs[label], pipelined[label] = asyncio.run(greedy_tokens(args.model, tp, args.device, args.dtype, graph_tokens))
        print(f"{label} in {time.monotonic() - started:.1f} s ({pipelined[label]} steps pipelined): {runs[label]}",
              flush=True)  # fmt: skip
    same = runs[f"tp{args.tp}"] == runs[other[0]]
    print(f"tp{args.tp} == {other[0]}: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python -m tools.tp_check", *sys.argv[1:]]), "tokens": runs,
                       "pipelined_steps": pipelined, "same": same}, f)  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
