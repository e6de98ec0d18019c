"""The async engine's public API, imported lazily so that rank processes, which import
`deltaserve.engine.rank`, do not load the scheduler, ZeroMQ or the tokenizer."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncEngine": "deltaserve.engine.async_engine",
    "DataParallelEngine": "deltaserve.engine.data_parallel",
    "EngineConfig": "deltaserve.engine.config",
    "SamplingParams": "deltaserve.engine.sampling_params",
    "EngineDeadError": "deltaserve.engine.events",
    "QueueFullError": "deltaserve.engine.events",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deltaserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
