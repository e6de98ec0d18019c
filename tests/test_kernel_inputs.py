"""The kernels' wrappers refuse inputs their kernels would misread. A kernel reads element i
of a vector at ptr + i, so a strided view (every other element, a column of a matrix) must be
refused by name, not read as if its elements were adjacent: the slots' case wrote past the end
of `last_tokens`."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import CUDA

DEVICE = "cuda" if CUDA else "cpu"


def test_strided_vectors_are_refused_by_name():
    from deltaserve.kernels import embedding, gated_delta, logit_stats

    weight = torch.randn(16, 8, device=DEVICE)
    ids = torch.arange(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"ids: expected \[4\] int32/int64 with adjacent elements"):
        embedding.embedding_triton(ids[::2], weight, 0)
    assert torch.equal(
        embedding.embedding_triton(ids[::2].contiguous(), weight, 0), weight[ids[::2]]
    )
    # one element: any stride
    assert torch.equal(embedding.embedding_triton(ids[2:3], weight, 0), weight[2:3])

    logits = torch.randn(3, 64, device=DEVICE)
    slots = torch.tensor([5, 9, 0, 9, 2], device=DEVICE)[::2]  # 5, 0, 2
    last = torch.zeros(6, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="slots: .*adjacent"):
        logit_stats.logsumexp_argmax_triton(logits, 3, slots, last)
    with pytest.raises(ValueError, match="last_tokens: .*adjacent"):
        logit_stats.logsumexp_argmax_triton(
            logits, 3, slots.contiguous(), torch.zeros(12, dtype=torch.int64)[::2]
        )
    logit_stats.logsumexp_argmax_triton(logits, 3, slots.contiguous(), last)
    assert torch.equal(last[[5, 0, 2]], logits.argmax(dim=1)) and last[[1, 3, 4]].eq(0).all()

    nk, nv, d = 1, 2, 16
    mixed = torch.randn(1, 2 * nk * d + nv * d, device=DEVICE)
    a, b = torch.randn(1, nv, device=DEVICE), torch.randn(1, nv, device=DEVICE)
    params = torch.randn(nv, 2, device=DEVICE)  # A_log a column of it: strided
    state = torch.zeros(1, nv, d, d, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = torch.empty(1, nv, d, device=DEVICE)
    with pytest.raises(ValueError, match="A_log: .*adjacent"):
        gated_delta.gated_delta_decode(
            mixed, a, b, params[:, 0], params[:, 1].contiguous(), state, one, one, out, nk
        )
