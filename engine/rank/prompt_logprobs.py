"""Prompt logprobs (vLLM's `prompt_logprobs`): how likely the model found each prompt token.

A prompt chunk's items ask for them (`StepItem.prompt_logprobs`); the logits of a position
give the logprob of the token after it, so a chunk's rows cover its tokens after the first
and then the next chunk's first (`next_token`), or stop one short on the chunk that samples
(its last position's logits are the first output token's). The lm_head runs over those
rows a slice at a time: a whole 8k-token chunk's fp32 logits would be 8 GB at a 248k
vocabulary. Every rank runs it (its vocabulary shard, gathered on rank 0); rank 0 keeps the
results. Logprobs are of the raw distribution, ranks as vLLM's: 1 + the tokens whose logit
is larger.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.engine.rank.embedding import VocabParallelEmbedding
from deltaserve.engine.rank.parallel import tp_rank
from deltaserve.engine.rank.transfer import to_device
from deltaserve.ipc.messages import PromptLogprobs, StepItem
from deltaserve.kernels.logit_stats import target_stats

ROWS_PER_PASS = 256  # 256 x 248k fp32 logits: 254 MB at a time


@dataclass(frozen=True, slots=True)
class PromptRows:
    """One chunk's rows of the step (flat token indices) and the prompt token after each."""

    request_id: int
    rows: list[int]
    targets: list[int]
    num_alternatives: int


def prompt_rows(items: list[StepItem], offsets: list[int]) -> list[PromptRows]:
    """The rows of the items that ask for prompt logprobs; `offsets[i]`: item i's first row."""
    wanted = []
    for item, offset in zip(items, offsets, strict=True):
        if item.prompt_logprobs < 0:
            continue
        count = item.num_prompt_logprobs
        targets = [*item.token_ids[1:], item.next_token][:count]
        wanted.append(
            PromptRows(
                item.request_id, list(range(offset, offset + count)), targets, item.prompt_logprobs
            )
        )
    return wanted


@torch.inference_mode()
def prompt_logprobs(
    hidden: torch.Tensor, wanted: list[PromptRows], head: VocabParallelEmbedding
) -> dict[int, PromptLogprobs]:
    """Each chunk's PromptLogprobs on rank 0 ({} elsewhere) from the step's final hidden
    states [T, hidden] (after the last norm)."""
    rows = [r for w in wanted for r in w.rows]
    targets = [t for w in wanted for t in w.targets]
    k = max((w.num_alternatives for w in wanted), default=0)
    # per slice [rows, 2 + 2k] float64: logprob, rank, alternatives' ids, their logprobs
    packed = []
    for first in range(0, len(rows), ROWS_PER_PASS):
        index = to_device(rows[first : first + ROWS_PER_PASS], torch.int64, hidden.device)
        logits = head.logits(hidden[index])
        if logits is None:  # not rank 0
            continue
        target_ids = to_device(targets[first : first + ROWS_PER_PASS], torch.int64, hidden.device)
        # one read
        normaliser, best, target, rank = (t[:, None] for t in target_stats(logits, target_ids))
        if k == 1:  # lm-evaluation-harness's question: the argmax is the best alternative
            ids = best
            values = logits.gather(1, ids)
        else:
            values, ids = logits.topk(k, dim=-1)  # best first
        parts = (target - normaliser, rank, ids, values - normaliser)
        packed.append(torch.cat([p.double() for p in parts], dim=1))
    if tp_rank() != 0:
        return {}
    # one wait for the host, not one a slice
    table = torch.cat(packed).cpu().tolist() if packed else []
    out, at = {}, 0
    for w in wanted:
        mine, at = table[at : at + len(w.rows)], at + len(w.rows)
        n = w.num_alternatives
        out[w.request_id] = PromptLogprobs(
            [row[0] for row in mine],
            [int(row[1]) for row in mine],
            [
                [(int(t), v) for t, v in zip(row[2 : 2 + n], row[2 + k : 2 + k + n], strict=True)]
                for row in mine
            ],
        )
    return out
