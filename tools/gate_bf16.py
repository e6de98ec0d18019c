"""The bf16 golden gate on a GPU, and the engine end to end on CUDA.

    python -m tools.gate_bf16 --model /tmp/m4b [--make-preset 4b] [--out bench/results/X.json]

1. Our executor in bf16 (CUDA graphs on) against HF transformers in fp32 on the same random
   checkpoint: prompts of 100, 1000 and 4097 tokens, the last 64 prompt positions and 64
   greedy decode steps each. Gate (GPU issue): mean <= 0.03 and p99 <= 0.12 nat over the
   top-8 logprob differences, argmax regret <= 0.20 nat.
2. CUDA-graph decode and eager decode give the same tokens.
3. AsyncEngine on CUDA through real rank processes: start-up time, greedy tokens equal to the
   executor's, time per output token at batch 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.golden import compare_logprobs

DECODE_STEPS = 64
PROMPT_LENGTHS = (100, 1000, 4097)
GATE = {"mean_abs_diff": 0.03, "p99_abs_diff": 0.12, "max_regret": 0.20}


def prompt_ids(length: int, seed: int) -> list[int]:
    gen = random.Random(seed)
    return [gen.randrange(248044) for _ in range(length)]


def our_logits(ex: Executor, rid: int, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Logits of the last 64 prompt positions and of 64 greedy decode steps; the tokens."""
    n = len(ids)
    new = NewRequest(n + DECODE_STEPS, SamplingSpec(seed=0))
    cut = max(n - 64, 0)
    if cut:
        ex.forward([StepItem(rid, 0, ids[:cut], False, new)])
        new = None
    rows = [ex.forward([StepItem(rid, cut, ids[cut:], True, new)], every_position=True)]
    tokens = [int(rows[0][-1].argmax())]
    for step in range(DECODE_STEPS):
        logits = ex.forward([StepItem(rid, n + step, [tokens[-1]], True)])
        rows.append(logits)
        tokens.append(int(logits[0].argmax()))
    ex.drop([rid])
    return torch.cat(rows).float(), tokens[:DECODE_STEPS]


def golden(model_dir: str, ex: Executor, device: str, lengths: tuple[int, ...]) -> dict:
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    reports, ours_all, ref_all = {}, [], []
    for i, n in enumerate(lengths):
        ids = prompt_ids(n, seed=i)
        ours, tokens = our_logits(ex, 100 + i, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids + tokens], device=device), logits_to_keep=min(n, 64) + DECODE_STEPS)
        ref = ref.logits[0].float()
        reports[f"prompt_{n}"] = compare_logprobs(ours, ref).as_dict()
        ours_all.append(ours)
        ref_all.append(ref)
    pooled = compare_logprobs(torch.cat(ours_all), torch.cat(ref_all)).as_dict()
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    passed = all(pooled[k] <= bound for k, bound in GATE.items())
    return {"per_prompt": reports, "pooled": pooled, "gate": GATE, "passed": passed}


def graphs_vs_eager(ex: Executor) -> dict:
    ids = prompt_ids(500, seed=42)
    _, with_graphs = our_logits(ex, 200, ids)
    graphs, ex.graphs = ex.graphs, None
    _, eager = our_logits(ex, 201, ids)
    ex.graphs = graphs
    return {"tokens_equal": with_graphs == eager, "graphs_captured": graphs is not None}


async def engine_run(model_dir: str, device: str, dtype: str, reference_tokens: list[int], ids: list[int]) -> dict:
    from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams

    t0 = time.perf_counter()
    config = EngineConfig(model=model_dir, device=device, dtype=dtype, max_model_len=4096,
                          max_num_seqs=8, max_num_batched_tokens=4096)  # fmt: skip
    async with await AsyncEngine.start(config) as engine:
        startup_s = time.perf_counter() - t0
        params = SamplingParams(max_tokens=len(reference_tokens), temperature=0.0, ignore_eos=True)
        tokens = [e.token_id async for e in engine.generate(ids, params) if hasattr(e, "token_id")]
        long = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
        t1 = time.perf_counter()
        stamps = [time.perf_counter() async for e in engine.generate(ids, long) if hasattr(e, "token_id")]
        per_token_ms = 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        ttft_ms = 1e3 * (stamps[0] - t1)
    return {
        "startup_s": startup_s,
        "tokens_equal_executor": tokens == reference_tokens,
        "ms_per_output_token_bs1": per_token_ms,
        "ttft_ms_prompt_100": ttft_ms,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--make-preset", default=None, help="make a random bf16 checkpoint of this preset first")
    p.add_argument("--out", default=None, help="JSON result path")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script on a tiny model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-lengths", default=",".join(map(str, PROMPT_LENGTHS)))
    args = p.parse_args(argv)
    result: dict = {"command": " ".join([sys.executable, "-m", "tools.gate_bf16", *sys.argv[1:]]),
                    "hardware": {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none", "host": platform.node(),
                                 "torch": torch.__version__}}  # fmt: skip
    if args.make_preset:
        from deltaserve.tools.make_model import make_model

        t0 = time.perf_counter()
        make_model(args.model, preset=args.make_preset, dtype="bf16", seed=0, device=args.device)
        result["make_model_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ex = Executor(ExecutorConfig(args.model, device=args.device, dtype=args.dtype, num_slots=4,
                                 num_blocks=2048, max_model_len=4096 + DECODE_STEPS + 64))  # fmt: skip
    result["executor_start_s"] = time.perf_counter() - t0
    lengths = tuple(int(n) for n in args.prompt_lengths.split(","))
    result["golden"] = golden(args.model, ex, args.device, lengths)
    result["graphs_vs_eager"] = graphs_vs_eager(ex)
    ids = prompt_ids(100, seed=0)
    _, reference = our_logits(ex, 300, ids)
    del ex
    if args.device == "cuda":
        torch.cuda.empty_cache()
    result["engine"] = asyncio.run(engine_run(args.model, args.device, args.dtype, reference[:32], ids))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    pooled = result["golden"]["pooled"]
    print(text)
    print(f"gate {'PASS' if result['golden']['passed'] else 'FAIL'}: mean {pooled['mean_abs_diff']:.4f} "
          f"p99 {pooled['p99_abs_diff']:.4f} regret {pooled['max_regret']:.4f} | graphs==eager "
          f"{result['graphs_vs_eager']['tokens_equal']} | engine==executor "
          f"{result['engine']['tokens_equal_executor']} startup {result['engine']['startup_s']:.1f}s "
          f"{result['engine']['ms_per_output_token_bs1']:.2f} ms/token")  # fmt: skip
    return 0 if result["golden"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
