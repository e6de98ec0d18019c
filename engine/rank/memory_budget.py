"""The request state's size on CUDA from `gpu_memory_utilization` (vLLM's name and meaning:
the share of the device's total memory this engine may use).

When the executor gets no `num_kv_blocks`, `size_kv_cache` runs, after the weights are loaded
and before the cache exists: one profiling step of `max_num_batched_tokens` prompt tokens
over `max_num_seqs` requests (each sampled on rank 0), through the executor's own
`run_step` on a small throw-away cache, measures the activation peak; then

    budget = total * utilization - in use (weights, CUDA context, NCCL, other processes)
             - activation peak - CUDA-graph reserve
    slots  = max_num_seqs            (the scheduler's bound; one DeltaNet state each)
    blocks = (budget - slots * slot bytes) // block bytes      (all of it, as vLLM)

Every rank computes its own and they agree on the minimum (all_reduce MIN) before anything
is allocated, so every rank's `Ready` carries the same capacity. A budget that cannot hold
the slots plus one max_model_len request fails start-up, naming the numbers. The arithmetic
(`cache_sizes`, `blocks_for_budget`, `profile_lengths`) is pure and unit-tested; a fake
`probe` stands in for the CUDA memory statistics in the CPU tests.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.cache import StateCache, cache_shapes
from deltaserve.engine.rank.prompt_graphs import prefix_graph_keys, token_buckets
from deltaserve.engine.rank.verify_graphs import stash_bytes
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

if TYPE_CHECKING:
    from deltaserve.engine.rank.executor import Executor

log = logging.getLogger("deltaserve.rank")

GiB = 2**30
# CUDA graphs allocate from a private pool that eager steps cannot reuse: the decode
# activations of the largest batch bucket and static buffers, on top of the fp32 logits that
# every bucket keeps (counted separately). An estimate, to be checked on the GPU.
GRAPH_POOL_RESERVE_BYTES = 256 * 2**20
# After the profiling step, one short prompt of an odd length: Triton compiles a kernel again
# for integer arguments that are 1, or not a multiple of 16, which the profiling step's 8192
# tokens never show; else the first real prompt of such a length would pay those compiles.
WARM_PROMPT_TOKENS = 17
# The profiling step samples with penalties, top-p and 20 logprobs: the sampler's largest
# temporaries (a penalised copy, a temperature-scaled copy, a top-k of every row).
PROFILE_SAMPLING = SamplingSpec(
    seed=0, temperature=1.0, top_p=0.95, repetition_penalty=1.1, num_logprobs=20
)


@dataclass(frozen=True, slots=True)
class CacheSizes:
    """Bytes on one rank (its share of the heads) of one state slot and one KV block."""

    # every DeltaNet layer's conv window (model dtype) + recurrent state (+ the MTP head's row)
    slot_bytes: int
    block_bytes: int  # every full-attention layer's K and V for block_size positions


def cache_sizes(
    config: ModelConfig,
    tp_size: int,
    dtype: torch.dtype,
    block_size: int,
    state_dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,  # None: the model's
    mtp: bool = False,
) -> CacheSizes:
    """What StateCache allocates per slot and per block (`mtp`: the MTP head's KV layer in
    each block, in the KV dtype, and its hidden state row in each slot)."""
    kv, conv, recurrent = cache_shapes(config, 1, 1, block_size, tp_size, mtp)
    hidden = config.hidden_size * dtype.itemsize if mtp else 0
    return CacheSizes(
        slot_bytes=math.prod(conv) * dtype.itemsize
        + math.prod(recurrent) * state_dtype.itemsize
        + hidden,
        block_bytes=math.prod(kv) * (kv_dtype or dtype).itemsize,
    )


def blocks_for_budget(budget_bytes: int, num_slots: int, sizes: CacheSizes) -> int:
    """KV blocks that fit in `budget_bytes` once `num_slots` state slots are taken (>= 0)."""
    return max(0, (budget_bytes - num_slots * sizes.slot_bytes) // sizes.block_bytes)


def profile_lengths(num_tokens: int, num_seqs: int, max_len: int) -> list[int]:
    """Prompt lengths of the profiling step: `num_seqs` requests (so the sampler sees as many
    rows as a full decode batch), `num_tokens` in all (at most num_seqs * max_len), none
    longer than `max_len`; like a real step, long prefill chunks beside one-token items."""
    if min(num_tokens, num_seqs, max_len) < 1:
        raise ValueError(
            "profile needs tokens, sequences and length >= 1, "
            f"got {num_tokens}, {num_seqs}, {max_len}"
        )
    num_seqs = min(num_seqs, num_tokens)
    lengths = [1] * num_seqs
    rest = min(num_tokens, num_seqs * max_len) - num_seqs
    for i in range(num_seqs):
        add = min(rest, max_len - 1)
        lengths[i] += add
        rest -= add
    return lengths


class MemoryProbe(Protocol):
    def in_use_and_total(self) -> tuple[int, int]: ...
    def start_peak(self) -> None: ...
    def peak_since_start(self) -> int: ...


class CudaMemory:
    """The device's memory as `size_kv_cache` reads it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0

    def in_use_and_total(self) -> tuple[int, int]:
        """Bytes in use on the whole device (this process's tensors, CUDA context, NCCL
        buffers, other processes), after returning the allocator's cached blocks."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free, total

    def start_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def peak_since_start(self) -> int:
        """Most bytes allocated at once since `start_peak`, above what was allocated then."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self._base


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    total: int  # the device's memory
    utilization: float
    in_use: int  # on the device after loading and profiling, before the cache
    weights: int  # this rank's parameters (part of in_use)
    activations: int  # the profiling step's peak
    profile_tokens: int
    reserve: int  # CUDA graphs
    budget: int  # left for the request state: total * utilization - in_use - activations - reserve
    sizes: CacheSizes
    num_slots: int
    local_blocks: int  # what this rank's budget holds
    num_blocks: int  # the minimum over ranks: what every rank allocates
    block_size: int

    @property
    def cache_bytes(self) -> int:
        return self.num_slots * self.sizes.slot_bytes + self.num_blocks * self.sizes.block_bytes

    def _accounts(self) -> str:
        return (
            f"gpu_memory_utilization {self.utilization:g} of {self.total / GiB:.2f} GiB = "
            f"{self.total * self.utilization / GiB:.2f} GiB; in use {self.in_use / GiB:.2f} GiB "
            f"(weights {self.weights / GiB:.2f} GiB), activations {self.activations / GiB:.2f} GiB "
            f"({self.profile_tokens} batched tokens), CUDA-graph reserve {self.reserve / GiB:.2f} "
            "GiB"
        )

    def describe(self) -> str:
        return (
            f"memory budget: {self._accounts()} -> cache {self.cache_bytes / GiB:.2f} GiB: "
            f"{self.num_slots} state slots ({self.num_slots * self.sizes.slot_bytes / GiB:.2f} "
            f"GiB) + {self.num_blocks} KV blocks of {self.block_size} "
            f"({self.num_blocks * self.block_size} tokens of KV, "
            f"{self.num_blocks * self.sizes.block_bytes / GiB:.2f} GiB)"
        )

    def shortfall(self, rank: int, max_model_len: int, need_blocks: int) -> str:
        agreed = (
            ""
            if self.local_blocks == self.num_blocks
            else f" (this rank fits {self.local_blocks}; another fewer)"
        )
        return (
            f"not enough device memory for the request state on rank {rank}: {self._accounts()} "
            f"leave {self.budget / GiB:.2f} GiB; {self.num_slots} state slots (max_num_seqs and "
            f"prefix states) take {self.num_slots * self.sizes.slot_bytes / GiB:.2f} GiB and one "
            f"max_model_len {max_model_len} request needs {need_blocks} KV blocks of "
            f"{self.block_size} ({need_blocks * self.sizes.block_bytes / GiB:.2f} GiB), but "
            f"{self.num_blocks} fit{agreed}. Raise --gpu-memory-utilization, or lower "
            "--max-num-seqs, --max-model-len or --max-num-batched-tokens"
        )


