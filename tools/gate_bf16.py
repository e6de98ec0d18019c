"""The bf16 golden gate on a GPU, and the engine end to end on CUDA.

    python -m tools.gate_bf16 --model /tmp/m4b [--make-preset 4b] [--out bench/results/X.json]

1. Our executor in bf16 (CUDA graphs on) against HF transformers in fp32 on the same random
   checkpoint: prompts of 100, 1000 and 4097 tokens, the last 64 prompt positions and 64
   greedy decode steps each. Gate (GPU issue): mean <= 0.03 and p99 <= 0.12 nat over the
   top-8 logprob differences, argmax regret <= 0.20 nat.
   Beside it, on the same positions: HF transformers itself in bf16 against HF in fp32 (the
   bf16 floor of this checkpoint: a random deep network amplifies rounding, so that floor,
   not zero, is what bf16 can reach) and our executor in fp32 on CUDA against HF in fp32 (the
   GPU kernels at real shapes, where only summation order differs).
2. CUDA-graph decode and eager decode give the same tokens.
3. AsyncEngine on CUDA through real rank processes: start-up time, greedy tokens equal to the
   executor's run of the same steps (whole prompt, then one token a step), time per output
   token at batch 1.

On an FP8 release (`--make-dtype fp8`) HF's fp32 reference is its own FP8 loader widening the
weights (`dequantize=True`, which needs accelerate), so both sides run the same weights.
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


def our_logits(
    ex: Executor, rid: int, ids: list[int], forced: list[int] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Logits of the last 64 prompt positions and of 64 greedy decode steps; the tokens.
    With `forced`, those tokens are fed instead of our own picks (teacher forcing), so the
    positions match another run's even where greedy choices would part."""
    n = len(ids)
    new = NewRequest(n + DECODE_STEPS, SamplingSpec(seed=0))
    cut = max(n - 64, 0)
    if cut:
        ex.forward([StepItem(rid, 0, ids[:cut], False, new)])
        new = None
    rows = [ex.forward([StepItem(rid, cut, ids[cut:], True, new)], every_position=True)]
    tokens = [int(rows[0][-1].argmax()) if forced is None else forced[0]]
    for step in range(DECODE_STEPS):
        logits = ex.forward([StepItem(rid, n + step, [tokens[-1]], True)])
        rows.append(logits)
        tokens.append(
            int(logits[0].argmax()) if forced is None else forced[min(step + 1, len(forced) - 1)]
        )
    ex.drop([rid])
    return torch.cat(rows).float(), tokens[:DECODE_STEPS]


def golden(
    model_dir: str, ex: Executor, device: str, lengths: tuple[int, ...]
) -> tuple[dict, list]:
    """The gate, the HF bf16 floor; and the cases [(ids, our tokens, HF fp32 logits)]."""
    from deltaserve.tools.make_model import hf_causal_lm

    hf = hf_causal_lm(model_dir).from_pretrained(
        model_dir, dtype=torch.float32, **hf_quantization(model_dir)
    )
    hf = hf.to(device).eval()
    reports, ours_all, cases = {}, [], []
    for i, n in enumerate(lengths):
        ids = prompt_ids(n, seed=i)
        ours, tokens = our_logits(ex, 100 + i, ids)
        ours = ours.cpu()
        cases.append((ids, tokens, hf_logits(hf, ids, tokens, device)))
        reports[f"prompt_{n}"] = compare_logprobs(ours, cases[-1][2]).as_dict()
        ours_all.append(ours)
    refs = torch.cat([ref for _, _, ref in cases])
    pooled = compare_logprobs(torch.cat(ours_all), refs).as_dict()
    hf = hf.to(torch.bfloat16)  # the checkpoint is bf16: this is exactly HF's bf16 model
    floor = torch.cat([hf_logits(hf, ids, tokens, device) for ids, tokens, _ in cases])
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    passed = all(pooled[k] <= bound for k, bound in GATE.items())
    report = {
        "per_prompt": reports,
        "pooled": pooled,
        "gate": GATE,
        "passed": passed,
        "hf_bf16_vs_hf_fp32": compare_logprobs(floor, refs).as_dict(),
    }
    return report, cases


