"""Sizing the request state from --gpu-memory-utilization (engine/rank/memory_budget.py).

The arithmetic against what StateCache really allocates; the whole sizing path (profiling
step through the executor, budget, refusal naming the numbers) on the CPU with a fake probe
in place of CUDA's memory statistics; the minimum over ranks with two gloo processes; the
engine and flag plumbing. The CUDA probe itself is checked on a GPU only.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from deltaserve.engine.config import EngineConfig, resolve_limits
from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank import executor as executor_module
from deltaserve.engine.rank import memory_budget
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.engine.rank.memory_budget import (
    GRAPH_POOL_RESERVE_BYTES,
    CacheSizes,
    _min_over_ranks,
    blocks_for_budget,
    cache_sizes,
    profile_lengths,
    size_kv_cache,
)
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.ipc.replica_config import ReplicaConfig
from deltaserve.tools.make_model import make_model

MiB = 2**20


@pytest.mark.parametrize(
    ("state_dtype", "kv_dtype", "mtp"),
    [
        (torch.float32, None, False),
        (torch.bfloat16, torch.float8_e4m3fn, False),
        (torch.bfloat16, torch.float8_e4m3fn, True),
    ],
    ids=["default", "bf16_states_fp8_kv", "bf16_states_fp8_kv_mtp"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cache_sizes_are_what_state_cache_allocates(
    tiny_model_dir, dtype, tp, state_dtype, kv_dtype, mtp
):
    """With an MTP head too: its KV layer in every block (in the cache's KV dtype) and its
    hidden state row in every slot (one spare row besides, for padding rows' writes)."""
    config = ModelConfig.from_model_dir(tiny_model_dir)
    sizes = cache_sizes(config, tp, dtype, 16, state_dtype, kv_dtype, mtp)
    for slots, blocks in ((1, 1), (3, 7)):
        cache = StateCache(
            config,
            slots,
            blocks,
            16,
            tp,
            dtype,
            torch.device("cpu"),
            0,
            state_dtype,
            kv_dtype,
            mtp,
        )
        state = cache.conv.nbytes + cache.recurrent.nbytes
        if mtp:
            spare = config.hidden_size * dtype.itemsize
            state += cache.hidden.nbytes - spare
            assert cache.kv.shape[0] == len(config.full_attention_layers) + 1
        assert state == slots * sizes.slot_bytes
        assert cache.kv.nbytes == blocks * sizes.block_bytes


def test_qwen35_4b_figures():
    """The 4B shape (DESIGN.md): ~50 MB of state per request, bf16 KV of 8 full layers."""
    config = ModelConfig.from_dict(
        {
            "model_type": "qwen3_5_text",
            "vocab_size": 248320,
            "hidden_size": 2560,
            "intermediate_size": 9216,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "max_position_embeddings": 262144,
        }
    )
    sizes = cache_sizes(config, 1, torch.bfloat16, 16)
    # 24 DeltaNet layers: 32 heads x 128 x 128 fp32 + 8192 channels x 3 bf16 each
    assert sizes.slot_bytes == 24 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert 50e6 < sizes.slot_bytes < 52e6
    assert sizes.block_bytes == 8 * 2 * 16 * 4 * 256 * 2  # 0.5 MiB per 16 positions
    assert cache_sizes(config, 2, torch.bfloat16, 16) == CacheSizes(
        sizes.slot_bytes // 2, sizes.block_bytes // 2
    )
    # bf16 states (--mamba-ssm-cache-dtype bfloat16): half the recurrent state's bytes
    half = cache_sizes(config, 1, torch.bfloat16, 16, state_dtype=torch.bfloat16)
    assert half.slot_bytes == 24 * (32 * 128 * 128 * 2 + 8192 * 3 * 2)
    # an FP8 KV cache (--kv-cache-dtype fp8): half a bf16 block's bytes
    fp8 = cache_sizes(config, 1, torch.bfloat16, 16, kv_dtype=torch.float8_e4m3fn)
    assert fp8.block_bytes == sizes.block_bytes // 2


def test_blocks_for_budget():
    sizes = CacheSizes(slot_bytes=1000, block_bytes=300)
    assert blocks_for_budget(10_000, 4, sizes) == 20  # (10000 - 4000) // 300
    assert blocks_for_budget(6_299, 4, sizes) == 7
    assert blocks_for_budget(4_000, 4, sizes) == 0
    assert blocks_for_budget(3_000, 4, sizes) == 0  # not even the slots: never negative
    assert blocks_for_budget(-5, 0, sizes) == 0


@pytest.mark.parametrize(
    "tokens, seqs, max_len, want",
    [
        (2048, 16, 8192, [2033] + [1] * 15),
        (2048, 1, 8192, [2048]),
        (100, 4, 40, [40, 40, 19, 1]),
        (8, 16, 100, [1] * 8),  # never more requests than tokens
        (1000, 2, 100, [100, 100]),  # never more than seqs * max_len
    ],
)
def test_profile_lengths(tokens, seqs, max_len, want):
    got = profile_lengths(tokens, seqs, max_len)
    assert got == want
    assert sum(got) == min(tokens, seqs * max_len) and max(got) <= max_len


class FakeProbe:
    """CUDA's memory statistics, made up; checks that the profiling step is running."""

    def __init__(self, executor: Executor, total: int, in_use: int, peak: int) -> None:
        self.executor, self.total, self.in_use, self.peak = executor, total, in_use, peak
        self.held_during_step: int | None = None

    def in_use_and_total(self) -> tuple[int, int]:
        return self.in_use, self.total

    def start_peak(self) -> None:
        assert not self.executor.requests

    def peak_since_start(self) -> int:
        self.held_during_step = len(self.executor.requests)
        return self.peak


def graph_reserve(executor, peak: int) -> int:
    """The fixture's CUDA-graph reserve: the decode buckets' logits and hidden states (4
    slots) and pool; the prompt buckets' (16, 32, 64, 100 tokens, 4 prompts each) logits,
    every row's hidden states, and a pool as large as the 100-token profiling step's
    activations."""
    mc = executor.model_config
    hidden_rows = 2 * 4 + 16 + 32 + 64 + 100
    return (
        GRAPH_POOL_RESERVE_BYTES
        + (2 * 4 + 4 * 4) * mc.vocab_size * 4
        + hidden_rows * mc.hidden_size * executor.dtype.itemsize
        + peak
    )


@pytest.fixture(scope="module")
def executor(tiny_model_dir):
    config = ExecutorConfig(
        str(tiny_model_dir),
        max_num_seqs=4,
        num_kv_blocks=8,
        max_model_len=64,
        max_num_batched_tokens=100,
        gpu_memory_utilization=0.5,
    )
    return Executor(config)


def test_size_kv_cache_budget(executor):
    sizes = cache_sizes(executor.model_config, 1, executor.dtype, 16)
    total, in_use, peak = 1000 * MiB, 100 * MiB, 30 * MiB
    probe = FakeProbe(executor, total, in_use, peak)
    cache = executor.cache
    budget = size_kv_cache(executor, probe)
    reserve = graph_reserve(executor, peak)
    left = 500 * MiB - in_use - peak - reserve
    assert budget.budget == left and budget.reserve == reserve
    assert (
        budget.num_blocks
        == budget.local_blocks
        == (left - 4 * sizes.slot_bytes) // sizes.block_bytes
    )
    assert budget.num_blocks > 0 and budget.num_slots == 4 and budget.activations == peak
    # the step ran through the executor: 4 requests (100 tokens) held while it was measured
    assert probe.held_during_step == 4 and budget.profile_tokens == 100
    # and left nothing behind: the executor's cache, requests and sampler are as before
    assert executor.cache is cache and not executor.requests and not executor.sampler._requests
    assert cache.free_slots == cache.num_slots and cache.free_blocks == cache.num_blocks
    text = budget.describe()
    for words in (
        "gpu_memory_utilization 0.5",
        "4 state slots",
        f"{budget.num_blocks} KV blocks of 16",
        f"{budget.num_blocks * 16} tokens of KV",
        "activations 0.03 GiB",
    ):
        assert words in text, text


def test_size_kv_cache_refuses_too_little_naming_the_numbers(executor):
    # room for the 4 slots but not for one max_model_len (64 positions = 4 blocks) request
    sizes = cache_sizes(executor.model_config, 1, executor.dtype, 16)
    reserve = graph_reserve(executor, 0)
    total = 2 * (10 * MiB + reserve + 4 * sizes.slot_bytes + 3 * sizes.block_bytes)
    with pytest.raises(MemoryError) as info:
        size_kv_cache(executor, FakeProbe(executor, total, 10 * MiB, 0))
    message = str(info.value)
    for words in (
        "not enough device memory",
        "4 state slots",
        "max_model_len 64",
        "needs 4 KV blocks",
        "but 3 fit",
        "--gpu-memory-utilization",
    ):
        assert words in message, message
    assert not executor.requests


def test_cpu_executor_wants_explicit_blocks(tiny_model_dir):
    with pytest.raises(ValueError, match="CUDA only"):
        Executor(
            ExecutorConfig(
                str(tiny_model_dir), max_num_seqs=1, num_kv_blocks=None, max_model_len=32
            )
        )


def _agree(rank: int, init: str, values: list[int], out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=len(values))
    try:
        got = _min_over_ranks(values[rank], torch.device("cpu"))
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(got))
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_the_minimum(tmp_path):
    values = [1234, 987]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(
        _agree,
        args=(f"file://{tmp_path}/store", values, str(tmp_path / "out")),
        nprocs=2,
        start_method="spawn",
    )
    assert [int((tmp_path / f"out.{r}").read_text()) for r in range(2)] == [987, 987]


# ---- the engine's side ---------------------------------------------------------------------


def test_engine_config_and_limits(tiny_model_dir):
    model_config = ModelConfig.from_model_dir(tiny_model_dir)
    for bad in (0.0, -0.1, 1.01, float("nan"), float("inf"), "0.9", True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model=str(tiny_model_dir), gpu_memory_utilization=bad)
    cpu = EngineConfig(model=str(tiny_model_dir), max_model_len=64, max_num_seqs=4)
    assert resolve_limits(cpu, model_config).num_kv_blocks == 4 * 64 // 16  # today's sizing
    cuda = EngineConfig(model=str(tiny_model_dir), device="cuda", max_model_len=64)
    assert resolve_limits(cuda, model_config).num_kv_blocks is None  # the ranks size it
    fixed = EngineConfig(
        model=str(tiny_model_dir), device="cuda", max_model_len=64, num_kv_blocks=9
    )
    assert resolve_limits(fixed, model_config).num_kv_blocks == 9
    # the step's token budget defaults by device; a given one is kept
    assert (cpu.max_num_batched_tokens, cuda.max_num_batched_tokens) == (2048, 8192)
    assert (
        EngineConfig(
            model=str(tiny_model_dir), device="cuda", max_num_batched_tokens=512
        ).max_num_batched_tokens
        == 512
    )


def test_replica_config_num_kv_blocks_none_is_cuda_only():
    ReplicaConfig(ExecutorConfig("/m", device="cuda", gpu_memory_utilization=0.8))
    with pytest.raises(ValueError, match=r"num_kv_blocks None sizes .*: CUDA only"):
        ReplicaConfig(ExecutorConfig("/m"))
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ExecutorConfig("/m", device="cuda", gpu_memory_utilization=1.5)


def test_serve_flag():
    from deltaserve.engine.config_flags import engine_config
    from deltaserve.http.serve import build_parser

    args = build_parser().parse_args(
        ["--model", "/m", "--device", "cpu", "--gpu-memory-utilization", "0.75"]
    )
    assert engine_config(args).gpu_memory_utilization == 0.75
    args = build_parser().parse_args(["--model", "/m", "--device", "cpu"])
    assert engine_config(args).gpu_memory_utilization == 0.9


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "mtp"])
def test_executor_sizes_its_cache_at_start_up(tmp_path, monkeypatch, speculate):
    """`Executor.__init__` runs the profiling step (CUDA: `size_kv_cache`, or `warm_up`)
    before its cache and speculator exist: every attribute a step reads must be set by then.
    A fake probe stands in for the device's memory so that the CPU runs the same path."""
    model_dir = make_model(tmp_path / "m", preset="tiny", dtype="fp32", mtp="random")
    real = memory_budget.size_kv_cache
    budgets = []

    def sized(executor):
        budgets.append(real(executor, FakeProbe(executor, 1000 * MiB, 100 * MiB, 30 * MiB)))
        return budgets[-1]

    monkeypatch.setattr(executor_module, "size_kv_cache", sized)
    spec = SpeculativeConfig(num_speculative_tokens=2) if speculate else None
    config = ExecutorConfig(
        str(model_dir),
        max_num_seqs=2,
        num_kv_blocks=None,
        max_model_len=64,
        max_num_batched_tokens=64,
        speculative_config=spec,
    )
    ex = Executor(config)
    assert len(budgets) == 1 and ex.cache.num_blocks == budgets[0].num_blocks > 0
    assert (ex.speculator is not None) == speculate