def size_kv_cache(executor: Executor, probe: MemoryProbe | None = None) -> MemoryBudget:
    """Profile, budget, agree over ranks; the executor then allocates `num_blocks` blocks.
    Called from `Executor.__init__` after the weights are loaded, before its cache exists
    (an existing cache is put back afterwards: tests)."""
    config = executor.config
    if probe is None:
        if executor.device.type != "cuda":
            raise ValueError(
                "num_kv_blocks None sizes the KV cache from device memory: CUDA only; give "
                "num_kv_blocks"
            )
        probe = CudaMemory(executor.device)
    if config.max_model_len < 1:
        raise ValueError("num_kv_blocks None (size the KV cache from memory) needs max_model_len")
    sizes = cache_sizes(
        executor.model_config,
        config.tp_size,
        executor.dtype,
        config.block_size,
        executor.state_dtype,
        executor.kv_dtype,
        config.mtp,
    )
    lengths = profile_lengths(
        config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len
    )
    activations = _timed_profile(executor, lengths, probe)
    in_use, total = probe.in_use_and_total()
    reserve = 0
    # each captured bucket (1, 2, 4, ... max) keeps its
    # fp32 logits and its rows' final hidden states
    row_bytes = executor.model_config.vocab_size * 4
    hidden_bytes = executor.model_config.hidden_size * executor.dtype.itemsize
    if not config.enforce_eager:
        reserve = GRAPH_POOL_RESERVE_BYTES + 2 * config.max_num_seqs * (row_bytes + hidden_bytes)
        if config.mtp:  # a draft graph's fp32 logits over the draft vocabulary (draft_graphs.py)
            spec = config.speculative_config
            draft_vocab = spec.draft_vocab(executor.model_config.vocab_size)
            reserve += config.max_num_seqs * draft_vocab * 4 // config.tp_size
            # and the verify graphs' stash (verify_graphs.py)
            reserve += stash_bytes(
                executor.model_config,
                min(config.max_num_seqs, spec.off_at_batch),
                spec.num_speculative_tokens,
                config.tp_size,
                executor.dtype,
            )
        # the prompt graphs' pool holds the activations of their largest bucket, which scale
        # with its tokens like the profiling step's; each bucket keeps its sampled rows' logits
        if (size := executor.prompt_graph_size()) is not None:
            prompt_tokens, seqs = size
            reserve += activations * min(prompt_tokens, sum(lengths)) // sum(lengths)
            buckets = token_buckets(prompt_tokens)
            reserve += len(buckets) * seqs * row_bytes + sum(buckets) * hidden_bytes
            if executor.vision is not None:  # the tower's embeddings, a row each
                reserve += prompt_tokens * hidden_bytes
            # with prefix caching, one layer's keys and values gathered for attention
            keys = prefix_graph_keys(config.prefix_cache_states, config.max_model_len)
            if keys:
                rows = prompt_tokens + keys + seqs * config.block_size
                mc = executor.model_config
                reserve += (
                    2
                    * rows
                    * mc.num_key_value_heads
                    // config.tp_size
                    * mc.head_dim
                    * executor.dtype.itemsize
                )
    weights = sum(
        t.numel() * t.element_size()
        for t in (*executor.model.parameters(), *executor.model.buffers())
    )
    budget = int(total * config.gpu_memory_utilization) - in_use - activations - reserve
    state_slots = config.max_num_seqs + config.prefix_cache_states  # requests' and saved prefixes'
    local = blocks_for_budget(budget, state_slots, sizes)
    result = MemoryBudget(
        total=total,
        utilization=config.gpu_memory_utilization,
        in_use=in_use,
        weights=weights,
        activations=activations,
        profile_tokens=sum(lengths),
        reserve=reserve,
        budget=budget,
        sizes=sizes,
        num_slots=state_slots,
        local_blocks=local,
        num_blocks=_min_over_ranks(local, executor.device),
        block_size=config.block_size,
    )
    need = -(-config.max_model_len // config.block_size)
    if result.num_blocks < need:
        raise MemoryError(result.shortfall(config.rank, config.max_model_len, need))
    if config.rank == 0:
        log.info("%s", result.describe())
    return result


def warm_up(executor: Executor) -> None:
    """With the KV cache's size given there is no budget to profile for, but the profiling
    steps still run at start-up on CUDA: every Triton kernel a step uses compiles (or loads)
    there, not in a request's first step (fla's autotuning on a cold cache took longer than
    the step timeout)."""
    config = executor.config
    max_len = config.max_model_len or config.num_kv_blocks * config.block_size
    lengths = profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, max_len)
    _timed_profile(executor, lengths, CudaMemory(executor.device))


