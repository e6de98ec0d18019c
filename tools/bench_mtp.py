"""MTP speculative decoding, measured: per-token latency with it off and on, at forced
acceptance rates, by concurrency and by k; the adaptive switch; the cost of one draft step and
one verify step beside a decode step, as shares of the memory roofline.

Three engines in turn: MTP off (no head loaded, CUDA graphs as served: the baseline), MTP off
eager (a reference for the launch cost), MTP on with the largest k (decode, draft and verify
steps replay CUDA graphs; a verify step above `disable_by_batch_size` spans, which only a
forced k sends, runs eagerly). Each
run sends `c` greedy requests (distinct random prompts, ignore_eos) at once. MTP off gives
each prompt's continuation; with MTP on a benchmark-only proposer (`Speculation.force`)
replaces the head's drafts by that continuation, each draft corrupted with probability
1 - rate, so that acceptance is forced while the head still runs (its cost is real). Forced
runs fix k; the adaptive runs use the engine's own policy (engine/speculation.py) with the
same proposer. Greedy output with MTP equals output without it (tests/); in bf16 a verify's
wider batch may round a random model's near-tie the other way, after which the drafts stop
matching: each run records its measured acceptance and how many requests parted.

    python -m tools.make_model --preset 4b --out /tmp/m4b --dtype bf16 --device cuda --mtp random
    python -m tools.bench_mtp --model /tmp/m4b --device cuda --out bench/results/mtp_h100.json

`--draft-vocab-size N` drafts among the first N ids only (speculative_config.draft_vocab_size):
a draft step then reads N of the lm_head's rows; a run with and one without compare the two.
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
from deltaserve.engine.checkpoint_files import checkpoint_files, read_header
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import FinishedEvent, TokenEvent
from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.request import Request
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.tools.hardware import git_commit, host_info

GIB = 1 << 30


async def one_request(engine: AsyncEngine, prompt: list[int], output_len: int) -> dict:
    start = time.perf_counter()
    first, tokens = None, []
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    async for event in engine.generate(prompt, params):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter() - start
            tokens.append(event.token_id)
        elif not isinstance(event, FinishedEvent):
            raise RuntimeError(f"request failed: {event}")
    e2e = time.perf_counter() - start
    return {"tokens": tokens, "ttft_s": first, "decode_s": e2e - first}


async def measure(engine: AsyncEngine, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts at once: per-token latency (decode time over the tokens after the first,
    mean over requests), tokens per second, mean step time, acceptance."""
    m = engine.metrics
    steps, step_s = m.steps_total, m.step_seconds_total
    drafted, accepted = (
        m.spec_decode_num_draft_tokens_total,
        m.spec_decode_num_accepted_tokens_total,
    )
    start = time.perf_counter()
    results = await asyncio.gather(*(one_request(engine, p, output_len) for p in prompts))
    wall = time.perf_counter() - start
    latency = sum(r["decode_s"] / max(1, len(r["tokens"]) - 1) for r in results) / len(results)
    drafted = m.spec_decode_num_draft_tokens_total - drafted
    return {
        "concurrency": len(prompts),
        "per_token_latency_ms": latency * 1e3,
        "tokens_per_s": sum(len(r["tokens"]) for r in results) / wall,
        "mean_step_ms": (m.step_seconds_total - step_s) / max(1, m.steps_total - steps) * 1e3,
        "draft_tokens": drafted,
        "measured_acceptance": (
            (m.spec_decode_num_accepted_tokens_total - accepted) / drafted if drafted else None
        ),
        "outputs": [r["tokens"] for r in results],
    }


def corrupting_proposer(reference: dict[tuple[int, ...], list[int]], rate: float, vocab: int):
    """Drafts that are the target's own continuation (MTP off's output for the prompt), each
    replaced by another token with probability 1 - rate (the same draws every run)."""

    def propose(request: Request, index: int, drafts: list[int]) -> list[int]:
        truth = reference.get(tuple(request.prompt_ids), [])
        out = []
        for j in range(len(drafts)):
            at = index + j
            rng = random.Random(hash((request.prompt_ids[:8], at)))
            right = truth[at] if at < len(truth) else 0
            out.append(right if at < len(truth) and rng.random() < rate else (right + 1) % vocab)
        return out

    return propose


