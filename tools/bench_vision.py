"""Images through the vision tower and the engine, measured (GPU: a random 4B VLM in bf16).

- tower: images per second through our tower (engine/rank/vision.py) and HF transformers'
  `Qwen3_5VisionModel`, same weights, same batches of `--tower-batch` images of
  `--image-size` pixels square (the processor's patches), CUDA-synchronised, best of
  `--repeats` after a warm-up;
- time to first token of a 1-image chat (`--image-size`, the chat's text `--prompt-len`
  tokens): our engine (rank processes, the prompt already preprocessed) against HF's
  `Qwen3_5ForConditionalGeneration` forward over the same inputs, in the same run, median of
  `--repeats`; the preprocessing (transformers' processor) timed apart;
- decode latency of other requests while images are encoded: `--decoders` text requests
  decode; the gaps between their tokens are taken for `--window-s` alone, then while
  `--image-requests` 1-image chats arrive, one at a time: median, p99 and max of each phase.

    python -m tools.make_model --preset 4b --vlm-names --dtype bf16 --device cuda --out /tmp/q4b-vl
    python -m tools.bench_vision --model /tmp/q4b-vl --device cuda \\
        --out bench/results/vision_h100_4b.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import TokenEvent
from deltaserve.engine.media import IMAGE_PLACEHOLDER, MediaConfig, MediaProcessor
from deltaserve.engine.media_prompt import MultimodalPrompt
from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.vision import build_tower
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.tokenizer import load_tokenizer
from deltaserve.engine.vision_config import VisionConfig
from deltaserve.tools.hardware import git_commit, host_info

TEXT = "Describe the picture in detail, then list every object you can see in it. "


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _picture(size: int, seed: int) -> Any:
    from PIL import Image

    gen = np.random.default_rng(seed)
    return Image.fromarray(gen.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _best(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up: kernels chosen, memory pooled
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _media_prompt(
    processor: MediaProcessor, args: argparse.Namespace, seed: int
) -> MultimodalPrompt:
    words = (TEXT * (args.prompt_len // 8 + 1)).split()[: args.prompt_len]
    text = (
        f"<|im_start|>user\n{' '.join(words)}{IMAGE_PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    )
    return processor.process(text, [_picture(args.image_size, seed)], [])


def bench_tower(
    args: argparse.Namespace, vision: VisionConfig, text: ModelConfig, dtype, device, prompt
) -> dict:
    from transformers import Qwen3_5ForConditionalGeneration

    ours = build_tower(args.model, vision, text, dtype, device)
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(args.model, dtype=dtype).model.visual
    hf = hf.to(device).eval()
    item = prompt.media[0]
    patches = torch.frombuffer(bytearray(item.pixels), dtype=getattr(torch, item.dtype))
    patches = patches.view(item.num_patches, -1).to(device)
    pixels = patches.repeat(args.tower_batch, 1)
    grids = [item.grid] * args.tower_batch
    with torch.inference_mode():
        ours_s = _best(lambda: ours(pixels, grids), args.repeats, device)
        hf_s = _best(
            lambda: hf(pixels, grid_thw=torch.tensor(grids, device=device)), args.repeats, device
        )
        diff = (
            (
                ours(pixels, grids).float()
                - hf(pixels, grid_thw=torch.tensor(grids, device=device)).pooler_output.float()
            )
            .abs()
            .max()
        )
    return {
        "images": args.tower_batch,
        "patches_per_image": item.num_patches,
        "tokens_per_image": item.num_tokens,
        "ours_images_per_s": args.tower_batch / ours_s,
        "hf_images_per_s": args.tower_batch / hf_s,
        "ours_ms": ours_s * 1e3,
        "hf_ms": hf_s * 1e3,
        "max_abs_diff_vs_hf": float(diff),
    }


def hf_ttft(
    args: argparse.Namespace, vision: VisionConfig, dtype, device, prompt: MultimodalPrompt
) -> float:
    """Median seconds of HF's forward over the chat (its first token's logits)."""
    from transformers import Qwen3_5ForConditionalGeneration

    model = (
        Qwen3_5ForConditionalGeneration.from_pretrained(args.model, dtype=dtype).to(device).eval()
    )
    item = prompt.media[0]
    types = [1 if t == vision.image_token_id else 0 for t in prompt.ids]
    pixels = torch.frombuffer(bytearray(item.pixels), dtype=getattr(torch, item.dtype))
    inputs = {
        "input_ids": torch.tensor([prompt.ids], device=device),
        "mm_token_type_ids": torch.tensor([types], device=device),
        "pixel_values": pixels.view(item.num_patches, -1).to(device),
        "image_grid_thw": torch.tensor([item.grid], device=device),
    }
    times = []
    with torch.inference_mode():
        model(**inputs)
        for _ in range(args.repeats):
            _sync(device)
            start = time.perf_counter()
            model(**inputs, logits_to_keep=1).logits.argmax(-1).item()
            times.append(time.perf_counter() - start)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


async def engine_ttft(engine: AsyncEngine, prompts: list[MultimodalPrompt]) -> list[float]:
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        async for event in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0)):
            if isinstance(event, TokenEvent):
                times.append(time.perf_counter() - start)
    return times


async def decode_under_images(engine: AsyncEngine, args, prompts: list[MultimodalPrompt]) -> dict:
    """Gaps between tokens of `--decoders` decoding requests, alone then while images arrive."""
    gaps: dict[str, list[float]] = {"alone": [], "images": []}
    phase = {"now": "warm-up"}
    text = list(range(1000, 1000 + args.prompt_len))
    params = SamplingParams(
        max_tokens=args.max_model_len - len(text) - 1, temperature=0, ignore_eos=True
    )

    async def decoder() -> None:
        # A decoder that reaches max_tokens starts again: only gaps within one request count.
        while phase["now"] != "done":
            last = None
            async for _event in engine.generate(text, params):
                now = time.perf_counter()
                if last is not None and phase["now"] in gaps:
                    gaps[phase["now"]].append(now - last)
                last = now
                if phase["now"] == "done":
                    break

    tasks = [asyncio.ensure_future(decoder()) for _ in range(args.decoders)]
    await asyncio.sleep(args.window_s / 2)
    phase["now"] = "alone"
    await asyncio.sleep(args.window_s)
    phase["now"] = "images"
    ttfts = await engine_ttft(engine, prompts)
    # The gap that spans the last image's encoding, at least; a decoder that failed says so.
    while not gaps["images"] and not any(task.done() for task in tasks):
        await asyncio.sleep(0.01)
    phase["now"] = "done"
    await asyncio.gather(*tasks)

    def stats(values: list[float]) -> dict:
        if not values:
            return {}
        ordered = sorted(values)
        return {
            "tokens": len(values),
            "median_ms": statistics.median(values) * 1e3,
            "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
            "max_ms": ordered[-1] * 1e3,
        }

    return {
        "decoders": args.decoders,
        "alone": stats(gaps["alone"]),
        "while_images": stats(gaps["images"]),
        "image_ttft_ms_median": statistics.median(ttfts) * 1e3,
    }


async def main(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    vision = VisionConfig.from_model_dir(args.model)
    text = ModelConfig.from_model_dir(args.model)
    dtype_name = str(dtype).removeprefix("torch.")
    processor = MediaProcessor(
        args.model,
        load_tokenizer(args.model),
        vision,
        MediaConfig(processor_kwargs={"max_pixels": args.image_size**2 * 2}),
        dtype_name,
    )
    started = time.perf_counter()
    prompts = [
        _media_prompt(processor, args, seed) for seed in range(args.repeats + args.image_requests)
    ]
    preprocess_ms = (time.perf_counter() - started) / len(prompts) * 1e3
    record: dict[str, Any] = {
        "command": "python -m tools.bench_vision " + " ".join(argv),
        "commit": git_commit(),
        "hardware": host_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "prompt_tokens": len(prompts[0].ids),
        "preprocess_ms_per_image": preprocess_ms,
        "tower": bench_tower(args, vision, text, dtype, device, prompts[0]),
        "hf_ttft_ms": hf_ttft(args, vision, dtype, device, prompts[0]) * 1e3,
    }
    engine = await AsyncEngine.start(
        EngineConfig(
            model=args.model,
            device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=args.decoders + 2,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=args.num_kv_blocks,
        )
    )
    try:
        await engine_ttft(engine, prompts[:1])  # warm-up
        ours = await engine_ttft(engine, prompts[1 : 1 + args.repeats])
        record["ttft_ms"] = {
            "ours_median": statistics.median(ours) * 1e3,
            "hf_median": record["hf_ttft_ms"],
        }
        record["decode_under_images"] = await decode_under_images(
            engine, args, prompts[1 + args.repeats :] or prompts[:1]
        )
    finally:
        await engine.shutdown()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="a VLM checkpoint (make_model --vlm-names)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--image-size", type=int, default=448, help="pixels on a side")
    p.add_argument("--prompt-len", type=int, default=64, help="words of the chat's text")
    p.add_argument("--tower-batch", type=int, default=16, help="images per tower forward")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--image-requests", type=int, default=8)
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    record = asyncio.run(main(args, argv))
    print(json.dumps({k: v for k, v in record.items() if k not in ("hardware", "args")}, indent=1))
    return record


if __name__ == "__main__":
    run()