def _timed_profile(executor: Executor, lengths: list[int], probe: MemoryProbe) -> int:
    config = executor.config
    started = time.monotonic()
    peak = _profile(executor, lengths, probe)
    if config.rank == 0:  # the first step also compiles (or loads) every Triton kernel
        log.info("profiling step of %d tokens in %.1f s", sum(lengths), time.monotonic() - started)
    return peak


def _profile(executor: Executor, lengths: list[int], probe: MemoryProbe) -> int:
    """The activation peak of one step of `lengths` new prompts, each sampled, run by the
    executor itself on a cache just large enough; then the short warm-up prompt."""
    config = executor.config
    saved = getattr(executor, "cache", None)
    block_size = config.block_size
    warm_len = min(WARM_PROMPT_TOKENS, config.max_model_len or max(lengths))
    executor.cache = StateCache(
        executor.model_config,
        len(lengths),
        max(sum(-(-n // block_size) for n in lengths), -(-warm_len // block_size)),
        block_size,
        config.tp_size,
        executor.dtype,
        executor.device,
        state_dtype=executor.state_dtype,
        kv_dtype=executor.kv_dtype,
        mtp=config.mtp,
    )
    base = 1 << 62  # request ids no real request has (the executor is fresh anyway)
    items = [
        StepItem(base + i, 0, [0] * n, True, NewRequest(n, PROFILE_SAMPLING))
        for i, n in enumerate(lengths)
    ]
    # it asks for prompt logprobs too: their kernels, compiled here, not for a request
    warm = [
        StepItem(
            base + len(items),
            0,
            [0] * warm_len,
            True,
            NewRequest(warm_len, PROFILE_SAMPLING),
            prompt_logprobs=2,
        )
    ]
    try:
        probe.start_peak()
        executor.run_step(items)
        peak = probe.peak_since_start()
        executor.drop([item.request_id for item in items])  # the warm-up prompt needs a slot
        executor.run_step(warm)
    except torch.OutOfMemoryError as exc:
        raise MemoryError(
            f"the profiling step ({sum(lengths)} tokens, {len(lengths)} sequences) ran out of "
            f"device memory: lower --max-num-batched-tokens or --max-num-seqs ({exc})"
        ) from None
    finally:
        # those still held; the rest are no-ops
        executor.drop([item.request_id for item in items + warm])
        executor.cache = saved
        if saved is None:
            del executor.cache
    return peak


def _min_over_ranks(value: int, device: torch.device) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
