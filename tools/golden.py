"""Golden comparison of our logprobs against a reference's (HF transformers).

Per position: the engine's argmax must be (near) the reference's best, and the logprobs of
the engine's top-8 tokens must match. Reported as in the seed project: max, mean and p99 of
|logprob difference| over the engine's top-8, and the regret of the engine's argmax under the
reference's scores (reference best logprob minus the reference logprob of our argmax).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

TOP = 8


@dataclass(frozen=True, slots=True)
class GoldenReport:
    positions: int
    max_abs_diff: float
    mean_abs_diff: float
    p99_abs_diff: float
    max_regret: float
    argmax_mismatches: int

    def as_dict(self) -> dict:
        return asdict(self)


def compare_logprobs(ours: torch.Tensor, reference: torch.Tensor) -> GoldenReport:
    """ours, reference: [positions, vocab] logits or logprobs (normalised here)."""
    if ours.shape != reference.shape:
        raise ValueError(
            f"shapes differ: ours {tuple(ours.shape)}, reference {tuple(reference.shape)}"
        )
    ours = ours.float().log_softmax(-1)
    reference = reference.float().log_softmax(-1)
    top = ours.topk(TOP, dim=-1).indices
    diff = (ours.gather(-1, top) - reference.gather(-1, top)).abs().flatten()
    our_best = top[:, 0]
    regret = reference.max(-1).values - reference.gather(-1, our_best[:, None])[:, 0]
    return GoldenReport(
        positions=int(ours.shape[0]),
        max_abs_diff=float(diff.max()),
        mean_abs_diff=float(diff.mean()),
        p99_abs_diff=float(diff.quantile(0.99)) if diff.numel() > 1 else float(diff.max()),
        max_regret=float(regret.max()),
        argmax_mismatches=int((our_best != reference.argmax(-1)).sum()),
    )
