"""Tiles of the decode projections, judged inside the step: `python -m tools.step_tiles
--model DIR [--batches 1 8 32 64] [--out FILE]`.

A projection timed back to back (tools/bench_linear.py) is not timed as the step runs it:
under PDL a kernel starts while its predecessor ends, and the tiles that won there lost in
the step (bench/results/step_ab_h200_gemv_tiles_at_381bf8a.json). Here, for each batch, the
decode graph is captured again with each candidate tile applied to every projection shape at
once, and one queued replay is profiled (tools/step_anatomy.py): a projection's cost is its
share of the critical path, summed over its launches. The best candidate per shape (cuBLAS
among them) is then checked as a whole against the rule in kernels/skinny_linear.py by
interleaved replays (CUDA events), and printed as the rule to adopt.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

import deltaserve.kernels.skinny_linear as skinny
from deltaserve.engine.rank.executor import Executor
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.kernels.skinny_linear import SkinnyConfig
from deltaserve.kernels.triton_compat import sm_count
from deltaserve.tools.bench_decode import write_report
from deltaserve.tools.golden import compare_logprobs
from deltaserve.tools.step_anatomy import (
    CONTEXT,
    critical_path,
    projection_shapes,
    replay_times,
    step_executor,
)

CUBLAS = "cublas"
# (block_n, block_k, split_k, num_warps, num_stages, evict_first) per kernel; split_k 0: the
# rule's own split for the shape
GEMV = [
    (8, 256, 1, 4, 2, True),
    (8, 256, 1, 4, 3, True),
    (16, 256, 1, 8, 2, True),
    (4, 512, 1, 4, 2, True),
    (8, 512, 1, 8, 2, True),
    (8, 128, 1, 4, 4, True),
    (8, 256, 1, 4, 2, False),
    (4, 256, 1, 2, 2, True),
    (4, 1024, 1, 8, 2, False),
    (4, 1024, 1, 8, 3, False),
    (2, 1024, 1, 4, 2, False),
    (4, 512, 1, 4, 2, False),
    (8, 512, 1, 8, 2, False),
    (4, 1024, 1, 8, 2, True),
    (4, 512, 2, 4, 2, False),
    (2, 512, 1, 4, 3, False),
]
DOT = [
    (64, 128, 0, 4, 3, False),
    (64, 128, 0, 4, 4, False),
    (64, 256, 0, 4, 3, False),
    (128, 128, 0, 8, 3, False),
    (64, 64, 0, 4, 5, False),
    (64, 128, 0, 4, 3, True),
    (128, 64, 0, 4, 4, False),
    (64, 128, 1, 4, 3, False),
    # finer K splits for the narrow (2560-wide) outputs: 40 tiles of 64 fill few of 132 SMs
    (64, 128, 8, 4, 3, False),
    (64, 128, 8, 4, 4, False),
    (64, 128, 16, 4, 3, False),
    (64, 64, 8, 4, 4, False),
    (32, 128, 4, 4, 3, False),
    (32, 128, 8, 4, 3, False),
    (128, 128, 8, 8, 3, False),
    (64, 128, 2, 4, 4, False),
    # K in 3 parts even where they differ by a block:
    # 120 programs, one per SM (out/o_proj's TUNED tile)
    (64, 128, 3, 4, 4, False),
    (64, 64, 3, 4, 4, False),
]


def candidate(tile: tuple, n: int, k: int, gemv: bool, sms: int) -> SkinnyConfig | None:
    """The tile as a config for this shape, or None where its blocks do not fit K (the GEMV's
    K parts must be equal, the tensor-core kernel's may differ by a block). A block_k of 0: the
    whole K (the GEMV then reads its rows before waiting for the previous kernel), where K is a
    sum of two powers of two; a K-looping GEMV reads its first block ahead, as the rule's do."""
    block_n, block_k, split, warps, stages, evict = tile
    if block_k == 0:
        return (
            SkinnyConfig(block_n, k, 1, warps, stages, evict, whole_rows=True)
            if skinny.whole_row_parts(k)
            else None
        )
    if split == 0:
        rule = skinny.decode_config(2, n, k, sms)
        split = rule[0].split_k if rule else 1
    config = SkinnyConfig(
        block_n, block_k, split, warps, stages, evict, first_ahead=gemv and skinny.RULE_FIRST_AHEAD
    )
    return config if skinny.splits_fit(k, block_k, split, gemv) else None


def capture_with(ex: Executor, size: int, rows: int, choice: dict) -> None:
    """Capture bucket `size` again, each shape (N, K) on `choice[(N, K)]`: a tile or cuBLAS."""
    rule, max_rows = skinny.decode_config, skinny.MAX_ROWS

    def chosen(r: int, n: int, k: int, sms: int):  # as `linear` calls decode_config
        pick = choice.get((n, k))
        if r != rows or pick is None:
            return rule(r, n, k, sms)
        return None if pick == CUBLAS else (candidate(pick, n, k, rows == 1, sms), rows == 1)

    skinny.decode_config, skinny.MAX_ROWS = chosen, max(skinny.MAX_ROWS, rows)
    try:
        ex.graphs.capture([size])
    finally:
        skinny.decode_config, skinny.MAX_ROWS = rule, max_rows


def shares_by_shape(ex: Executor, size: int, shapes: list) -> dict:
    graph = ex.graphs.graphs[size][0]
    totals: dict[tuple[int, int], float] = defaultdict(float)
    for launch in critical_path(graph, shapes)["launches"]:
        if "shape" in launch:
            totals[tuple(launch["shape"])] += launch["share_us"]
    return dict(totals)


def logits_gap(ex: Executor, rule: tuple, picks: tuple, batch: int) -> dict:
    """The two graphs' logits of one step from the same states (each replay advances them, so
    they are restored in between): a tile that computes wrong shows far beyond the rounding
    gap (0.5-1 nat on a random checkpoint, tools/bench_step_ab.py)."""
    saved = (ex.cache.recurrent.clone(), ex.cache.conv.clone())
    logits = []
    for graph, _, out in (rule, picks):
        ex.cache.recurrent.copy_(saved[0])
        ex.cache.conv.copy_(saved[1])
        graph.replay()
        logits.append(out[:batch].float().clone())
    return compare_logprobs(logits[1], logits[0]).as_dict()


def sweep(ex: Executor, batch: int, first_id: int, rounds: int, dot: list, gemv: list) -> dict:
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
                    NewRequest(CONTEXT + 64, SamplingSpec(seed=0)),
                )
                for r in ids[i : i + 8]
            ]
        )
    ex.run_step([StepItem(r, CONTEXT, [], True, None) for r in ids])  # inputs for the replays
    size = min(b for b in ex.graphs.graphs if b >= batch)
    default = ex.graphs.graphs[size]
    # the shapes of a step of `batch` rows, as the rule runs it (an eager step, then undone)
    shapes = projection_shapes(ex, [StepItem(r, CONTEXT + 1, [], True, None) for r in ids])
    distinct = sorted({(n, k) for n, k, _ in shapes})
    sms = sm_count(torch.empty(0, device=ex.device))
    tiles = gemv if batch == 1 else dot
    options = {str(t): t for t in [*tiles, CUBLAS] if batch > 1 or t != CUBLAS}
    measured: dict[tuple[int, int], dict] = {s: {} for s in distinct}
    for shape, share in shares_by_shape(ex, size, shapes).items():  # the rule's own graph
        measured[shape]["rule"] = share
    for name, option in options.items():
        choice = {
            s: option
            for s in distinct
            if option == CUBLAS or candidate(option, *s, batch == 1, sms)
        }
        try:
            capture_with(ex, size, batch, choice)
        except Exception as exc:  # a tile that does not compile or launch: skipped
            print(f"b={batch} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        for shape, share in shares_by_shape(ex, size, shapes).items():
            if shape in choice:
                measured[shape][name] = share
    best = {s: min(m.items(), key=lambda kv: kv[1]) for s, m in measured.items()}
    picks = {s: options[name] for s, (name, _) in best.items() if name != "rule"}
    capture_with(ex, size, batch, picks)
    tuned = ex.graphs.graphs[size]
    gap = logits_gap(ex, default, tuned, batch)
    pairs = {"rule": [], "picks": []}
    for _ in range(rounds):  # interleaved: the rule's graph and the picks' graph
        pairs["rule"].append(replay_times(default[0], 10)["replay_queued_ms"])
        pairs["picks"].append(replay_times(tuned[0], 10)["replay_queued_ms"])
    ex.graphs.graphs[size] = default
    ex.drop(ids)
    return {
        "batch": batch,
        "shares_us": {f"{n}x{k}": m for (n, k), m in measured.items()},
        "picks": {f"{n}x{k}": [best[(n, k)][0], round(best[(n, k)][1], 1)] for (n, k) in best},
        "picks_vs_rule_first_step": gap,
        "replay_ms": {name: round(statistics.median(v), 4) for name, v in pairs.items()},
        "replay_ms_rounds": {name: [round(t, 4) for t in v] for name, v in pairs.items()},
    }


def parse_tile(text: str) -> tuple:
    """ "128,64,0,8,4,0" -> (128, 64, 0, 8, 4, False): a tile as DOT's entries are written."""
    fields = text.split(",")
    if len(fields) != 6 or not all(f.strip().isdigit() for f in fields):
        raise argparse.ArgumentTypeError(
            f"a tile is six integers N,K,SPLIT,WARPS,STAGES,EVICT; got {text!r}"
        )
    *sizes, evict = (int(f) for f in fields)
    return (*sizes, evict == 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--tiles",
        nargs="+",
        type=parse_tile,
        default=None,
        metavar="N,K,SPLIT,WARPS,STAGES,EVICT",
        help="tensor-core tiles to try instead of the built-in list, e.g. 128,64,0,8,4,0",
    )
    parser.add_argument(
        "--gemv-tiles",
        nargs="+",
        type=parse_tile,
        default=None,
        metavar="N,K,SPLIT,WARPS,STAGES,EVICT",
        help="GEMV tiles (batch 1) to try instead of the built-in list; K 0: whole rows",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dot = args.tiles or DOT
    ex = step_executor(args.model, max(args.batches))
    rows = []
    for i, batch in enumerate(args.batches):
        row = sweep(
            ex, batch, first_id=i * 1000, rounds=args.rounds, dot=dot, gemv=args.gemv_tiles or GEMV
        )
        rows.append(row)
        for shape, (name, share) in row["picks"].items():
            rule = row["shares_us"][shape].get("rule", float("nan"))
            print(
                f"b={batch:3d} {shape:11s} best {name:34s} "
                f"{share:8.1f} us  (the rule {rule:.1f} us)",
                flush=True,
            )
        print(
            f"b={batch:3d} replay: rule {row['replay_ms']['rule']:.4f} ms, picks "
            f"{row['replay_ms']['picks']:.4f} ms; "
            f"top-8 logprob gap {row['picks_vs_rule_first_step']['max_abs_diff']:.3f}",
            flush=True,
        )
        # after every batch: a run cut short keeps it
        write_report(args.out, "step_tiles", results=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
