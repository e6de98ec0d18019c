"""The routed experts of an MoE layer alone, at Qwen3.5-35B-A3B's shapes, each way of running them.

    python -m tools.bench_moe --out bench/results/moe_kernels_h100.json [--tokens 1 8 64]

Each token count runs the router's top-k and both expert products inside a CUDA graph (the
way a decode step replays them; inputs rotated over 8 layers' weights so that no weight sits in
L2): per-pair GEMVs (`_expert_gemv_kernel`), pairs grouped by expert (`group_pairs` +
`_expert_product_kernel`), and the rule's pick (kernels.moe.GEMV_PAIRS). Bytes are the weights
of the distinct experts the tokens chose (what any kernel must read once); GB/s and the
fraction of the measured copy bandwidth are reported beside the time.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from deltaserve.kernels import moe
from deltaserve.tools.bench_decode import ceilings, time_graph, write_report

SHAPE = {"experts": 256, "top_k": 8, "hidden": 2048, "inter": 512}  # Qwen3.5-35B-A3B


def run(tokens: int, mode: str, layers: int = 8) -> dict:
    e, k, h, i = SHAPE["experts"], SHAPE["top_k"], SHAPE["hidden"], SHAPE["inter"]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    weights = [
        (
            (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).bfloat16(),
            (torch.randn(e, h, i, device="cuda", generator=gen) / i**0.5).bfloat16(),
        )
        for _ in range(layers)
    ]
    x = torch.randn(tokens, h, device="cuda", generator=gen).bfloat16()
    router = [
        torch.randn(tokens, e, device="cuda", generator=gen).bfloat16() for _ in range(layers)
    ]
    threshold = {"gemv": 1 << 30, "grouped": 0, "rule": moe.GEMV_PAIRS}[mode]

    def layer(n: int):
        def call() -> None:
            saved, moe.GEMV_PAIRS = moe.GEMV_PAIRS, threshold
            try:
                w, ids = moe.route(router[n], k, torch.bfloat16)
                moe.experts_triton(x, *weights[n], w, ids)
            finally:
                moe.GEMV_PAIRS = saved

        return call

    seconds = time_graph([layer(n) for n in range(layers)])
    distinct = (
        sum(torch.topk(r.float(), k, dim=-1).indices.unique().numel() for r in router) / layers
    )
    nbytes = distinct * 3 * i * h * 2
    return {
        "tokens": tokens,
        "mode": mode,
        "us_per_layer": seconds * 1e6,
        "distinct_experts": distinct,
        "bytes_per_layer": nbytes,
        "GBps": nbytes / seconds / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_moe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=None, help="JSON result path")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--modes", nargs="+", default=["gemv", "grouped", "rule"])
    args = parser.parse_args(argv)
    copy = ceilings(torch.device("cuda"))["copy_GBps"]
    rows = []
    for tokens in args.tokens:
        for mode in args.modes:
            row = run(tokens, mode)
            row["fraction_of_copy"] = row["GBps"] / copy
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_report(
        args.out, "bench_moe", shape=SHAPE, copy_GBps=copy, gemv_pairs=moe.GEMV_PAIRS, rows=rows
    )
    print(f"{'tokens':>6} {'mode':>8} {'us/layer':>9} {'experts':>8} {'GB/s':>7} {'of copy':>8}")
    for r in rows:
        print(
            f"{r['tokens']:6d} {r['mode']:>8} {r['us_per_layer']:9.1f} "
            f"{r['distinct_experts']:8.1f} {r['GBps']:7.0f} {r['fraction_of_copy']:8.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
