"""The decode graph step under several kernel choices, in one process on one GPU:
`python -m tools.bench_step_ab --model DIR [--modes pdl nopdl cublas rows64 pdl] [--out FILE]`.

Same-run ratios are the only fair ones on lent machines whose hosts differ by 10-40%. Each
mode builds its own executor (graphs captured with that mode's kernels), prefills `batch`
prompts of 1000 tokens and times 40 decode steps of the graph path (median of the last 35).
Name a mode twice to see the drift between its first and last run. The modes:
  pdl     the default: skinny kernels up to 32 rows, programmatic dependent launch
  nopdl   the same kernels launched plainly (DELTASERVE_PDL=0)
  cublas  cuBLAS for every projection (the skinny kernels off), PDL for the rest
  rows64  the skinny tensor-core kernel up to 64 rows, PDL
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import deltaserve.kernels.skinny_linear as skinny
import deltaserve.kernels.triton_compat as triton_compat
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.bench_decode import hardware

MODES = {"pdl": (32, True), "nopdl": (32, False), "cublas": (0, True), "rows64": (64, True)}  # max rows, PDL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["pdl", "nopdl", "cublas", "rows64", "pdl"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out: dict[str, list[float]] = {}
    next_id = 0
    for mode in args.modes:
        skinny.MAX_ROWS, triton_compat.PDL = MODES[mode]
        ex = Executor(ExecutorConfig(args.model, device="cuda", dtype="bfloat16", block_size=16, num_slots=max(args.batches),
                                     num_blocks=max(args.batches) * 80, max_model_len=1270, cuda_graphs=True))  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        for batch in args.batches:
            ids = list(range(next_id, next_id + batch))
            next_id += batch
            for i in range(0, batch, 8):
                ex.forward([StepItem(r, 0, torch.randint(0, 240000, (1000,), generator=gen).tolist(), True,
                                     NewRequest(1260, SamplingSpec(seed=0))) for r in ids[i:i + 8]])  # fmt: skip
            times = []
            for step in range(40):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ex.forward([StepItem(r, 1000 + step, [7], True, None) for r in ids])
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            ex.drop(ids)
            times = sorted(times[5:])
            out.setdefault(f"{mode}_b{batch}_ms", []).append(round(times[len(times) // 2] * 1e3, 3))
            print(mode, batch, out[f"{mode}_b{batch}_ms"], flush=True)
        del ex
        torch.cuda.empty_cache()
    if args.out:
        report = {"command": " ".join(["python -m tools.bench_step_ab", *sys.argv[1:]]),
                  "hardware": hardware(torch.device("cuda")), "median_step_ms": out}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
