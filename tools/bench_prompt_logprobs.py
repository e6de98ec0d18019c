"""Prompt logprobs, measured: what scoring a prompt costs through `AsyncEngine`, beside the
same prompt without them and beside HF transformers' forward (its logits' log_softmax) on the
same checkpoint in the same run, and how far each is from HF in fp32 (in bf16 on random
weights rounding alone moves logprobs far: HF's own bf16 is the floor ours is judged by).

For each `--lengths` prompt (random token ids): time to the first token with prompt logprobs
off, with `prompt_logprobs=1` (lm-evaluation-harness's loglikelihood asks for this much) and
with 20; HF's time for one forward and the gather of each prompt token's logprob.

    python -m tools.bench_prompt_logprobs --model DIR --out bench/results/prompt_logprobs_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import FinishedEvent, PromptLogprobsEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.tools.hardware import host_info


async def score(engine: AsyncEngine, prompt: list[int], k: int | None) -> tuple[float, list[float]]:
    """Seconds to the first token, and the prompt tokens' logprobs (k not None)."""
    start, first, logprobs = time.perf_counter(), None, []
    async for event in engine.generate(
        prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
    ):
        if isinstance(event, PromptLogprobsEvent):
            logprobs = event.token_logprobs
        elif isinstance(event, TokenEvent):
            first = time.perf_counter() - start
        elif not isinstance(event, FinishedEvent):
            raise RuntimeError(f"request failed: {event}")
    return first, logprobs


async def engine_runs(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict[str, Any]]:
    engine = await AsyncEngine.start(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=max(args.lengths) + 16,
        )
    )
    try:
        await score(engine, prompts[0][:64], 5)  # compile, warm
        rows = []
        for prompt in prompts:
            row: dict[str, Any] = {"prompt_len": len(prompt)}
            for name, k in (("off", None), ("k1", 1), ("k20", 20)):
                times = []
                for _ in range(args.repeats):
                    seconds, logprobs = await score(engine, prompt, k)
                    times.append(seconds)
                row[f"ttft_{name}_ms"] = 1e3 * min(times)
                if k == 1:
                    row["logprobs"] = logprobs
            rows.append(row)
        return rows
    finally:
        await engine.shutdown()


def hf_runs(
    args: argparse.Namespace, prompts: list[list[int]], dtype: torch.dtype
) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=args.device)
        times = []
        for _ in range(args.repeats):
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.inference_mode():
                logits = model(ids).logits[0, :-1]
                logprobs = torch.cat(
                    [
                        part.float().log_softmax(-1).gather(1, target[:, None])[:, 0]
                        for part, target in zip(
                            logits.split(1024), ids[0, 1:].split(1024), strict=True
                        )
                    ]
                )
            logprobs = logprobs.tolist()
            times.append(time.perf_counter() - start)
            del logits
        rows.append({"hf_ms": 1e3 * min(times), "logprobs": logprobs})
    del model
    return rows


def gaps(name: str, ours: list[float], reference: list[float]) -> dict[str, float]:
    diffs = [abs(a - b) for a, b in zip(ours, reference, strict=True)]
    return {f"{name}_max": max(diffs), f"{name}_mean": sum(diffs) / len(diffs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--hf-lengths", type=int, nargs="*", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(n)] for n in args.lengths]
    rows = asyncio.run(engine_runs(args, prompts))
    scored = [q for q in prompts if len(q) in args.hf_lengths]
    half = args.device == "cuda" and args.dtype in ("auto", "bfloat16", "bf16")
    hf = hf_runs(args, scored, torch.bfloat16 if half else torch.float32)
    # the reference: HF in fp32; on random weights bf16 alone moves logprobs far (its floor:
    # HF's own bf16 against it), so ours is judged beside that floor
    exact = hf_runs(args, scored, torch.float32) if half else hf
    for row, ref, fp32 in zip(
        [r for r in rows if r["prompt_len"] in args.hf_lengths], hf, exact, strict=True
    ):
        row.update(
            hf_ms=ref["hf_ms"],
            vs_hf=ref["hf_ms"] / row["ttft_k1_ms"],
            **gaps("ours_vs_hf_fp32", row["logprobs"], fp32["logprobs"]),
            **gaps("hf_vs_hf_fp32", ref["logprobs"], fp32["logprobs"]),
        )
    for row in rows:
        del row["logprobs"]
    record = {
        "command": " ".join(["python -m tools.bench_prompt_logprobs", *sys.argv[1:]]),
        "hardware": host_info(),
        "args": vars(args),
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(
        f"{'prompt':>7} {'off ms':>8} {'k=1 ms':>8} {'k=20 ms':>8} {'HF ms':>8} {'HF/k=1':>7} "
        f"{'ours-fp32 mean/max':>19} {'HF-fp32 mean/max':>17}"
    )
    nan = float("nan")
    for r in rows:
        print(
            f"{r['prompt_len']:>7} {r['ttft_off_ms']:>8.1f} {r['ttft_k1_ms']:>8.1f} "
            f"{r['ttft_k20_ms']:>8.1f} {r.get('hf_ms', nan):>8.1f} {r.get('vs_hf', nan):>7.2f} "
            f"{r.get('ours_vs_hf_fp32_mean', nan):>9.4f}/{r.get('ours_vs_hf_fp32_max', nan):<9.4f} "
            f"{r.get('hf_vs_hf_fp32_mean', nan):>8.4f}/{r.get('hf_vs_hf_fp32_max', nan):<8.4f}"
        )


if __name__ == "__main__":
    main()
