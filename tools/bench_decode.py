"""Decode benchmark on one GPU: ceilings, kernels, the Executor's forward step, HF transformers.

Reported gpt-fast style (STYLE.md): tokens/s beside achieved GB/s and the fraction of the
memory roofline, i.e. the bytes a decode step must move (every weight read once, the DeltaNet
state (fp32, or bf16 with --mamba-ssm-cache-dtype bfloat16) and conv windows read and written
once, the KV of every context position read once, FP8 with --kv-cache-dtype fp8) over the copy
bandwidth measured in the same run. HF transformers decodes the same
random checkpoint in the same run.

    python -m tools.bench_decode --out /tmp/bench.json        # on the GPU machine
    python -m tools.bench_decode --preset tiny --device cpu --batches 1 2 --context 24 \\
        --steps 2 --no-kernels --out /tmp/smoke.json          # smoke test of the script

The checkpoint is made where the benchmark runs (`python -m tools.make_model --preset 4b
--dtype bf16 --device cuda`), never carried.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_events(fn: Callable[[], None], reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_graph(calls: list[Callable[[], None]], reps: int = 20) -> float:
    """Median seconds per call, the calls captured back to back in one CUDA graph (so launch
    gaps are those of a graphed decode step, not of Python)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return time_events(graph.replay, reps) / len(calls)


def ceilings(device: torch.device) -> dict:
    """Copy bandwidth (bytes read + written) and the bf16 matmul rate, on random data."""
    n = 1 << 30  # 2 GiB of bf16 per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = time_events(partial(dst.copy_, src), reps=20)
    src = dst = None
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_s = time_events(lambda: a @ b, reps=10)
    return {"copy_GBps": 2 * n * 2 / copy_s / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_s / 1e12}


# ---- kernels at 4B shapes ------------------------------------------------------------------


