"""Where a decode step's time goes on one GPU: `python -m tools.step_anatomy --model DIR
[--batches 1 64] [--out FILE]`.

For each batch, on the executor as a rank runs it (graphs captured, PDL as configured):
- the graph's replay timed by CUDA events with the GPU idle (its launch included) and queued
  behind a busy kernel (launch hidden): the difference is what the launch exposes;
- the host cost of `graph.replay()` alone;
- the rank's whole step (`run_step`: forward and sampling, greedy, the pipelined form of an
  item) split at the replay call and the sampler: host before the launch, the launch, the
  host until the sampler, the sampler (it waits for the GPU);
- one profiled replay, queued: each kernel's share of the critical path (its end minus the
  latest end before it; under PDL a kernel starts early and waits), by kernel name, and
  every projection's weight bytes over its share (achieved GB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict

import torch

import deltaserve.engine.rank.linear as rank_linear
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.bench_decode import write_report

CONTEXT = 1000
# the kernels that start a projection (ours, or cuBLAS's), and those that add its split-K parts
PROJECTION_KERNELS = ("_gemv_kernel", "_skinny_dot_kernel", "nvjet", "sm90_xmma", "cutlass")
SPLIT_SUMS = ("_sum_splits_kernel", "void cublasLt::splitKreduce")
BUSY_CYCLES = 4_000_000  # ~2 ms at the H200's 1.98 GHz: the launch finishes behind it


def step_executor(model: str, max_batch: int, fp8_weights: str = "widen") -> Executor:
    """The 4B executor of the step tools: bf16 on CUDA, graphs up to `max_batch`, room for
    CONTEXT positions and a few hundred steps per request."""
    return Executor(
        ExecutorConfig(
            model,
            device="cuda",
            dtype="bfloat16",
            block_size=16,
            max_num_seqs=max_batch,
            num_kv_blocks=max_batch * 80,
            max_model_len=CONTEXT + 270,
            enforce_eager=False,
            fp8_weights=fp8_weights,
        )
    )


class StampedGraph:
    """A captured graph whose replay() notes when the call began and returned."""

    def __init__(self, graph: torch.cuda.CUDAGraph, stamps: dict[str, float]) -> None:
        self.graph, self.stamps = graph, stamps

    def replay(self) -> None:
        self.stamps["launch"] = time.perf_counter()
        self.graph.replay()
        self.stamps["launched"] = time.perf_counter()


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 4)


def replay_times(graph: torch.cuda.CUDAGraph, reps: int) -> dict:
    """The replay with the GPU idle (the launch shows) and behind a busy kernel (it hides),
    and the host's time in `replay()` in each case."""
    gpu: dict[bool, list[float]] = {False: [], True: []}
    host: dict[bool, list[float]] = {False: [], True: []}
    for busy in (False, True) * reps:
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(BUSY_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        host[busy].append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        gpu[busy].append(start.elapsed_time(end) / 1e3)
    return {
        "replay_idle_ms": median_ms(gpu[False]),
        "replay_queued_ms": median_ms(gpu[True]),
        "replay_call_host_ms": median_ms(host[True]),
        "replay_call_host_idle_ms": median_ms(host[False]),
    }


def critical_path(graph: torch.cuda.CUDAGraph, shapes: list[tuple[int, int, int]]) -> dict:
    """One queued replay under torch.profiler, its kernels' shares (`critical_path_shares`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(BUSY_CYCLES)
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    kernels = [
        e
        for e in trace["traceEvents"]
        if e.get("cat") == "kernel" and "sleep" not in e["name"].lower()
    ]
    return critical_path_shares(kernels, shapes)


def critical_path_shares(kernels: list[dict], shapes: list[tuple[int, int, int]]) -> dict:
    """Each kernel's share of the critical path: its end minus the latest end of the kernels
    before it (us), so a gap before it (its launch) is its own. Under PDL a kernel starts
    while its predecessor runs and waits, so its duration overstates it; the shares add up
    to the span. Kernels are trace events (name, ts, dur); the projections among them (ours
    or cuBLAS's, in launch order) take `shapes` (N, K, weight bytes) in turn, and a split-K
    sum its projection's."""
    kernels = sorted(kernels, key=lambda e: e["ts"])
    frontier = kernels[0]["ts"]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    launches, projections, current = [], iter(shapes), None
    for k in kernels:
        end = k["ts"] + k["dur"]
        share = max(0.0, end - frontier)
        frontier = max(frontier, end)
        name = k["name"].split("<")[0][:60]
        entry = by_name[name]
        entry[0] += 1
        entry[1] += share
        entry[2] += k["dur"]
        row = {"name": name, "share_us": round(share, 2), "dur_us": round(k["dur"], 2)}
        if name.startswith(PROJECTION_KERNELS):  # the next projection (cuBLAS's lm_head: none left)
            n_out, k_in, nbytes = next(projections, (0, 0, 0))
            if nbytes:
                row.update(
                    shape=[n_out, k_in],
                    bytes=nbytes,
                    GBps=round(nbytes / max(share, 1e-3) / 1e3, 1),
                )
                current = row
        elif name.startswith(SPLIT_SUMS) and current is not None:  # the projection's split-K sum
            row["shape"] = current["shape"]
        launches.append(row)
    span = frontier - kernels[0]["ts"]
    names = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {
        "span_us": round(span, 1),
        "kernels": len(kernels),
        "by_name": [
            {"name": n, "count": c, "share_us": round(s, 1), "dur_us": round(d, 1)}
            for n, (c, s, d) in names
        ],
        "launches": launches,
    }


def projection_shapes(ex: Executor, items: list[StepItem]) -> list[tuple[int, int, int]]:
    """(N, K, weight bytes) of every projection of one eager step through `linear`, in order."""
    seen: list[tuple[int, int, int]] = []
    original = rank_linear.linear

    def recording(x: torch.Tensor, weight: torch.Tensor, *args, **options) -> torch.Tensor:
        seen.append((*weight.shape, weight.numel() * weight.element_size()))
        return original(x, weight, *args, **options)

    rank_linear.linear = recording
    try:
        ex.model(ex._eager_batch(ex._build_batch(items, False)), ex.cache)
    finally:
        rank_linear.linear = original
    return seen


def host_ops(ex: Executor, ids: list[int], steps: int = 10) -> list[dict]:
    """The torch calls' host time per step over `steps` run_steps (CPU activity only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            ex.run_step([StepItem(r, ex.requests[r].num_tokens, [], True, None) for r in ids])
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    return [
        {
            "name": e.key[:60],
            "calls": e.count // steps,
            "us": round(e.self_cpu_time_total / steps, 1),
        }
        for e in ops
    ]


def launch_costs(ex: Executor, reps: int = 20) -> dict[int, tuple[float, float]]:
    """Host ms of `graph.replay()` per bucket, with the GPU busy and idle."""
    costs = {}
    for size, (graph, *_) in sorted(ex.graphs.graphs.items()):
        times = replay_times(graph, reps)
        costs[size] = (times["replay_call_host_ms"], times["replay_call_host_idle_ms"])
    return costs


def anatomy(ex: Executor, batch: int, first_id: int, steps: int) -> dict:
    ids = list(range(first_id, first_id + batch))
    gen = torch.Generator().manual_seed(0)
    for i in range(0, batch, 8):
        ex.run_step(
            [
                StepItem(
                    r,
                    0,
                    torch.randint(0, 240000, (CONTEXT,), generator=gen).tolist(),
                    True,
                    NewRequest(CONTEXT + 4 * steps + 64, SamplingSpec(seed=0)),
                )
                for r in ids[i : i + 8]
            ]
        )
    size = min(b for b in ex.graphs.graphs if b >= batch)
    graph, *outputs = ex.graphs.graphs[size]
    stamps: dict[str, float] = {}
    ex.graphs.graphs[size] = (StampedGraph(graph, stamps), *outputs)
    launch = ex.sampler.launch

    def stamped_launch(*args, **kwargs):
        stamps["sample"] = time.perf_counter()
        return launch(*args, **kwargs)

    ex.sampler.launch = stamped_launch
    run = ex.graphs.run

    def stamped_run(*args, **kwargs):
        stamps["graphs_run"] = time.perf_counter()
        return run(*args, **kwargs)

    ex.graphs.run = stamped_run
    segments: dict[str, list[float]] = defaultdict(list)
    walls = []
    for _ in range(steps):  # back to back, as a rank runs a follower: no sync but the sampler's
        items = [StepItem(r, ex.requests[r].num_tokens, [], True, None) for r in ids]
        t0 = time.perf_counter()
        ex.run_step(items)
        t1 = time.perf_counter()
        walls.append(t1 - t0)
        segments["host_before_launch"].append(stamps["launch"] - t0)
        segments["of_which_in_graphs_run"].append(stamps["launch"] - stamps["graphs_run"])
        segments["launch_call"].append(stamps["launched"] - stamps["launch"])
        segments["host_until_sampler"].append(stamps["sample"] - stamps["launched"])
        segments["sampler_incl_gpu_wait"].append(t1 - stamps["sample"])
    del ex.sampler.launch
    del ex.graphs.run
    ex.graphs.graphs[size] = (graph, *outputs)
    row = {
        "batch": batch,
        "bucket": size,
        "run_step_ms": median_ms(walls),
        **{k: median_ms(v) for k, v in segments.items()},
        **replay_times(graph, reps=20),
    }
    items = [StepItem(r, ex.requests[r].num_tokens, [], True, None) for r in ids]
    row["host_ops_per_step"] = host_ops(ex, ids)
    row["critical_path"] = critical_path(graph, projection_shapes(ex, items))
    ex.drop(ids)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--launch-only", action="store_true", help="only each bucket's launch cost")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    ex = step_executor(args.model, max(args.batches))
    launches = launch_costs(ex)
    print("graph.replay() host ms by bucket:", launches, flush=True)
    if args.launch_only:
        return 0
    rows = []
    for i, batch in enumerate(args.batches):
        row = anatomy(ex, batch, first_id=i * 1000, steps=args.steps)
        rows.append(row)
        flat = {k: v for k, v in row.items() if k not in ("critical_path", "host_ops_per_step")}
        print(json.dumps(flat), flush=True)
        print(
            "  host per step:",
            ", ".join(f"{o['name']} {o['us']}" for o in row["host_ops_per_step"][:8]),
        )
        path = row["critical_path"]
        print(
            f"b={batch}: {path['kernels']} kernels, critical path {path['span_us']} us", flush=True
        )
        for entry in path["by_name"][:12]:
            print(
                f"  {entry['name']:40s} x{entry['count']:4d}  share {entry['share_us']:8.1f} us  "
                f"dur {entry['dur_us']:8.1f} us",
                flush=True,
            )
    write_report(args.out, "step_anatomy", launch_host_ms=launches, results=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
