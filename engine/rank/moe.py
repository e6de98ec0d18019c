"""The mixture-of-experts MLP of the Qwen3.5 MoE models (Qwen3.5-35B-A3B and its larger kin).

Each token goes to the num_experts_per_tok experts its router ranks highest (their weights
renormalised) and to a shared expert, gated per token by sigmoid(shared_expert_gate x); the
output is the weighted sum (HF's `Qwen3_5MoeSparseMoeBlock`). Tensor parallelism splits every
expert's intermediate rows, as the dense MLP's: each rank adds its routed and shared partial
sums, then one all-reduce. Router and shared gate are whole on every rank.

Released checkpoints store each expert's projections apart (`mlp.experts.E.gate_proj.weight`,
`up_proj`, `down_proj`); transformers' own saves store them stacked (`mlp.experts.gate_up_proj`
[E, 2 I, H], `mlp.experts.down_proj` [E, H, I]). Both load into the stacked parameters
(`expert_loader`, named by the loader's `EXPERT_TENSOR`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.linear import WeightLoader, new_param, replicated_param, sharded_loader
from deltaserve.engine.rank.mlp import MLP
from deltaserve.engine.rank.parallel import all_reduce, tp_size
from deltaserve.kernels.moe import experts, experts_and_shared, gemv_path, route


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every rank (the router, the shared expert's gate)."""

    def __init__(
        self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = replicated_param((out_features, in_features), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def expert_loader(stacked: tuple[int, ...], sections: tuple[int, ...], dim: int) -> WeightLoader:
    """The loader of a stacked expert parameter whose full checkpoint shape is `stacked`
    ([E, ...]): this rank's shard of `sections` along `dim` of it. Called with the stacked
    tensor, or with one expert's tensor of one part (`expert`, `part`: gate 0, up 1)."""
    whole = sharded_loader(sections, dim, stacked)
    parts = [
        sharded_loader(None, dim - 1, (*stacked[1:dim], size, *stacked[dim + 1 :]))
        for size in sections
    ]

    def load(
        param: nn.Parameter, loaded: torch.Tensor, expert: int | None = None, part: int = 0
    ) -> None:
        if expert is None:
            whole(param, loaded)
            return
        local = sections[part] // tp_size()
        parts[part](param.data[expert].narrow(dim - 1, part * local, local), loaded)

    return load


class Experts(nn.Module):
    """The routed experts, stacked: gate_up_proj [E, 2 I/tp, H] (each rank's gate rows, then
    its up rows), down_proj [E, H, I/tp]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        num, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        local = inter // tp_size()
        gate_up = expert_loader((num, 2 * inter, hidden), (inter, inter), 1)
        down = expert_loader((num, hidden, inter), (inter,), 2)
        self.gate_up_proj = new_param((num, 2 * local, hidden), gate_up, dtype, device)
        self.down_proj = new_param((num, hidden, local), down, dtype, device)
        self.gate_up_proj.num_experts = self.down_proj.num_experts = num

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts(x, self.gate_up_proj, self.down_proj, weights, ids)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.gate = ReplicatedLinear(hidden, config.num_experts, dtype, device)
        self.experts = Experts(config, dtype, device)
        self.shared_expert = MLP(hidden, config.shared_expert_intermediate_size, dtype, device)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A few tokens on the GPU: the experts' and the shared expert's down products summed
        in one kernel (`experts_and_shared`); else each apart, then added."""
        weights, ids = route(self.gate(x), self.top_k, x.dtype)
        shared_h = self.shared_expert.gate_up_proj(x, silu_mul=True)
        shared_down = self.shared_expert.down_proj
        if (
            gemv_path(x, ids) and shared_down.weight.dtype == x.dtype
        ):  # (not an FP8 weight kept as it is)
            out = experts_and_shared(
                x,
                self.experts.gate_up_proj,
                self.experts.down_proj,
                weights,
                ids,
                x.dtype,
                shared_h,
                shared_down.weight,
                self.shared_expert_gate(x),
            )
            return all_reduce(out)
        out = self.experts(x, weights, ids)
        out += torch.sigmoid(self.shared_expert_gate(x)) * shared_down.product(shared_h)
        return all_reduce(out.to(x.dtype))