def bench_kernels(
    device: torch.device, copy_gbps: float, batches: list[int], context: int, sweep: bool
) -> list[dict]:
    """Each decode kernel at 4B shapes, timed inside a CUDA graph with its inputs rotated so
    that no call finds them in the L2; with `sweep`, also the launch variants it was tuned on."""
    from deltaserve.kernels.causal_conv1d import causal_conv1d_update
    from deltaserve.kernels.gated_delta import gated_delta_decode
    from deltaserve.kernels.paged_attention import paged_decode_attention
    from deltaserve.kernels.rmsnorm import gated_rms_norm_triton, rms_norm_triton
    from deltaserve.kernels.rope import norm_rope

    rows = []

    def record(kernel: str, batch: int, config: str, seconds: float, nbytes: int) -> None:
        gbps = nbytes / seconds / 1e9
        rows.append(
            {
                "kernel": kernel,
                "batch": batch,
                "config": config,
                "us": seconds * 1e6,
                "GBps": gbps,
                "fraction_of_copy": gbps / copy_gbps,
            }
        )

    nk, nv, dk, dv, pool = 16, 32, 128, 128, 256
    state = torch.randn(pool, nv, dk, dv, device=device) * 0.1
    a_log = torch.randn(nv, device=device).bfloat16()
    dt_bias = torch.randn(nv, device=device).bfloat16()
    channels = 2 * nk * dk + nv * dv
    conv_state = torch.randn(pool, channels, 3, device=device).bfloat16()
    conv_w = torch.randn(channels, 4, device=device).bfloat16()
    nh, nkv, hd, bs = 16, 4, 256, 16
    blocks_per = -(-context // bs)
    kv_rows = pool * blocks_per * bs
    k_cache = torch.randn(kv_rows, nkv, hd, device=device).bfloat16()
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(pool * blocks_per, device=device).view(pool, blocks_per)
    for batch in batches:
        sets = max(4, min(32, pool // batch))  # rotate slots so that no call hits the L2
        perm = [torch.randperm(pool, device=device)[:batch].int() for _ in range(sets)]
        ident = torch.arange(batch, device=device, dtype=torch.int32)
        mixed = torch.randn(batch, channels, device=device).bfloat16()
        a = torch.randn(batch, nv, device=device).bfloat16()
        b = torch.randn(batch, nv, device=device).bfloat16()
        core = torch.empty(batch, nv, dv, device=device, dtype=torch.bfloat16)
        state_bytes = 2 * batch * nv * dk * dv * 4
        configs = [
            (None, None, False),
            (16, 2, False),
            (16, 1, False),
            (32, 2, False),
            (32, 4, False),
            (64, 2, False),
            (64, 4, False),
            (128, 4, False),
            (16, 2, True),
            (32, 2, True),
            (64, 4, True),
            (128, 4, True),
        ]
        for block_v, warps, evict in configs if sweep else configs[:1]:
            calls = [
                partial(
                    gated_delta_decode,
                    mixed,
                    a,
                    b,
                    a_log,
                    dt_bias,
                    state,
                    ident,
                    s,
                    core,
                    nk,
                    block_v=block_v,
                    num_warps=warps,
                    evict_first=evict,
                )
                for s in perm
            ]
            name = (
                "default"
                if block_v is None
                else f"BV={block_v},w={warps}{',evict' if evict else ''}"
            )
            record("gated_delta_decode", batch, name, time_graph(calls), state_bytes)
        qkv = torch.randn(batch, channels, device=device).bfloat16()
        mixed_out = torch.empty_like(qkv)
        calls = [
            partial(causal_conv1d_update, qkv, conv_w, conv_state, ident, s, mixed_out)
            for s in perm
        ]
        record(
            "causal_conv1d_update",
            batch,
            "default",
            time_graph(calls),
            2 * batch * channels * 3 * 2 + 2 * batch * channels * 2,
        )
        x = torch.randn(batch, 2560, device=device).bfloat16()
        w = torch.randn(2560, device=device).bfloat16()
        q = torch.randn(batch, nh, hd, device=device).bfloat16()
        out = torch.empty_like(q)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        attention_configs = [
            {},
            {"block_n": 32, "num_stages": 2},
            {"block_n": 32, "num_stages": 3},
            {"block_n": 64, "num_stages": 2},
            {"block_n": 64, "num_warps": 8, "num_stages": 2},
            {"block_n": 16, "num_stages": 3},
            {"parts_per_sm": 4},
            {"parts_per_sm": 8},
            {"block_n": 64, "num_stages": 2, "parts_per_sm": 4},
            # from 5 stages Triton gives K and V two buffers (a tile in flight
            # while the last is used); measured slower at 64 rows
            {"block_n": 16, "num_stages": 5},
            {"block_n": 32, "num_stages": 5},
            {"block_n": 16, "num_stages": 7},
        ]
        for extra in attention_configs if sweep else attention_configs[:1]:
            calls = [
                partial(
                    paged_decode_attention,
                    q,
                    k_cache,
                    v_cache,
                    tables[s.long()],
                    seq_lens,
                    ident,
                    bs,
                    hd**-0.5,
                    out,
                    context,
                    **extra,
                )
                for s in perm
            ]
            name = ",".join(f"{k}={v}" for k, v in extra.items()) or "default"
            record(
                "paged_decode_attention",
                batch,
                f"ctx {context} {name}",
                time_graph(calls),
                batch * context * nkv * hd * 2 * 2,
            )
        qg = torch.randn(batch, nh, 2 * hd, device=device).bfloat16()[..., :hd]
        kk = torch.randn(batch, nkv, hd, device=device).bfloat16()
        inv_freq = 1.0 / (1e7 ** (torch.arange(0, 64, 2, device=device).float() / 64))
        positions = torch.full((batch,), context, device=device)
        record(
            "norm_rope",
            batch,
            "q 16 + k 4 heads",
            time_graph([partial(norm_rope, qg, kk, w[:hd], w[:hd], positions, inv_freq, 1e-6)] * 8),
            2 * batch * (nh + nkv) * hd * 2,
        )
        record(
            "rms_norm",
            batch,
            "hidden 2560",
            time_graph([partial(rms_norm_triton, x, w, 1e-6)] * 8),
            2 * batch * 2560 * 2,
        )
        z = torch.randn(batch, nv, dv, device=device).bfloat16()
        wg = torch.randn(dv, device=device).bfloat16()
        record(
            "gated_rms_norm",
            batch,
            "32 x 128",
            time_graph([partial(gated_rms_norm_triton, core, z, wg, 1e-6)] * 8),
            3 * batch * nv * dv * 2,
        )
    return rows


def bench_fla_prefill(device: torch.device, tokens: int = 4096) -> dict | None:
    """One DeltaNet layer's chunked prefill (fla) at 4B shapes, bf16 inputs."""
    from deltaserve.kernels.causal_conv1d import span_blocks
    from deltaserve.kernels.gated_delta import CHUNK_SIZE, fla_chunk_kernel, gated_delta_prefill

    if fla_chunk_kernel() is None:
        return None
    nk, nv, dk, dv = 16, 32, 128, 128
    mixed = torch.randn(tokens, 2 * nk * dk + nv * dv, device=device).bfloat16()
    a, b = (
        torch.randn(tokens, nv, device=device).bfloat16(),
        torch.randn(tokens, nv, device=device).bfloat16(),
    )
    a_log, dt_bias = (
        torch.rand(nv, device=device).bfloat16(),
        torch.randn(nv, device=device).bfloat16(),
    )
    state = torch.zeros(2, nv, dk, dv, device=device)
    i32 = {"dtype": torch.int32, "device": device}
    spans = (
        torch.zeros(1, **i32),
        torch.tensor([0, tokens], **i32),
        torch.tensor(span_blocks([tokens], CHUNK_SIZE), **i32),
    )
    seconds = time_events(
        lambda: gated_delta_prefill(mixed, a, b, a_log, dt_bias, state, *spans, nk), reps=10
    )
    return {"tokens": tokens, "ms_per_layer": seconds * 1e3}


# ---- the model -------------------------------------------------------------------------------


def idle_expert_params(config, experts_used: float) -> float:
    """Parameters of a mixture-of-experts model's routed experts that a step (or a token) does
    not use, when each layer uses `experts_used` of its experts; 0 for a dense model."""
    if not config.num_experts:
        return 0.0
    per_expert = 3 * config.moe_intermediate_size * config.hidden_size
    return config.num_hidden_layers * (config.num_experts - experts_used) * per_expert


def step_bytes(
    config,
    params_bytes: int,
    batch: int,
    context: int,
    dtype: torch.dtype,
    state_dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Bytes one decode step must move: weights once (of an input embedding apart from the
    lm_head, the 9B's, only its rows of the step; of an MoE model's routed experts, those its
    tokens choose: E (1 - (1 - k/E)^batch) a layer, expected under even routing), each
    request's state slot (DeltaNet state and conv windows) read and written, every context
    position's K and V read (its own K and V written)."""
    from deltaserve.engine.rank.memory_budget import cache_sizes

    # block_bytes: K and V of one position
    per = cache_sizes(config, 1, dtype, 1, state_dtype, kv_dtype)
    embedding = (
        0
        if config.tie_word_embeddings
        else (config.vocab_size - batch) * config.hidden_size * dtype.itemsize
    )
    used = config.num_experts * (
        1 - (1 - config.num_experts_per_tok / max(1, config.num_experts)) ** batch
    )
    idle = round(idle_expert_params(config, used) * dtype.itemsize)
    return (
        params_bytes
        - embedding
        - idle
        + batch * (2 * per.slot_bytes + per.block_bytes * (context + 1))
    )


def bench_model(
    args, device: torch.device, copy_gbps: float | None, matmul_tflops: float | None
) -> dict:
    from deltaserve.engine.rank.executor import Executor, ExecutorConfig
    from deltaserve.engine.rank.step_meta import with_step_meta
    from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

    max_batch = max(args.batches)
    total_steps = len(args.batches) * (args.steps + 3) * 3 + 8
    reserve = args.context + total_steps
    blocks_per = -(-reserve // args.block_size)
    config = ExecutorConfig(
        args.model,
        device=str(device),
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=max_batch,
        num_kv_blocks=max_batch * blocks_per,
        max_model_len=reserve,
        enforce_eager=args.no_graphs,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.kv_cache_dtype != "auto",
    )
    started = time.monotonic()
    ex = Executor(config)  # loads the weights, captures the decode graphs
    sync(device)
    result = {"load_s": time.monotonic() - started}
    params_bytes = sum(p.numel() * p.element_size() for p in ex.model.parameters())
    gen = torch.Generator().manual_seed(0)
    spec = SamplingSpec(seed=0)
    last = {}
    started = time.monotonic()
    chunk = max(1, 8192 // args.context)
    for first in range(0, max_batch, chunk):  # prefill: several prompts per step
        ids = range(first, min(max_batch, first + chunk))
        items = [
            StepItem(
                r,
                0,
                torch.randint(0, 240000, (args.context,), generator=gen).tolist(),
                True,
                NewRequest(reserve, spec),
            )
            for r in ids
        ]
        logits = ex.forward(items)
        for r, row in zip(ids, logits.argmax(-1).tolist(), strict=True):
            last[r] = row
    sync(device)
    result["prefill_s"] = time.monotonic() - started
    result["prefill_tokens"] = max_batch * args.context

    def decode_items(batch: int) -> list:
        return [StepItem(r, ex.requests[r].num_tokens, [last[r]], True, None) for r in range(batch)]

    def finish(items, logits) -> None:
        for item, token in zip(items, logits.argmax(-1).tolist(), strict=True):
            ex.requests[item.request_id].num_tokens = item.start + 1
            last[item.request_id] = token

    def run_eager(batch: int) -> None:
        items = decode_items(batch)
        finish(items, ex.forward(items))

    def run_meta(batch: int) -> None:
        items = decode_items(batch)
        ex._admit_new(items, [], [], [])
        step = with_step_meta(ex._build_batch(items, False), device)
        finish(items, ex.model(step, ex.cache))

    graphs = ex.graphs
    # executor_forward: the executor's step as the rank runs it (graph replays when captured)
    modes = {"executor_forward": run_eager, "eager_meta_once": run_meta}
    rows = []
    for batch in args.batches:
        for mode, fn in modes.items():
            for _ in range(2):
                fn(batch)
            sync(device)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fn(batch)
                sync(device)
                times.append(time.perf_counter() - t0)
            step_s = statistics.median(times)
            context = ex.requests[0].num_tokens
            nbytes = step_bytes(
                ex.model_config, params_bytes, batch, context, ex.dtype, ex.state_dtype, ex.kv_dtype
            )
            row = {
                "mode": mode,
                "batch": batch,
                "context": context,
                "step_ms": step_s * 1e3,
                "tokens_per_s": batch / step_s,
                "bytes_per_step": nbytes,
                "GBps": nbytes / step_s / 1e9,
            }
            if (
                mode == "executor_forward" and graphs is not None
            ):  # the GPU's part alone: replay in place
                graph = graphs.graphs[min(b for b in graphs.graphs if b >= batch)][0]
                row["graph_replay_ms"] = time_events(graph.replay, reps=args.steps) * 1e3
            if copy_gbps:
                row["roofline_ms"] = nbytes / (copy_gbps * 1e9) * 1e3
                row["fraction_of_roofline"] = row["roofline_ms"] / row["step_ms"]
                if "graph_replay_ms" in row:
                    row["fraction_of_roofline_replay"] = row["roofline_ms"] / row["graph_replay_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    result.update({"params_bytes": params_bytes, "decode": rows})
    if device.type == "cuda":
        result["profiles"] = {}
        for batch in sorted({min(args.batches), max_batch}):
            for mode, fn in modes.items():
                result["profiles"][f"{mode}_b{batch}"] = profile_step(fn, batch, device)
    if args.prefill:
        ex.drop(list(range(max_batch)))  # the decode requests' slots and blocks
        result["prefill"], prefill_profiles = bench_prefill(ex, device, args.prefill, matmul_tflops)
        result.setdefault("profiles", {}).update(prefill_profiles)
    return result


def profile_step(
    fn: Callable[[int], None], batch: int, device: torch.device, top: int = 25
) -> dict:
    """GPU time per kernel name over one step (torch.profiler): where a step's time goes, and
    how much of it is kernels at all (the rest is launch gaps and host work); the host's
    busiest torch calls beside it, and cProfile's busiest Python functions over a second run."""
    import cProfile
    import pstats

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        fn(batch)
        sync(device)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(batch)
            sync(device)
        wall = time.perf_counter() - t0
        kernels, host = [], []
        for e in prof.key_averages():
            if e.device_type == DeviceType.CUDA:
                kernels.append(
                    {"name": e.key[:90], "count": e.count, "us": e.self_device_time_total}
                )
            else:
                host.append({"name": e.key[:60], "count": e.count, "us": e.self_cpu_time_total})
        kernels = sorted((k for k in kernels if k["us"] > 0), key=lambda k: -k["us"])
        host.sort(key=lambda k: -k["us"])
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.runcall(fn, batch)
        python_wall = time.perf_counter() - t0
        stats = pstats.Stats(profiler).sort_stats("tottime")
        python = [
            {
                "function": f"{Path(f).name}:{line}:{name}",
                "calls": nc,
                "tottime_ms": tt * 1e3,
                "cumtime_ms": ct * 1e3,
            }
            for (f, line, name), (_, nc, tt, ct, _) in sorted(
                stats.stats.items(), key=lambda kv: -kv[1][2]
            )[:top]
        ]
        return {
            "wall_ms_profiled": wall * 1e3,
            "kernel_ms_total": sum(k["us"] for k in kernels) / 1e3,
            "kernel_launches": sum(k["count"] for k in kernels),
            "top": kernels[:top],
            "host_top": host[:top],
            "python_wall_ms": python_wall * 1e3,
            "python_top": python,
        }
    except Exception as exc:  # the profiler is a diagnostic: never lose the run to it
        return {"error": repr(exc)}


def prefill_flops(config, params_bytes: int, dtype_bytes: int, tokens: int) -> float:
    """Model FLOPs of one prompt of `tokens` tokens: 2 per weight per token for every matrix
    but the output embedding (only the last position's logits; of an MoE model's routed
    experts, a token's k), plus causal attention's QK^T and PV (2 x 2 x T^2 / 2 x heads x
    head_dim per full-attention layer)."""
    embedding = config.vocab_size * config.hidden_size
    matrix_params = params_bytes // dtype_bytes - embedding * (
        1 if config.tie_word_embeddings else 2
    )
    matrix_params -= idle_expert_params(config, config.num_experts_per_tok)
    attention = (
        len(config.full_attention_layers)
        * 2
        * tokens
        * tokens
        * config.num_attention_heads
        * config.head_dim
    )
    return 2.0 * matrix_params * tokens + attention + 2.0 * embedding


def bench_prefill(
    ex, device: torch.device, lengths: list[int], matmul_tflops: float | None, batched: int = 8
) -> tuple[list[dict], dict]:
    """Prompts in one forward step (as the engine runs prompts that fit max_num_batched_tokens):
    one prompt of each length, then `batched` prompts of the shortest length together (what a
    busy server's step holds); seconds, tokens/s, model FLOP/s and its fraction of the measured
    bf16 matmul rate. Also the GPU profile of each shape's step."""
    from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

    params_bytes = sum(p.numel() * p.element_size() for p in ex.model.parameters())
    rows, profiles = [], {}
    gen = torch.Generator().manual_seed(2)
    batched = min(batched, ex.config.max_num_seqs)
    shapes = [(1, n) for n in lengths] + (
        [(batched, min(lengths))] if batched > 1 and lengths else []
    )
    for count, n in shapes:
        next_id = iter(range(10_000, 10_000_000))

        def run(_: int, count: int = count, n: int = n, next_id=next_id) -> None:
            rids = [next(next_id) for _ in range(count)]
            ex.forward(
                [
                    StepItem(
                        rid,
                        0,
                        torch.randint(0, 240000, (n,), generator=gen).tolist(),
                        True,
                        NewRequest(n + 1, SamplingSpec(seed=0)),
                    )
                    for rid in rids
                ]
            )
            sync(device)
            ex.drop(rids)

        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            run(0)
            times.append(time.perf_counter() - t0)
        seconds = min(times[1:])  # the first run compiles
        flops = count * prefill_flops(ex.model_config, params_bytes, ex.dtype.itemsize, n)
        row = {
            "prompts": count,
            "tokens": n,
            "seconds": seconds,
            "tokens_per_s": count * n / seconds,
            "model_TFLOPs": flops / seconds / 1e12,
        }
        if matmul_tflops:
            row["fraction_of_matmul"] = row["model_TFLOPs"] / matmul_tflops
        rows.append(row)
        print(json.dumps({"prefill": row}), flush=True)
        if device.type == "cuda" and n <= 4096:
            profiles[f"prefill_{count}x{n}"] = profile_step(run, 0, device)
    return rows, profiles


async def bench_engine(
    args,
    batches: list[int],
    context: int,
    new_tokens: int,
    tp: int = 1,
    pipelining: str = "overlap",
) -> list[dict]:
    """AsyncEngine through its rank processes (greedy, ignore_eos) at tensor-parallel size
    `tp`, with pipelined steps that the ranks overlap ("overlap", the default), pipelined
    steps each finished before the next is queued ("on"), or none ("off"): `batch` requests
    of `context` prompt tokens decoding together; time per output token once all decode."""
    import asyncio

    from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams

    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(batches),
        tp_size=tp,
        max_model_len=context + new_tokens + 16,
        max_num_batched_tokens=8192,
        async_scheduling=pipelining != "off",
        overlap_steps=pipelining == "overlap",
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    rows = []
    async with await AsyncEngine.start(config) as engine:

        async def one(ids: list[int]) -> list[float]:
            return [
                time.perf_counter()
                async for e in engine.generate(ids, params)
                if hasattr(e, "token_id")
            ]

        for batch in batches:
            prompts = [
                torch.randint(0, 240000, (context,), generator=gen).tolist() for _ in range(batch)
            ]
            m = engine.metrics
            before = (m.steps_total, m.step_seconds_total, m.scheduler_seconds_total)
            stamps = await asyncio.gather(*(one(ids) for ids in prompts))
            n_steps, ranks_s, sched_s = (
                b - a
                for a, b in zip(
                    before,
                    (m.steps_total, m.step_seconds_total, m.scheduler_seconds_total),
                    strict=True,
                )
            )
            start = max(s[0] for s in stamps)  # every request decoding from here on
            end = min(s[-1] for s in stamps)
            steps = min(sum(1 for t in s if start < t <= end) for s in stamps)
            step_s = (end - start) / max(steps, 1)
            rows.append(
                {
                    "tp": tp,
                    "pipelined": pipelining != "off",
                    "overlapped": pipelining == "overlap",
                    "batch": batch,
                    "context": context,
                    "ms_per_output_token": step_s * 1e3,
                    "tokens_per_s": batch / step_s,
                    # every step of the run (its prefill too): time on the ranks, and the
                    # scheduler's between steps (the ranks idle)
                    "mean_step_ms": ranks_s / max(n_steps, 1) * 1e3,
                    "mean_scheduler_ms": sched_s / max(n_steps, 1) * 1e3,
                }
            )
            print(json.dumps({"engine": rows[-1]}), flush=True)
    return rows


def write_report(path: str | None, tool: str, **fields) -> None:
    """`fields` as JSON at `path` (if any), with the command that made them and the GPU's
    hardware: the step tools' result files."""
    if path:
        report = {
            "command": " ".join([f"python -m tools.{tool}", *sys.argv[1:]]),
            "hardware": hardware(torch.device("cuda")),
            **fields,
        }
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def hardware(device: torch.device) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    for name in ("triton", "transformers", "fla"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            {
                "gpu": props.name,
                "sms": props.multi_processor_count,
                "memory_GiB": props.total_memory / 2**30,
            }
        )
        try:
            info["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.max.mem",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: make one)")
    parser.add_argument("--preset", default="4b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=1000, help="prompt tokens before decoding")
    parser.add_argument(
        "--steps", type=int, default=10, help="timed decode steps per batch and mode"
    )
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--hf-steps", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        help="the DeltaNet states' dtype in the model runs (auto: the checkpoint's, fp32)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the KV cache's in the model runs: auto (the model's) or fp8 (scales calculated)",
    )
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument(
        "--sweep", action="store_true", help="also time the kernels' launch variants"
    )
    parser.add_argument(
        "--prefill", type=int, nargs="*", default=[1024, 4096, 16384], help="prompt lengths"
    )
    parser.add_argument("--hf-prefill", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--engine-batches", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument(
        "--engine-tokens", type=int, default=128, help="output tokens per engine request"
    )
    parser.add_argument(
        "--engine-tp", type=int, nargs="+", default=[1], help="TP sizes of the engine runs"
    )
    parser.add_argument(
        "--engine-pipelining",
        nargs="+",
        choices=["overlap", "on", "off"],
        default=["overlap", "off"],
        help="engine runs with pipelined steps the ranks overlap, pipelined steps each "
        "finished before the next is queued, none; several: an A/B in one run",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    report = {
        "command": " ".join([sys.executable, "-m", "tools.bench_decode", *sys.argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hardware": hardware(device),
        "git_commit": os.environ.get("DELTASERVE_COMMIT"),
    }

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    copy_gbps = None
    if device.type == "cuda":
        report["ceilings"] = ceilings(device)
        copy_gbps = report["ceilings"]["copy_GBps"]
        print(json.dumps(report["ceilings"]), flush=True)
        if not args.no_kernels:
            report["kernels"] = bench_kernels(
                device, copy_gbps, args.batches, args.context, args.sweep
            )
            report["fla_chunk_prefill"] = bench_fla_prefill(device)
        save()
    if args.model is None:
        args.model = f"/tmp/bench_{args.preset}_{'bf16' if args.dtype == 'bfloat16' else 'fp32'}"
        started = time.monotonic()
        make = [
            sys.executable,
            "-m",
            "tools.make_model",
            "--preset",
            args.preset,
            "--out",
            args.model,
            "--dtype",
            "bf16" if args.dtype == "bfloat16" else "fp32",
            "--device",
            device.type,
        ]
        subprocess.run(make, check=True)
        report["make_model"] = {"command": " ".join(make), "seconds": time.monotonic() - started}
    matmul = report.get("ceilings", {}).get("bf16_matmul_TFLOPs")
    report["model"] = bench_model(args, device, copy_gbps, matmul)
    save()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    if args.engine_batches:
        import asyncio

        report["engine"] = [
            row
            for tp in args.engine_tp
            for pipelining in args.engine_pipelining
            for row in asyncio.run(
                bench_engine(
                    args, args.engine_batches, args.context, args.engine_tokens, tp, pipelining
                )
            )
        ]
        for row in report["engine"]:
            decode = next(
                (
                    r
                    for r in report["model"]["decode"]
                    if r["batch"] == row["batch"] and "roofline_ms" in r and row["tp"] == 1
                ),
                None,
            )
            if decode:
                row["roofline_ms"] = decode["roofline_ms"]
                row["ratio_to_roofline"] = row["ms_per_output_token"] / decode["roofline_ms"]
        save()
    if args.hf_batches:
        from deltaserve.tools.bench_hf import bench_hf

        report["hf_transformers"], report["hf_prefill"] = bench_hf(
            args.model,
            args.dtype,
            device,
            args.hf_batches,
            args.context,
            args.hf_steps,
            args.hf_prefill,
        )
    save()
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    for row in report.get("kernels", []):
        print(
            f"kernel {row['kernel']:24s} b={row['batch']:3d} {row['config']:18s} {row['us']:9.1f} "
            f"us {row['GBps']:8.0f} GB/s {row['fraction_of_copy']:6.1%}"
        )
    for row in report["model"]["decode"]:
        frac = row.get("fraction_of_roofline", math.nan)
        replay = (
            f" (replay alone {row['graph_replay_ms']:.2f} ms)" if "graph_replay_ms" in row else ""
        )
        print(
            f"model {row['mode']:17s} b={row['batch']:3d} ctx={row['context']:5d} "
            f"{row['step_ms']:8.2f} ms "
            f"{row['tokens_per_s']:9.1f} tok/s {row['GBps']:7.0f} GB/s roofline {frac:6.1%}{replay}"
        )
    for name, prof in report["model"].get("profiles", {}).items():
        if "error" in prof:
            print(f"profile {name}: {prof['error']}")
            continue
        print(
            f"profile {name}: {prof['kernel_launches']} kernels, {prof['kernel_ms_total']:.2f} ms "
            f"of kernel time in a {prof['wall_ms_profiled']:.2f} ms step; top: "
            + "; ".join(
                f"{k['name'][:40]} x{k['count']} {k['us'] / 1e3:.2f} ms" for k in prof["top"][:6]
            )
        )
    for row in report["model"].get("prefill", []):
        frac = row.get("fraction_of_matmul", math.nan)
        print(
            f"prefill {row.get('prompts', 1)} x {row['tokens']:6d} tokens "
            f"{row['seconds'] * 1e3:8.1f} ms {row['tokens_per_s']:9.0f} tok/s "
            f"{row['model_TFLOPs']:6.1f} TFLOP/s = {frac:6.1%} of matmul"
        )
    for row in report.get("engine", []):
        mode = "pipelined" if row.get("pipelined", False) else "sync"
        ratio = (
            f"x{row['ratio_to_roofline']:.2f} of roofline"
            if "ratio_to_roofline" in row
            else "(batch not in --batches)"
        )
        print(
            f"engine tp={row['tp']} {mode:9s} b={row['batch']:3d} "
            f"{row['ms_per_output_token']:8.2f} ms/step {row['tokens_per_s']:9.1f} tok/s "
            f"{ratio}; steps {row['mean_step_ms']:.2f} ms on the ranks "
            f"+ {row['mean_scheduler_ms']:.2f} ms scheduler"
        )
    for row in report.get("hf_prefill", []):
        print(
            f"hf prefill {row['tokens']:6d} tokens {row['seconds'] * 1e3:8.1f} ms "
            f"{row['tokens_per_s']:9.0f} tok/s"
        )
    for row in report.get("hf_transformers", []):
        print(f"hf b={row['batch']:3d} {row['step_ms']:8.2f} ms {row['tokens_per_s']:8.1f} tok/s")


if __name__ == "__main__":
    sys.exit(main())
