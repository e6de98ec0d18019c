"""Prompt attention at new lengths: first and second call of torch's SDPA (cuDNN on Hopper)
against the flash op that kernels/paged_attention.py calls, on one GPU.

  python -m tools.sdpa_first_call --out bench/results/sdpa_first_call.json

cuDNN builds an execution graph for every new (query, key) length; in serving nearly every
prompt has a new length, so its first call is what a request pays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from deltaserve.tools.hardware import host_info

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 256  # Qwen3.5-4B's attention layers
LENGTHS = (1000, 1001, 1013, 2048, 3001, 4096)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=HEAD_DIM**-0.5, enable_gqa=True
    )


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=HEAD_DIM**-0.5
    )[0]


def timed_ms(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def inputs(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def measure(fn: Callable[..., torch.Tensor]) -> dict:
    calls = []
    for length in LENGTHS:
        qkv = inputs(length)
        calls.append(
            {"length": length, "first_ms": timed_ms(fn, *qkv), "second_ms": timed_ms(fn, *qkv)}
        )
    qkv = inputs(4096)
    for _ in range(3):
        fn(*qkv)
    steady = sum(timed_ms(fn, *qkv) for _ in range(10)) / 10
    return {"calls": calls, "steady_ms_at_4096": steady}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m tools.sdpa_first_call", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default=None, help="JSON result path")
    args = parser.parse_args(argv)
    report = {
        "tool": " ".join(["python -m tools.sdpa_first_call", *argv]),
        "hardware": host_info(),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "sdpa_default": measure(sdpa),
        "flash_direct": measure(flash),
    }
    for name in ("sdpa_default", "flash_direct"):
        cells = " ".join(
            f"{c['length']}:{c['first_ms']:.1f}/{c['second_ms']:.2f}" for c in report[name]["calls"]
        )
        print(
            f"{name:13s} first/second ms {cells}  steady 4096: "
            f"{report[name]['steady_ms_at_4096']:.3f} ms"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
