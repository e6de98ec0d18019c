"""Greedy tokens of the engine at tensor-parallel size N against size 1, on any devices:
`python -m tools.tp_check --model DIR --tp 2 --device cuda --dtype bfloat16 [--out FILE]`;
with `--against eager-prompts`, size N against size N with prompts run eagerly (no prompt
CUDA graphs); with `--against fp32`, size N and size 1 in --dtype against size 1 in fp32.
Exits 1 when the first two runs' tokens differ (except against fp32).

Where to expect the same bits: a prompt replayed from a graph is computed over its bucket's
rows, and cuBLAS picks its kernel by the row count, so the same prompt run eagerly can round
differently. At the tiny shapes no product did; at the 4B shapes out_proj / o_proj (2560 x
4096) does at 40, 55 or 70 rows against 64 or 128 (and not at 10, 17, 25, 90, 100, 500 or
1,000), bench/results/tp_check_h200x2_4b_bf16_eager_prompts_*.json.

Two prompts (a repeated short one and a 90-token one), 24 tokens each, ignore_eos; prints both
runs' tokens and whether they agree. On GPUs this exercises NCCL, the sharded weights and the
decode CUDA graphs with their all-reduces inside. Each token also comes with its top 8: up to
the first token the runs part at, their decode steps had the same inputs, so the gap between
those steps' logprobs says how far apart the decode paths compute (the prefixes below are
prompt steps only).

Greedy tokens part at the first near-tie that rounding tips (on a random checkpoint in bf16,
within a few tokens), so each run also gives the next-token distribution (top 8) after 9
prefixes of the prompts, each its own request; the mean gap between two runs' logprobs of the
tokens in both top 8s says how far apart they compute: a sharded weight or a reduction gone
wrong moves them by nats, rounding by the bf16 noise of the checkpoint, which `--against fp32`
measures for size 1 beside size N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

PROMPTS = ([5, 6, 7, 8, 9] * 8, list(range(100, 190)))
PREFIXES = [PROMPTS[0][:n] for n in (10, 25, 40)] + [
    PROMPTS[1][:n] for n in (10, 25, 40, 55, 70, 90)
]
TOP = 8

Distribution = list[tuple[int, float]]  # the top tokens and their logprobs, best first


async def engine_run(
    model: str, tp: int, device: str, dtype: str, prompt_graph_tokens: int
) -> dict:
    """Each prompt's greedy tokens, each prefix's next-token distribution, and how many steps
    were pipelined (their decode inputs, rank 0's samples, broadcast to the other ranks)."""
    from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams

    config = EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        tp_size=tp,
        max_num_seqs=4,
        max_model_len=256,
        prompt_graph_tokens=prompt_graph_tokens,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=TOP)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=TOP)
    async with await AsyncEngine.start(config) as engine:
        greedy = [
            [e async for e in engine.generate(p, params) if hasattr(e, "token_id")] for p in PROMPTS
        ]
        dists = [
            [e.top_logprobs async for e in engine.generate(p, first) if hasattr(e, "token_id")][0]
            for p in PREFIXES
        ]
        return {
            "tokens": [[e.token_id for e in run] for run in greedy],
            "token_top": [[e.top_logprobs for e in run] for run in greedy],
            "next_token_top": dists,
            "pipelined_steps": engine.metrics.pipelined_steps_total,
        }


def decode_steps_alike(run: dict, reference: dict) -> tuple[list[Distribution], list[Distribution]]:
    """The two runs' top lists of the decode steps that had the same inputs: the tokens after
    the first of each prompt, up to and including the first position where the tokens part."""
    ours, theirs = [], []
    for a, b, top_a, top_b in zip(
        run["tokens"], reference["tokens"], run["token_top"], reference["token_top"], strict=True
    ):
        parted = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a) - 1)
        ours += top_a[1 : parted + 1]
        theirs += top_b[1 : parted + 1]
    return ours, theirs


def distribution_gap(run: list[Distribution], reference: list[Distribution]) -> dict:
    """Mean and largest |logprob difference| over the tokens in both top lists, per prefix
    averaged; and on how many prefixes the best token agrees."""
    gaps = []
    for ours, ref in zip(run, reference, strict=True):
        theirs = dict(ref)
        gaps.append(
            statistics.fmean(
                [abs(lp - theirs[t]) for t, lp in ours if t in theirs] or [float("inf")]
            )
        )
    if not gaps:  # no steps to compare (decode steps: the runs parted at their first tokens)
        return {"mean_gap": float("nan"), "max_gap": float("nan"), "argmax_agree": 0, "prefixes": 0}
    agree = sum(ours[0][0] == ref[0][0] for ours, ref in zip(run, reference, strict=True))
    return {
        "mean_gap": statistics.fmean(gaps),
        "max_gap": max(gaps),
        "argmax_agree": agree,
        "prefixes": len(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--against", choices=["tp1", "eager-prompts", "fp32"], default="tp1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    main_run = f"tp{args.tp}"
    plan = [(main_run, args.tp, args.dtype, 2048)]
    if args.against == "eager-prompts":
        plan.append((f"{main_run}-eager-prompts", args.tp, args.dtype, 0))
    else:
        plan.append(("tp1", 1, args.dtype, 2048))
    if args.against == "fp32":
        plan.append(("tp1-fp32", 1, "float32", 2048))
    runs = {}
    for label, tp, dtype, graph_tokens in plan:
        started = time.monotonic()
        runs[label] = asyncio.run(engine_run(args.model, tp, args.device, dtype, graph_tokens))
        print(
            f"{label} in {time.monotonic() - started:.1f} s ({runs[label]['pipelined_steps']} "
            f"steps pipelined): {runs[label]['tokens']}",
            flush=True,
        )
    reference = plan[-1][0]
    gaps = {
        f"{label} vs {reference}": distribution_gap(
            runs[label]["next_token_top"], runs[reference]["next_token_top"]
        )
        for label, *_ in plan[:-1]
    }
    gaps.update(
        {
            f"{label} vs {reference}, decode steps": distribution_gap(
                *decode_steps_alike(runs[label], runs[reference])
            )
            for label, *_ in plan[:-1]
        }
    )
    for pair, gap in gaps.items():
        print(
            f"{pair}: next-token top-{TOP} logprob gap mean {gap['mean_gap']:.4f}, max "
            f"{gap['max_gap']:.4f} nat; "
            f"best token agrees on {gap['argmax_agree']} of {gap['prefixes']}",
            flush=True,
        )
    same = runs[main_run]["tokens"] == runs[plan[1][0]]["tokens"]
    print(f"{main_run} == {plan[1][0]}: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "command": " ".join(["python -m tools.tp_check", *sys.argv[1:]]),
                    "runs": runs,
                    "gaps": gaps,
                    "same": same,
                },
                f,
            )
    return 0 if same or args.against == "fp32" else 1


if __name__ == "__main__":
    raise SystemExit(main())
