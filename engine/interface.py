"""The engine as its users see it: `Engine`, what AsyncEngine (one replica) and
DataParallelEngine (several, engine/data_parallel.py) both are, the type the HTTP layer and
asyncio clients hold; `start_engine` starts the one a configuration asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.events import LoadSnapshot
    from deltaserve.engine.maintenance import PauseMode
    from deltaserve.engine.media import MediaSource
    from deltaserve.engine.media_prompt import MultimodalPrompt
    from deltaserve.engine.metrics import EngineMetrics
    from deltaserve.engine.model_config import ModelConfig
    from deltaserve.engine.sampling_params import SamplingParams
    from deltaserve.engine.stream import RequestStream
    from deltaserve.ipc.messages import SnapshotReply

T = TypeVar("T")


@runtime_checkable
class Engine(Protocol):
    """What AsyncEngine documents, method by method; a data-parallel engine keeps each
    method's meaning over its replicas (engine/data_parallel.py says how)."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any
    max_model_len: int  # a request's prompt + max_tokens at most
    max_logprobs: int  # a request's logprobs and prompt_logprobs at most
    eos_token_ids: frozenset[int]

    # ---- state ----
    @property
    def is_dead(self) -> bool: ...
    @property
    def dead_reason(self) -> str | None: ...
    @property
    def metrics(self) -> EngineMetrics: ...
    @property
    def longest_sequence(self) -> int: ...
    @property
    def max_queued_requests(self) -> int: ...
    @property
    def monitor_endpoint(self) -> str | None: ...
    @property
    def rank_pids(self) -> list[int]: ...
    @property
    def weights_dir(self) -> str: ...
    @property
    def is_paused(self) -> bool: ...
    @property
    def is_sleeping(self) -> bool: ...
    @property
    def weights_dropped(self) -> bool: ...
    def load(self) -> LoadSnapshot: ...
    def replica_loads(self) -> list[LoadSnapshot]: ...
    async def rank_snapshots(self) -> list[SnapshotReply]: ...
    async def wait_closed(self) -> None: ...

    # ---- tokenization ----
    async def run_tokenizer(self, fn: Callable[[Any], T], size: int) -> T: ...
    async def encode(self, text: str) -> list[int]: ...
    async def media_prompt(self, text: str, sources: list[MediaSource]) -> MultimodalPrompt: ...

    # ---- requests ----
    async def prepare(self, params: SamplingParams) -> SamplingParams: ...
    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream: ...
    def check(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        request_id: str | None = None,
    ) -> None: ...
    def request_ids(self) -> list[str]: ...
    async def abort(self, request_id: str) -> None: ...

    # ---- between requests ----
    async def update_weights(self, model_dir: str, abort_running: bool = False) -> None: ...
    async def flush_cache(self) -> None: ...
    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None: ...
    def resume(self) -> None: ...
    async def sleep(self, level: int = 1) -> None: ...
    async def wake_up(self, tags: list[str] | None = None) -> None: ...
    async def shutdown(self, drain_timeout_s: float = 0.0) -> None: ...


async def start_engine(config: EngineConfig) -> Engine:
    """An AsyncEngine, or a DataParallelEngine when config.data_parallel_size > 1, started."""
    if config.data_parallel_size > 1:
        from deltaserve.engine.data_parallel import DataParallelEngine

        return await DataParallelEngine.start(config)
    from deltaserve.engine.async_engine import AsyncEngine

    return await AsyncEngine.start(config)
