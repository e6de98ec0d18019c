"""Prompt steps replayed from a CUDA graph against the same steps run eagerly, in one process.

Two executors on one GPU over the same checkpoint: one captures prompt graphs (buckets up to
--graph-tokens), the other runs prompts eagerly (its decodes still replay graphs). Each prompt
shape runs in both, interleaved, `--reps` times; the table gives the best wall time of a step
(forward queued, then synchronised) and of its host part (the call's return), and how far the
two executors' logits of the sampled rows differ (max |logprob| over the top 8, argmax
agreement). Writes JSON with the command and hardware.

    python -m tools.bench_prompt_graphs --model /tmp/m4b --out bench/results/prompt_graphs_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.bench_decode import write_report
from deltaserve.tools.golden import compare_logprobs

SHAPES = [
    (1, 17),
    (1, 100),
    (1, 500),
    (1, 1000),
    (1, 1024),
    (1, 2000),
    (1, 4096),
    (4, 100),
    (8, 64),
    (8, 250),
]


def executor(model: str, graph_tokens: int) -> Executor:
    return Executor(
        ExecutorConfig(
            model,
            device="cuda",
            dtype="bfloat16",
            block_size=16,
            max_num_seqs=8,
            num_kv_blocks=8 * 300,
            max_model_len=4200,
            max_num_batched_tokens=8192,
            enforce_eager=False,
            prompt_graph_tokens=graph_tokens,
        )
    )


def timed_step(ex: Executor, items: list[StepItem]) -> tuple[float, float, torch.Tensor]:
    """(host seconds, wall seconds, logits) of one prompt step; its requests dropped after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = ex.forward(items)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ex.drop([item.request_id for item in items])
    return host, wall, logits.float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--graph-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    started = time.monotonic()
    graphs = executor(args.model, args.graph_tokens)
    graph_start_s = time.monotonic() - started
    started = time.monotonic()
    eager = executor(args.model, 0)
    eager_start_s = time.monotonic() - started
    gen = torch.Generator().manual_seed(5)
    next_id = iter(range(1, 10**9))
    rows = []
    for count, tokens in SHAPES:
        prompts = [
            torch.randint(0, 240000, (tokens,), generator=gen).tolist() for _ in range(count)
        ]
        times = {"graphs": [], "eager": []}
        logits = {}
        replays = graphs.prompt_graphs.replays
        for _ in range(args.reps):
            for name, ex in (("graphs", graphs), ("eager", eager)):
                items = [
                    StepItem(
                        next(next_id), 0, p, True, NewRequest(tokens + 1, SamplingSpec(seed=0))
                    )
                    for p in prompts
                ]
                host, wall, logits[name] = timed_step(ex, items)
                times[name].append((host, wall))
        report = compare_logprobs(logits["graphs"], logits["eager"])
        row = {
            "prompts": count,
            "tokens": tokens,
            "graph_replays": graphs.prompt_graphs.replays - replays,
        }
        for name, pairs in times.items():
            row[f"{name}_host_ms"] = min(h for h, _ in pairs[1:]) * 1e3  # the first run compiles
            row[f"{name}_wall_ms"] = min(w for _, w in pairs[1:]) * 1e3
        row["speedup"] = row["eager_wall_ms"] / row["graphs_wall_ms"]
        row["max_abs_logprob_diff"] = report.max_abs_diff
        row["argmax_mismatches"] = report.argmax_mismatches
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_report(
        args.out,
        "bench_prompt_graphs",
        executor_start_s={"graphs": graph_start_s, "eager": eager_start_s},
        rows=rows,
    )
    print(f"executor start: graphs {graph_start_s:.1f} s, eager {eager_start_s:.1f} s")
    print(
        f"{'prompts':>7} {'tokens':>6} {'graph ms':>9} {'eager ms':>9} {'speedup':>7} "
        f"{'graph host':>10} {'eager host':>10} {'max dlogp':>9} {'argmax!=':>8} {'replays':>7}"
    )
    for r in rows:
        print(
            f"{r['prompts']:7d} {r['tokens']:6d} {r['graphs_wall_ms']:9.2f} "
            f"{r['eager_wall_ms']:9.2f} "
            f"{r['speedup']:7.2f} {r['graphs_host_ms']:10.2f} {r['eager_host_ms']:10.2f} "
            f"{r['max_abs_logprob_diff']:9.4f} {r['argmax_mismatches']:8d} {r['graph_replays']:7d}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
