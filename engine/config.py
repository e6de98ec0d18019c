"""The engine's one configuration (`EngineConfig`, checked at construction) and the views of
it that a replica and its ranks start with, each computed by one function here.

A setting keeps one name from the command line to the rank, vLLM's where vLLM has the flag:
`--enforce-eager` is `EngineConfig.enforce_eager` is `ExecutorConfig.enforce_eager`
(ipc/messages.py), which the rank reads. Values that depend on the model are resolved once at
start by `resolve_limits` and live on the engine, never written back into the config: the
default max_model_len, max_logprobs -1 (the vocabulary), the KV block count on the cpu. On
CUDA with no `num_kv_blocks`, the ranks size the KV cache themselves from
`gpu_memory_utilization` (engine/rank/memory_budget.py) and the engine learns the count from
their `Ready`.

To add a setting that the ranks read:
1. a field on EngineConfig (its default, its check in `__post_init__`);
2. its flag in engine/config_flags.py, `dest` the field's name, with help text;
3. the field of the same name on ExecutorConfig (ipc/messages.py), with the default that
   EngineConfig then takes from there; `executor_config` passes it on by that name;
4. read it on the rank (`Executor.config`).
A setting that only the engine reads needs 1 and 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from deltaserve.engine.kv_events import KVEventsConfig
from deltaserve.engine.media import DEFAULT_LIMITS, MediaConfig
from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.engine.structured_config import StructuredOutputsConfig
from deltaserve.ipc.messages import ExecutorConfig
from deltaserve.ipc.replica_config import (
    STARTUP_TIMEOUT_S,
    STEP_TIMEOUT_S,
    ReplicaConfig,
    cuda_device_count,
)
from deltaserve.ipc.validate import MAX_LOGPROBS

if TYPE_CHECKING:
    from deltaserve.ipc.faults import FaultPlan

DEVICES = ("cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_MAX_MODEL_LEN = 8192  # the default: min(the model's max_position_embeddings, this)
RANK = ExecutorConfig(model="")  # what the ranks run by default: the engine's defaults too
# tokens per step by default: on cuda vLLM's and SGLang's chunk for large GPUs (a smaller prompt
# chunk leaves the matmuls and the launch overhead per token poor)
DEFAULT_BATCHED_TOKENS = {"cpu": RANK.max_num_batched_tokens, "cuda": 8192}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every setting of an engine, named as its flag (engine/config_flags.py has the flags and
    their help); `fault` and `force_mixed_steps` are for tests and have none."""

    model: str
    tp_size: int = RANK.tp_size
    # replicas, each on its own tp_size devices with its own ranks (engine/data_parallel.py)
    data_parallel_size: int = 1
    device: str = RANK.device
    # cuda ordinals, tp_size x data_parallel_size of them (replica i: the i-th tp_size);
    # None: 0, 1, ...
    device_ids: tuple[int, ...] | None = None
    dtype: str = RANK.dtype
    max_model_len: int | None = None  # None: min(max_position_embeddings, 8192)
    max_num_seqs: int = RANK.max_num_seqs
    max_num_batched_tokens: int | None = None  # None: DEFAULT_BATCHED_TOKENS of the device
    max_queued_requests: int = 256  # each replica's
    # prompt tokens of the waiting choices (each held in memory until admitted); one call is
    # taken past it while nothing else waits
    max_queued_tokens: int = 4 * 1024 * 1024
    # vLLM's: "fcfs" admits in arrival order; "priority" by each request's priority (lower
    # first), then arrival. When KV blocks run out, the running request preempted is the one
    # with the highest priority value (fcfs: the latest arrival)
    scheduling_policy: str = "fcfs"
    # a request is admitted with the KV blocks of its prompt and grows them as it decodes;
    # when the running ones run out, the youngest are preempted and recomputed (vLLM's policy;
    # engine/scheduler.py). While others run, admission leaves this share of the blocks free
    # for their growth (vLLM's block manager watermark, 0.01)
    kv_watermark: float = 0.01
    # admit each request with its whole lifetime's blocks (prompt + max_tokens) instead: none
    # is ever preempted, fewer run at once (what deltaserve did before preemption)
    reserve_lifetime: bool = False
    block_size: int = RANK.block_size
    # None: on cuda what gpu_memory_utilization leaves, on cpu max_num_seqs * max_model_len
    # / block_size
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = RANK.gpu_memory_utilization
    enforce_eager: bool = RANK.enforce_eager
    prompt_graph_tokens: int = RANK.prompt_graph_tokens
    max_logprobs: int = MAX_LOGPROBS  # -1: the vocabulary
    fp8_weights: str = RANK.fp8_weights
    mamba_ssm_cache_dtype: str = RANK.mamba_ssm_cache_dtype
    kv_cache_dtype: str = RANK.kv_cache_dtype
    calculate_kv_scales: bool = RANK.calculate_kv_scales
    enable_prefix_caching: bool = False
    prefix_cache_states: int | None = None  # None: max_num_seqs
    async_scheduling: bool = True
    overlap_steps: bool | None = None  # None: on cuda
    step_timeout_s: float = STEP_TIMEOUT_S
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    monitor_endpoint: str | None = None  # None: no monitor; "auto", ipc://PATH, tcp://HOST:PORT
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    # speculative decoding with the checkpoint's MTP head (engine/speculative_config.py); None: off
    speculative_config: SpeculativeConfig | None = None
    # images and video (engine/media.py, whose view is `media`): images and videos a prompt
    # may hold (the kinds not named: DEFAULT_LIMITS'), the processors' settings, the folder
    # file:// urls may name ("": none)
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, object] = field(default_factory=dict)
    allowed_local_media_path: str = ""
    # the prefix cache's blocks published for routers (engine/kv_events.py); needs
    # enable_prefix_caching; replica i publishes on the endpoints `for_replica(i)` names
    kv_events_config: KVEventsConfig | None = None
    force_mixed_steps: bool = False  # tests: the planner staggers prefills beside decodes
    fault: FaultPlan | None = None  # tests only

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model folder path, got {self.model!r}")
        for name, allowed in (("device", DEVICES), ("scheduling_policy", SCHEDULING_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        # the defaults that depend on other fields, resolved before anything reads them
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", DEFAULT_BATCHED_TOKENS[self.device])
        if self.prefix_cache_states is None:
            object.__setattr__(self, "prefix_cache_states", self.max_num_seqs)
        # The settings the ranks run are checked by ExecutorConfig, now: a bad one stops the
        # start before any rank does, named as here.
        ExecutorConfig(**_passed_on(self))
        limits = (
            ("data_parallel_size", 1),
            ("max_queued_requests", 1),
            ("max_queued_tokens", 1),
            ("max_logprobs", -1),
            ("prefix_cache_states", 0),
        )
        for name, low in limits:
            _check_int(name, getattr(self, name), low)
        # optional integers: a float or a string here used to reach the ranks, which died at
        # start on msgspec's "Expected `int`, got `float`"
        for name, low in (("max_model_len", 2), ("num_kv_blocks", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low, " or None")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so that every decode fits in a step"
            )
        watermark = self.kv_watermark
        if type(watermark) not in (int, float) or not 0 <= watermark < 1:
            raise ValueError(f"kv_watermark must be a number in [0, 1), got {watermark!r}")
        for name in ("step_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self._check_monitor_endpoint()
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            raise ValueError(
                "structured_outputs_config must be a StructuredOutputsConfig, got "
                f"{type(self.structured_outputs_config).__name__}"
            )
        if self.speculative_config is not None and not isinstance(
            self.speculative_config, SpeculativeConfig
        ):
            raise ValueError(
                "speculative_config must be a SpeculativeConfig, got "
                f"{type(self.speculative_config).__name__}"
            )
        self._check_device_ids()
        self._check_kv_events_config()
        for name in ("limit_mm_per_prompt", "mm_processor_kwargs"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a JSON object, got {getattr(self, name)!r}")
        _ = self.media  # checked by MediaConfig, naming the flag's field

    @property
    def media(self) -> MediaConfig:
        """The media settings' view (engine/media.py): the limits not named take their
        defaults."""
        return MediaConfig(
            limits={**DEFAULT_LIMITS, **self.limit_mm_per_prompt},
            processor_kwargs=self.mm_processor_kwargs,
            allowed_local_media_path=self.allowed_local_media_path,
        )

    def _check_monitor_endpoint(self) -> None:
        endpoint = self.monitor_endpoint
        if endpoint is not None and (
            not isinstance(endpoint, str)
            or not (endpoint == "auto" or endpoint.startswith(("ipc://", "tcp://")))
        ):
            raise ValueError(
                f"monitor_endpoint must be 'auto', ipc://PATH or tcp://HOST:PORT, got {endpoint!r}"
            )
        if self.data_parallel_size > 1 and endpoint not in (None, "auto"):
            raise ValueError(
                f"monitor_endpoint {endpoint!r}: with data parallelism each replica publishes "
                "on its own endpoint; use 'auto'"
            )

    def _check_kv_events_config(self) -> None:
        events = self.kv_events_config
        if events is not None and not isinstance(events, KVEventsConfig):
            raise ValueError(
                f"kv_events_config must be a KVEventsConfig, got {type(events).__name__}"
            )
        if events is not None and events.publishes and not self.enable_prefix_caching:
            raise ValueError(
                "kv_events_config: KV-cache events come from the prefix cache; "
                "enable it too (--enable-prefix-caching)"
            )

    def _check_device_ids(self) -> None:
        ids = self.device_ids
        if ids is None:
            return
        if self.device != "cuda":
            raise ValueError(f"device_ids {ids} given with device {self.device!r}; they name CUDA")
        need = self.tp_size * self.data_parallel_size
        if len(ids) != need or len(set(ids)) != len(ids):
            raise ValueError(
                f"device_ids {ids}: need {need} distinct devices (tp_size {self.tp_size} x "
                f"data_parallel_size {self.data_parallel_size})"
            )


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Model-dependent limits, resolved once at start."""

    max_model_len: int
    num_kv_blocks: int | None  # None: the ranks size it from gpu_memory_utilization (cuda)
    max_logprobs: int  # a request's logprobs and prompt_logprobs at most


def resolve_limits(config: EngineConfig, model_config: ModelConfig) -> EngineLimits:
    model_max = model_config.max_position_embeddings
    if config.max_model_len is None:
        max_model_len = min(model_max, DEFAULT_MAX_MODEL_LEN)
    elif config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings {model_max}"
        )
    else:
        max_model_len = config.max_model_len
    num_kv_blocks = config.num_kv_blocks
    if num_kv_blocks is None and config.device != "cuda":
        num_kv_blocks = -(-config.max_num_seqs * max_model_len // config.block_size)
    max_logprobs = model_config.vocab_size if config.max_logprobs == -1 else config.max_logprobs
    return EngineLimits(max_model_len, num_kv_blocks, max_logprobs)


def executor_config(config: EngineConfig, limits: EngineLimits) -> ExecutorConfig:
    """What every rank of a replica runs (`ReplicaConfig.rank_config` places each on its
    device): the settings of the same name, and the limits resolved at start."""
    return ExecutorConfig(
        **_passed_on(config),
        max_model_len=limits.max_model_len,
        num_kv_blocks=limits.num_kv_blocks,
        prefix_cache_states=config.prefix_cache_states if config.enable_prefix_caching else 0,
    )


def replica_config(config: EngineConfig, limits: EngineLimits, replica: int = 0) -> ReplicaConfig:
    """Replica `replica`'s view: what its ranks run, its devices, the controller's bounds."""
    if not 0 <= replica < config.data_parallel_size:
        raise ValueError(
            f"replica {replica} is outside data_parallel_size {config.data_parallel_size}"
        )
    return ReplicaConfig(
        executor=executor_config(config, limits),
        device_ids=replica_device_ids(config, replica),
        max_logprobs=limits.max_logprobs,
        overlap_steps=config.overlap_steps,
        startup_timeout_s=config.startup_timeout_s,
        step_timeout_s=config.step_timeout_s,
        fault=config.fault,
    )


def replica_device_ids(config: EngineConfig, replica: int) -> tuple[int, ...] | None:
    """Replica i's CUDA devices: the i-th tp_size of `device_ids` (default 0, 1, ...); None
    where the replica's default (0 .. tp_size - 1) is all there is."""
    if config.device != "cuda" or (config.device_ids is None and config.data_parallel_size == 1):
        return None
    tp = config.tp_size
    ids = config.device_ids or tuple(range(tp * config.data_parallel_size))
    return tuple(ids[replica * tp : (replica + 1) * tp])


def default_device() -> str:
    """cuda when this machine shows a GPU (read without importing torch: seconds of start-up),
    else cpu."""
    return "cuda" if cuda_device_count() > 0 else "cpu"


# The settings each rank is given as they are: ExecutorConfig's fields named as one of
# EngineConfig's, but those `executor_config` resolves.
_RESOLVED = frozenset({"max_model_len", "num_kv_blocks", "prefix_cache_states"})
_PASSED_ON = tuple(
    name
    for name in ExecutorConfig.__struct_fields__
    if name in {f.name for f in fields(EngineConfig)} and name not in _RESOLVED
)


def _passed_on(config: EngineConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in _PASSED_ON}


def _check_int(name: str, value: object, low: int, alternative: str = "") -> None:
    if type(value) is not int or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{alternative}, got {value!r}")
