"""HF transformers on the same checkpoint, the reference bench_decode reports beside ours:
greedy decode time per token and prefill time, in the same process and run."""

from __future__ import annotations

import json
import time

import torch


def bench_hf(
    model_dir: str,
    dtype_name: str,
    device: torch.device,
    batches: list[int],
    context: int,
    steps: int,
    prefill_lengths: list[int],
) -> tuple[list[dict], list[dict]]:
    """HF transformers' generate on the same checkpoint: decode time per token from two runs
    that differ only in the number of new tokens; then prefill times."""
    from deltaserve.tools.make_model import hf_causal_lm

    dtype = (
        torch.bfloat16
        if dtype_name in ("bfloat16", "auto") and device.type == "cuda"
        else torch.float32
    )
    model = hf_causal_lm(model_dir).from_pretrained(model_dir, dtype=dtype).to(device).eval()
    rows = []
    gen = torch.Generator().manual_seed(1)
    for batch in batches:
        ids = torch.randint(0, 240000, (batch, context), generator=gen).to(device)

        generate(model, ids, 2, device)  # warm-up
        short = generate(model, ids, 1, device)
        long = generate(model, ids, 1 + steps, device)
        step_s = (long - short) / steps
        rows.append(
            {
                "batch": batch,
                "context": context,
                "step_ms": step_s * 1e3,
                "tokens_per_s": batch / step_s,
            }
        )
        print(json.dumps({"hf": rows[-1]}), flush=True)
    return rows, bench_hf_prefill(model, device, prefill_lengths)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (the timings' edges)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model, ids: torch.Tensor, new_tokens: int, device: torch.device) -> float:
    """Seconds for HF's greedy generate of exactly `new_tokens` tokens after `ids`."""
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    sync(device)
    return time.perf_counter() - t0


def bench_hf_prefill(model, device: torch.device, lengths: list[int]) -> list[dict]:
    rows = []
    for n in lengths:
        ids = torch.randint(0, 240000, (1, n)).to(device)
        times = []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(ids, logits_to_keep=1)
            sync(device)
            times.append(time.perf_counter() - t0)
        rows.append({"tokens": n, "seconds": min(times[1:]), "tokens_per_s": n / min(times[1:])})
        print(json.dumps({"hf_prefill": rows[-1]}), flush=True)
    return rows