def hf_quantization(model_dir: str) -> dict:
    """from_pretrained's arguments for HF to widen an FP8 release's weights, as we do, rather
    than run its FP8 kernels (which also quantize the activations)."""
    quant = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    if not quant:
        return {}
    from transformers import CompressedTensorsConfig, FineGrainedFP8Config

    if quant.get("quant_method") == "compressed-tensors":
        return {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    return {
        "quantization_config": FineGrainedFP8Config(
            weight_block_size=tuple(quant["weight_block_size"]), dequantize=True
        )
    }


def hf_logits(hf, ids: list[int], tokens: list[int], device: str) -> torch.Tensor:
    """HF's fp32 logits of the positions `our_logits` returns, on the CPU."""
    with torch.inference_mode():
        out = hf(
            torch.tensor([ids + tokens], device=device),
            logits_to_keep=min(len(ids), 64) + DECODE_STEPS,
        )
    return out.logits[0].float().cpu()


def fp32_check(model_dir: str, device: str, cases: list) -> dict:
    """Our executor in fp32 (eager) against HF fp32 on the gate's cases, fed the same tokens."""
    ex = Executor(
        ExecutorConfig(
            model_dir,
            device=device,
            dtype="float32",
            max_num_seqs=2,
            num_kv_blocks=1024,
            max_model_len=4096 + DECODE_STEPS + 64,
            enforce_eager=True,
        )
    )
    ours = torch.cat(
        [our_logits(ex, 400 + i, ids, tokens)[0].cpu() for i, (ids, tokens, _) in enumerate(cases)]
    )
    del ex
    if device == "cuda":
        torch.cuda.empty_cache()
    return compare_logprobs(ours, torch.cat([ref for _, _, ref in cases])).as_dict()


def engine_reference(ex: Executor, rid: int, ids: list[int], steps: int) -> list[int]:
    """Greedy tokens of the engine's own schedule for one request: the whole prompt in one
    step, then one token a step (bf16 sums depend on how the prompt is cut)."""
    logits = ex.forward(
        [StepItem(rid, 0, ids, True, NewRequest(len(ids) + steps, SamplingSpec(seed=0)))]
    )
    tokens = [int(logits[-1].argmax())]
    for step in range(steps - 1):
        tokens.append(
            int(ex.forward([StepItem(rid, len(ids) + step, [tokens[-1]], True)])[0].argmax())
        )
    ex.drop([rid])
    return tokens


def graphs_vs_eager(ex: Executor) -> dict:
    ids = prompt_ids(500, seed=42)
    _, with_graphs = our_logits(ex, 200, ids)
    graphs, ex.graphs = ex.graphs, None
    _, eager = our_logits(ex, 201, ids)
    ex.graphs = graphs
    return {"tokens_equal": with_graphs == eager, "graphs_captured": graphs is not None}


async def engine_run(
    model_dir: str, device: str, dtype: str, reference_tokens: list[int], ids: list[int]
) -> dict:
    from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams

    t0 = time.perf_counter()
    config = EngineConfig(
        model=model_dir,
        device=device,
        dtype=dtype,
        max_model_len=4096,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
    )
    async with await AsyncEngine.start(config) as engine:
        startup_s = time.perf_counter() - t0
        params = SamplingParams(max_tokens=len(reference_tokens), temperature=0.0, ignore_eos=True)
        tokens = [e.token_id async for e in engine.generate(ids, params) if hasattr(e, "token_id")]
        long = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
        t1 = time.perf_counter()
        stamps = [
            time.perf_counter() async for e in engine.generate(ids, long) if hasattr(e, "token_id")
        ]
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
    p.add_argument(
        "--make-preset", default=None, help="make a random checkpoint of this preset first"
    )
    p.add_argument(
        "--make-dtype",
        default="bf16",
        choices=("bf16", "fp8"),
        help="its dtype (fp8: an FP8 release)",
    )
    p.add_argument("--out", default=None, help="JSON result path")
    p.add_argument(
        "--device", default="cuda", help="cuda; cpu only to try the script on a tiny model"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-lengths", default=",".join(map(str, PROMPT_LENGTHS)))
    p.add_argument(
        "--fp32-check", action="store_true", help="also run our executor in fp32 against HF fp32"
    )
    args = p.parse_args(argv)
    result: dict = {
        "command": " ".join([sys.executable, "-m", "tools.gate_bf16", *sys.argv[1:]]),
        "hardware": {
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none",
            "host": platform.node(),
            "torch": torch.__version__,
        },
    }
    if args.make_preset:
        from deltaserve.tools.make_model import make_model

        t0 = time.perf_counter()
        make_model(
            args.model, preset=args.make_preset, dtype=args.make_dtype, seed=0, device=args.device
        )
        result["make_model_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ex = Executor(
        ExecutorConfig(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=4,
            num_kv_blocks=2048,
            max_model_len=4096 + DECODE_STEPS + 64,
        )
    )
    result["executor_start_s"] = time.perf_counter() - t0
    lengths = tuple(int(n) for n in args.prompt_lengths.split(","))
    result["golden"], cases = golden(args.model, ex, args.device, lengths)
    result["graphs_vs_eager"] = graphs_vs_eager(ex)
    ids = prompt_ids(100, seed=0)
    reference = engine_reference(ex, 300, ids, 32)
    del ex
    if args.device == "cuda":
        torch.cuda.empty_cache()
    result["engine"] = asyncio.run(engine_run(args.model, args.device, args.dtype, reference, ids))
    if args.fp32_check:
        result["ours_fp32_vs_hf_fp32"] = fp32_check(args.model, args.device, cases)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    pooled = result["golden"]["pooled"]
    print(text)
    floor = result["golden"]["hf_bf16_vs_hf_fp32"]
    print(
        f"HF bf16 vs HF fp32 (the floor): mean {floor['mean_abs_diff']:.4f} p99 "
        f"{floor['p99_abs_diff']:.4f} regret {floor['max_regret']:.4f}"
    )
    if "ours_fp32_vs_hf_fp32" in result:
        print(f"ours fp32 vs HF fp32: {result['ours_fp32_vs_hf_fp32']}")
    print(
        f"gate {'PASS' if result['golden']['passed'] else 'FAIL'}: mean "
        f"{pooled['mean_abs_diff']:.4f} "
        f"p99 {pooled['p99_abs_diff']:.4f} regret {pooled['max_regret']:.4f} | graphs==eager "
        f"{result['graphs_vs_eager']['tokens_equal']} | engine==executor "
        f"{result['engine']['tokens_equal_executor']} startup {result['engine']['startup_s']:.1f}s "
        f"{result['engine']['ms_per_output_token_bs1']:.2f} ms/token"
    )
    return 0 if result["golden"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
