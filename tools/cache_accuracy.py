"""The accuracy cost of smaller request state: bf16 DeltaNet states against fp32 ones, and an
FP8 KV cache against the model-dtype one, on the golden prompts (tools/gate_bf16.py's).

    python -m tools.cache_accuracy --model /tmp/m4b --out bench/results/X.json        (GPU)
    python -m tools.cache_accuracy --model /tmp/tiny --device cpu --prompt-lengths 100,300

Each variant's executor is fed the tokens the baseline (fp32 states, the model's dtype in the
KV cache) chose greedily, so both score the same positions: the last 64 prompt positions and
64 decode steps of each prompt. Reported with the golden metric (tools/golden.py): mean, p99
and max of |logprob difference| over the variant's top-8 tokens, argmax mismatches and regret.
The FP8 cache is measured with scales of 1.0 (no calibration) and with `--calculate-kv-scales`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.tools.gate_bf16 import DECODE_STEPS, PROMPT_LENGTHS, our_logits, prompt_ids
from deltaserve.tools.golden import compare_logprobs
from deltaserve.tools.hardware import git_commit, host_info

# name -> ExecutorConfig fields of the variant (the baseline is the first)
VARIANTS = {
    "baseline": {},
    "bf16_states": {"mamba_ssm_cache_dtype": "bfloat16"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "fp8_kv_calculated_scales": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "bf16_states_fp8_kv_calculated": {
        "mamba_ssm_cache_dtype": "bfloat16",
        "kv_cache_dtype": "fp8",
        "calculate_kv_scales": True,
    },
}


def variant_logits(
    model: str, device: str, dtype: str, fields: dict, cases: list[tuple[list[int], list[int]]]
) -> tuple[torch.Tensor, list[list[int]]]:
    """One executor of the variant over every case (prompt ids, tokens to feed; None: its own
    greedy picks): the logits of the scored positions, and the tokens fed."""
    longest = max(len(ids) for ids, _ in cases) + DECODE_STEPS + 64
    ex = Executor(
        ExecutorConfig(
            model,
            device=device,
            dtype=dtype,
            max_num_seqs=2,
            num_kv_blocks=-(-longest // 16) * 2,
            max_model_len=longest,
            **fields,
        )
    )
    rows, fed = [], []
    for i, (ids, forced) in enumerate(cases):
        logits, tokens = our_logits(ex, 100 + i, ids, forced)
        rows.append(logits.cpu())
        fed.append(tokens)
    del ex
    if device == "cuda":
        torch.cuda.empty_cache()
    return torch.cat(rows), fed


def measure(model: str, device: str, dtype: str, lengths: tuple[int, ...]) -> dict:
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(lengths)]
    baseline, tokens = variant_logits(model, device, dtype, {}, [(p, None) for p in prompts])
    forced = list(zip(prompts, tokens, strict=True))
    report = {}
    for name, fields in list(VARIANTS.items())[1:]:
        logits, _ = variant_logits(model, device, dtype, fields, forced)
        report[name] = compare_logprobs(logits, baseline).as_dict()
    return report


def table(report: dict) -> str:
    """The report as a Markdown table (docs/GPU.md, docs/ARCHITECTURE.md)."""
    lines = [
        "| variant (against fp32 states, model-dtype KV) | mean | p99 | max | argmax mismatches |",
        "|---|---|---|---|---|",
    ]
    for name, r in report.items():
        lines.append(
            f"| {name} | {r['mean_abs_diff']:.2e} | {r['p99_abs_diff']:.2e} | "
            f"{r['max_abs_diff']:.2e} | {r['argmax_mismatches']} of {r['positions']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (fp32, the reference path)")
    p.add_argument("--dtype", default="auto", help="the model's dtype (auto: fp32 on the cpu)")
    p.add_argument("--prompt-lengths", default=",".join(map(str, PROMPT_LENGTHS)))
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args(argv)
    lengths = tuple(int(n) for n in args.prompt_lengths.split(","))
    report = measure(args.model, args.device, args.dtype, lengths)
    result = {
        "command": " ".join([sys.executable, "-m", "tools.cache_accuracy", *sys.argv[1:]]),
        "hardware": {**host_info(), "torch": torch.__version__, "platform": platform.platform()},
        "git_commit": git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prompt_lengths": lengths,
        "decode_steps": DECODE_STEPS,
        "report": report,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
