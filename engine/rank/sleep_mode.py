"""Sleep mode (vLLM's sleep and wake_up; SGLang's release and resume of memory occupation):
between requests a rank gives the device memory of its weights and of its cache back, so that
an RL trainer sharing the GPU can use it, and takes it again before serving.

Level 1 keeps the weights in host memory (pinned on CUDA) and copies them back on wake-up;
level 2 drops them: they are garbage after wake-up until new ones are loaded (LoadWeights),
as an RL loop does next. The cache (KV blocks, DeltaNet states, last samples) is dropped
either way and comes back zeroed; nothing is held in it while asleep (the engine sleeps only
with no request on the ranks and its saved prefixes evicted). The CUDA graphs, whose pool and
captured pointers are the cache's and the weights', are captured again once both are back.

Every parameter and buffer of the model has its storage swapped (`tensor.data`): the modules
keep their tensors, so nothing else needs to know.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.engine.rank.cache import StateCache
from deltaserve.ipc.messages import SLEEP_TAGS

CACHE_TENSORS = ("kv", "conv", "recurrent", "last_tokens", "hidden")


@dataclass
class Asleep:
    """What a sleeping rank gave back, and how to take it again."""

    # each weight tensor, its shape and its host copy (None at level 2, or once back)
    weights: list[tuple[torch.Tensor, torch.Size, torch.Tensor | None]] | None
    cache: dict[str, tuple[torch.Size, torch.dtype]] | None


def release_memory(model: nn.Module, cache: StateCache, level: int) -> Asleep:
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    pinned = cache.kv.device.type == "cuda"
    weights = []
    for tensor in (*model.parameters(), *model.buffers()):
        host = None
        if level == 1:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            host.copy_(tensor)
        weights.append((tensor, tensor.shape, host))
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    shapes = {}
    for name in CACHE_TENSORS:
        tensor = getattr(cache, name)
        if tensor is None:  # `hidden` without an MTP head
            continue
        shapes[name] = (tensor.shape, tensor.dtype)
        setattr(cache, name, torch.empty(0, dtype=tensor.dtype, device=tensor.device))
    if pinned:
        torch.cuda.empty_cache()
    return Asleep(weights, shapes)


def restore_memory(model: nn.Module, cache: StateCache, asleep: Asleep, tags: list[str]) -> bool:
    """Take back the parts `tags` name (those already back are skipped); True once all are."""
    if unknown := set(tags) - set(SLEEP_TAGS):
        raise ValueError(
            f"wake_up tags must be among {', '.join(SLEEP_TAGS)}, got {sorted(unknown)}"
        )
    device = cache.kv.device
    if "weights" in tags and asleep.weights is not None:
        for tensor, shape, host in asleep.weights:
            tensor.data = (
                torch.empty(shape, dtype=tensor.dtype, device=device)
                if host is None
                else host.to(device)
            )
        asleep.weights = None
    if "kv_cache" in tags and asleep.cache is not None:
        for name, (shape, dtype) in asleep.cache.items():
            setattr(cache, name, torch.zeros(shape, dtype=dtype, device=device))
        asleep.cache = None
    return asleep.weights is None and asleep.cache is None


__all__ = ["Asleep", "release_memory", "restore_memory"]
