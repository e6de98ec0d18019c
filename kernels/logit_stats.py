"""A step's logits in one read: each row's log-normaliser (logsumexp) and its argmax.

The sampler needs both for every row (the raw logprobs, the greedy tokens). In torch they are
several passes over [rows, vocab] fp32 (logsumexp alone is a max, a subtract-exp, a sum and
a log); at 64 rows of a 248k vocabulary that is 64 MB per pass between two decode steps. The
kernel splits each row into parts, one program each (so a single row still fills the GPU),
keeps an online max, rescaled sum of exponentials and first argmax per part (the running
softmax normaliser of Milakov & Gimelshein, "Online normalizer calculation for softmax"),
and a second small kernel combines the parts. That one also writes what a greedy row's sample
is, packed as the sampler sends samples to the host ([token, logprob] in float64), and puts
the token in its slot's `last_tokens` (the next step's input): for a greedy step nothing else
runs between the logits and the copy to the host.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.triton_compat import (
    HAS_TRITON,
    INTERPRET,
    check_index,
    check_launchable,
    check_vector,
    gpu_path,
    tl,
    triton,
)

# Columns per load. Triton's interpreter (CPU tests) spends its time per op, not per byte: 16
# times wider loads take a sampled step of the 248k vocabulary from ~6 to ~0.5 s there (the
# kernel's own test passes 1024, so that a part of several blocks is covered too).
BLOCK = 16384 if INTERPRET else 1024
TARGET_PROGRAMS = 1024  # parts over all rows: several waves on 132 SMs


Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logsumexp, argmax, greedy samples


def logsumexp_argmax_reference(
    logits: torch.Tensor, slots: torch.Tensor | None = None, last_tokens: torch.Tensor | None = None
) -> Stats:
    lse, arg = torch.logsumexp(logits, dim=-1), logits.argmax(dim=-1)
    greedy = torch.stack(
        (arg.double(), (logits.gather(1, arg[:, None])[:, 0] - lse).double()), dim=1
    )
    if slots is not None:
        last_tokens[slots] = arg
    return lse, arg, greedy


def logsumexp_argmax(
    logits: torch.Tensor, slots: torch.Tensor | None = None, last_tokens: torch.Tensor | None = None
) -> Stats:
    """[rows, vocab] fp32 -> (logsumexp [rows] fp32, argmax [rows] int64, the first of equal
    maxima as torch.argmax; greedy [rows, 2] float64: the argmax and its logprob). With
    `slots`, also last_tokens[slots[i]] = argmax[i]."""
    if gpu_path(logits) and HAS_TRITON:
        return logsumexp_argmax_triton(logits, slots=slots, last_tokens=last_tokens)
    return logsumexp_argmax_reference(logits, slots, last_tokens)


@triton.jit
def _parts_kernel(
    x_ptr,
    stride_row,
    vocab,
    part_len,
    max_ptr,
    sum_ptr,
    arg_ptr,
    above_ptr,
    count_ptr,
    BLOCK: tl.constexpr,
    COUNT: tl.constexpr = False,
):
    # program: columns [part * part_len, (part + 1) * part_len) of one row; with COUNT, also
    # how many of them are larger than the row's `above`
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    start = part * part_len
    end = tl.minimum(start + part_len, vocab)
    best = -float("inf")
    total = 0.0
    arg = start
    larger = 0
    if COUNT:
        threshold = tl.load(above_ptr + row)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_row + cols, mask=cols < end, other=-float("inf"))
        if COUNT:
            larger += tl.sum((x > threshold).to(tl.int32), axis=0)
        block_max = tl.max(x, axis=0)
        block_arg = off + tl.argmax(x, axis=0, tie_break_left=True)
        new_best = tl.maximum(best, block_max)
        # all -inf so far, or a +inf: exp(inf - inf) is NaN; torch's logsumexp gives -inf, +inf
        shift = tl.where((new_best == -float("inf")) | (new_best == float("inf")), 0.0, new_best)
        total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
        # strictly greater: the first maximum stays
        arg = tl.where(block_max > best, block_arg, arg)
        best = new_best
    tl.store(max_ptr + row * parts + part, best)
    tl.store(sum_ptr + row * parts + part, total)
    tl.store(arg_ptr + row * parts + part, arg.to(tl.int64))
    if COUNT:
        tl.store(count_ptr + row * parts + part, larger)


@triton.jit(do_not_specialize=["parts"])  # one compiled kernel for every row count
def _combine_kernel(
    max_ptr,
    sum_ptr,
    arg_ptr,
    lse_ptr,
    out_arg_ptr,
    greedy_ptr,
    slots_ptr,
    last_ptr,
    count_ptr,
    out_count_ptr,
    parts,
    PARTS: tl.constexpr,
    TO_SLOTS: tl.constexpr,
    COUNT: tl.constexpr = False,
):
    # program: one row's parts, in column order
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, PARTS)
    m = offs < parts
    part_max = tl.load(max_ptr + row * parts + offs, mask=m, other=-float("inf"))
    part_sum = tl.load(sum_ptr + row * parts + offs, mask=m, other=0.0)
    part_arg = tl.load(arg_ptr + row * parts + offs, mask=m, other=0)
    best = tl.max(part_max, axis=0)
    shift = tl.where((best == -float("inf")) | (best == float("inf")), 0.0, best)
    total = tl.sum(part_sum * tl.exp(part_max - shift), axis=0)
    # the earliest part holding the maximum
    first = tl.argmax(part_max, axis=0, tie_break_left=True)
    arg = tl.sum(tl.where(offs == first, part_arg, 0), axis=0)
    lse = best + tl.log(total)
    tl.store(lse_ptr + row, lse)
    tl.store(out_arg_ptr + row, arg)
    tl.store(greedy_ptr + 2 * row, arg.to(tl.float64))
    tl.store(greedy_ptr + 2 * row + 1, (best - lse).to(tl.float64))  # best: the argmax's logit
    if TO_SLOTS:
        tl.store(last_ptr + tl.load(slots_ptr + row), arg)
    if COUNT:
        tl.store(
            out_count_ptr + row,
            tl.sum(tl.load(count_ptr + row * parts + offs, mask=m, other=0), axis=0).to(tl.int64),
        )


def logsumexp_argmax_triton(
    logits: torch.Tensor,
    target_programs: int = TARGET_PROGRAMS,
    slots: torch.Tensor | None = None,
    last_tokens: torch.Tensor | None = None,
    block: int = BLOCK,
) -> Stats:
    lse, arg, greedy, _ = _launch(logits, target_programs, slots, last_tokens, block)
    return lse, arg, greedy


def target_stats(
    logits: torch.Tensor, targets: torch.Tensor, block: int = BLOCK
) -> tuple[torch.Tensor, ...]:
    """Prompt logprobs' read of [rows, vocab] fp32 logits, each row with its target token
    [rows] int64: (logsumexp [rows], argmax [rows], the target's logit [rows], its rank [rows]
    int64: 1 + the logits larger than it, as vLLM ranks). On the GPU one read of the logits
    gives all four: torch's compare and sum for the rank alone took as long as the lm_head's
    GEMM of a 256-row slice (0.57 against 0.61 ms on an H100)."""
    target = logits.gather(1, targets[:, None])[:, 0]
    if gpu_path(logits) and HAS_TRITON:
        lse, arg, _, larger = _launch(logits, TARGET_PROGRAMS, None, None, block, above=target)
    else:
        lse, arg, _ = logsumexp_argmax_reference(logits)
        larger = (logits > target[:, None]).sum(dim=-1)
    return lse, arg, target, larger + 1


def _launch(
    logits: torch.Tensor,
    target_programs: int,
    slots: torch.Tensor | None,
    last_tokens: torch.Tensor | None,
    block: int,
    above: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The two kernels; with `above` (fp32 [rows]), also each row's count of larger logits."""
    check_launchable(logits)
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"logits: expected [rows, vocab] fp32 with a contiguous last dim, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    rows, vocab = logits.shape
    if slots is not None:
        check_index("slots", slots, rows)
        if last_tokens is None:
            raise ValueError("slots need the slots' last_tokens")
        check_vector("last_tokens", last_tokens, None, (torch.int64,))
    count = above is not None
    if count:
        check_vector("above", above, rows, (torch.float32,))
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    arg = torch.empty(rows, dtype=torch.int64, device=logits.device)
    greedy = torch.empty((rows, 2), dtype=torch.float64, device=logits.device)
    larger = torch.empty(rows, dtype=torch.int64, device=logits.device) if count else None
    if rows == 0:
        return lse, arg, greedy, larger
    # any row count's
    most_parts = triton.next_power_of_2(min(target_programs, triton.cdiv(vocab, block)))
    parts = max(1, min(triton.cdiv(target_programs, rows), triton.cdiv(vocab, block)))
    part_len = triton.cdiv(triton.cdiv(vocab, parts), block) * block
    parts = triton.cdiv(vocab, part_len)
    part_max = torch.empty((rows, parts), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_arg = torch.empty((rows, parts), dtype=torch.int64, device=logits.device)
    part_count = (
        torch.empty((rows, parts), dtype=torch.int32, device=logits.device) if count else part_arg
    )
    _parts_kernel[(rows, parts)](
        logits,
        logits.stride(0),
        vocab,
        part_len,
        part_max,
        part_sum,
        part_arg,
        above if count else lse,
        part_count,
        BLOCK=block,
        COUNT=count,
    )
    to_slots = slots is not None
    _combine_kernel[(rows,)](
        part_max,
        part_sum,
        part_arg,
        lse,
        arg,
        greedy,
        slots if to_slots else arg,
        last_tokens if to_slots else arg,
        part_count,
        larger if count else arg,
        parts,
        PARTS=most_parts,
        TO_SLOTS=to_slots,
        COUNT=count,
    )
    return lse, arg, greedy, larger