def checkpoint_bytes(model_dir: str) -> dict[str, int]:
    """Bytes of the target's weights (the embedding once, as the lm_head's read), the MTP
    head's, and the lm_head's (a draft reads it whole), from the files' headers."""
    out = {"target": 0, "mtp": 0, "lm_head": 0}
    embed = lm_head = 0
    for path in checkpoint_files(Path(model_dir)):
        for entry in read_header(path):
            size = entry.end - entry.begin
            if ".visual." in entry.name:
                continue
            if "mtp." in entry.name:
                out["mtp"] += size
            elif entry.name.endswith("embed_tokens.weight"):
                embed = size
            elif entry.name.endswith("lm_head.weight"):
                lm_head = size
            else:
                out["target"] += size
    out["lm_head"] = lm_head or embed
    out["target"] += out["lm_head"]
    return out


def state_bytes(config: ModelConfig) -> int:
    """One request's DeltaNet recurrent state (fp32), which a decode step reads and writes."""
    return (
        len(config.linear_attention_layers)
        * config.linear_num_value_heads
        * config.linear_key_head_dim
        * config.linear_value_head_dim
        * 4
    )


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device copy, read and write counted."""
    dev = torch.device(device)
    size = (GIB // 2) if dev.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    repeats = 20 if dev.type == "cuda" else 3
    if dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del src, dst
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the ranks size their caches from the memory left
    return 2 * size * repeats / seconds


def step_costs(
    off: dict,
    eager: dict | None,
    forced: list[dict],
    model_dir: str,
    bandwidth: float,
    draft_vocab_size: int | None = None,
) -> dict[str, Any]:
    """At concurrency 1: a decode step (graphs, eager) and, from MTP on at acceptance 0 with
    k = 1 and 2, one draft step (their difference) and one verify step of 2 rows (k = 1's step
    less a draft), each in ms and as a share of the decode step's memory roofline. A draft
    reads the lm_head's rows of its `draft_vocab_size` first ids (None: all)."""
    config = ModelConfig.from_model_dir(model_dir)
    sizes, state = checkpoint_bytes(model_dir), state_bytes(config)
    rows = config.vocab_size if draft_vocab_size is None else draft_vocab_size
    sizes["draft_lm_head"] = sizes["lm_head"] * rows // config.vocab_size
    roofline = {
        "decode_ms": (sizes["target"] + 2 * state) / bandwidth * 1e3,
        "draft_ms": (sizes["mtp"] + sizes["draft_lm_head"]) / bandwidth * 1e3,
        "verify_ms": (sizes["target"] + 3 * state) / bandwidth * 1e3,  # the rollback reads again
    }
    at = {(r["k"], r["rate"]): r["mean_step_ms"] for r in forced if r["concurrency"] == 1}
    out: dict[str, Any] = {"bytes": {**sizes, "state_per_request": state}, "roofline": roofline}
    measured = {"decode_ms": off["mean_step_ms"]}
    if eager is not None:
        measured["decode_eager_ms"] = eager["mean_step_ms"]
    if (1, 0.0) in at and (2, 0.0) in at:
        measured["draft_ms"] = at[(2, 0.0)] - at[(1, 0.0)]
        measured["verify_ms"] = at[(1, 0.0)] - measured["draft_ms"]
    out["measured"] = measured
    out["share_of_decode_roofline"] = {
        name: value / roofline["decode_ms"] for name, value in measured.items()
    }
    out["lm_head_share_of_draft_bytes"] = sizes["draft_lm_head"] / max(
        1, sizes["mtp"] + sizes["draft_lm_head"]
    )
    return out


def summarize(off: dict[int, dict], forced: list[dict], adaptive: list[dict]) -> dict[str, Any]:
    """Best-k speed-up over MTP off by concurrency and rate; the adaptive runs' worst ratio;
    the smallest concurrency where no k beats MTP off at acceptance 0.7 (disable_by_batch_size)."""
    best: dict[str, dict[str, float]] = {}
    for run in forced:
        c, rate = run["concurrency"], run["rate"]
        speedup = off[c]["per_token_latency_ms"] / run["per_token_latency_ms"]
        key = f"c{c}"
        best.setdefault(key, {})
        best[key][str(rate)] = max(best[key].get(str(rate), 0.0), speedup)
    slowdowns = [
        run["per_token_latency_ms"] / off[run["concurrency"]]["per_token_latency_ms"]
        for run in adaptive
    ]
    threshold = next(
        (
            c
            for c in sorted(off)
            if best.get(f"c{c}", {}).get("0.7", 0.0) and best[f"c{c}"]["0.7"] <= 1.0
        ),
        None,
    )
    return {
        "best_k_speedup": best,
        "adaptive_worst_latency_ratio": max(slowdowns, default=None),
        "disable_by_batch_size": threshold,
    }


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        tp_size=args.tp_size,
        max_num_seqs=max(args.concurrency),
        max_model_len=args.prompt_len + args.output_len + 16,
        **overrides,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, 100_000) for _ in range(args.prompt_len)]
        for _ in range(max(args.concurrency))
    ]
    record: dict[str, Any] = {
        "command": " ".join(["python -m tools.bench_mtp", *sys.argv[1:]]),
        "hardware": host_info(),
        "commit": git_commit(),
        "args": vars(args),
        "model": args.model,
        "bandwidth_bytes_per_s": copy_bandwidth(args.device),
    }
    off: dict[int, dict] = {}
    reference: dict[tuple[int, ...], list[int]] = {}
    async with await AsyncEngine.start(engine_config(args)) as engine:
        await measure(engine, prompts[:1], 4)  # warm-up
        for c in args.concurrency:
            off[c] = await measure(engine, prompts[:c], args.output_len)
            reference.update(zip(map(tuple, prompts[:c]), off[c]["outputs"], strict=True))
    eager = None
    if args.eager_baseline:
        async with await AsyncEngine.start(engine_config(args, enforce_eager=True)) as engine:
            await measure(engine, prompts[:1], 4)
            eager = {
                c: await measure(engine, prompts[:c], args.output_len) for c in args.concurrency
            }
    forced, adaptive = [], []
    record["off_eager"] = (
        [{k: v for k, v in r.items() if k != "outputs"} for r in eager.values()] if eager else []
    )
    save_partial(args.out, record, off, forced, adaptive)  # MTP off's, should MTP on fail
    k_max = max(args.drafts)
    vocab = ModelConfig.from_model_dir(args.model).vocab_size
    spec_config = SpeculativeConfig(
        num_speculative_tokens=k_max, draft_vocab_size=args.draft_vocab_size
    )
    async with await AsyncEngine.start(
        engine_config(args, speculative_config=spec_config)
    ) as engine:
        spec = engine.scheduler.spec
        await measure(engine, prompts[:1], 4)
        for c in args.concurrency:
            for rate in args.acceptance:
                proposer = corrupting_proposer(reference, rate, vocab)
                for k in [*args.drafts, None]:  # None: the adaptive policy
                    spec.force(k, proposer)
                    result = await measure(engine, prompts[:c], args.output_len)
                    result.update(
                        k=k,
                        rate=rate,
                        parted=sum(
                            out != reference[tuple(p)]
                            for p, out in zip(prompts[:c], result["outputs"], strict=True)
                        ),
                    )
                    (forced if k is not None else adaptive).append(result)
                    save_partial(args.out, record, off, forced, adaptive)
                    print(
                        f"c={c} rate={rate} k={k or 'adaptive'}: "
                        f"{result['per_token_latency_ms']:.2f} ms/token "
                        f"(off {off[c]['per_token_latency_ms']:.2f}), "
                        f"acceptance {result['measured_acceptance']}",
                        flush=True,
                    )
        spec.force(None)
    strip = [off[c] for c in off] + forced + adaptive
    first_eager = eager[min(eager)] if eager else None
    bandwidth = record["bandwidth_bytes_per_s"]
    record["costs"] = step_costs(
        off[min(off)], first_eager, forced, args.model, bandwidth, args.draft_vocab_size
    )
    record["summary"] = summarize(off, forced, adaptive)
    for result in strip:
        result.pop("outputs")
    record["off"] = list(off.values())
    record["forced"] = forced
    record["adaptive"] = adaptive
    return record


def save_partial(
    out: str | None, record: dict, off: dict[int, dict], forced: list, adaptive: list
) -> None:
    """The runs so far (no outputs, no summary) at `out`: a run cut short keeps them."""
    if out is None:
        return
    strip = [{k: v for k, v in r.items() if k != "outputs"} for r in off.values()]
    partial = {**record, "partial": True, "off": strip, "forced": [], "adaptive": []}
    for name, runs in (("forced", forced), ("adaptive", adaptive)):
        partial[name] = [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(partial, indent=1) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", required=True, help="a checkpoint with an MTP head (make_model --mtp)"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.5, 0.7, 0.9])
    p.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3, 4], help="k values")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="the head drafts among the first N token ids (speculative_config's "
        "draft_vocab_size); default: the whole vocabulary",
    )
    p.add_argument(
        "--no-eager-baseline",
        dest="eager_baseline",
        action="store_false",
        help="skip MTP off without CUDA graphs",
    )
    p.add_argument("--out", default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    record = asyncio.run(run(args))
    text = json.dumps(record, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(json.dumps(record["summary"], indent=1))
    print(json.dumps(record["costs"], indent=1))
    return record


if __name__ == "__main__":
    main()
