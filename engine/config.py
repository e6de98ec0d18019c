"""The engine's configuration, checked at construction.

Values that depend on the model (max_model_len, the KV block count) are resolved once at
start by `resolve_limits` and live on the engine, never written back into the config. On
CUDA with no `num_kv_blocks`, the ranks size the KV cache themselves from
`gpu_memory_utilization` (engine/rank/memory_budget.py) and the engine learns the count from
their `Ready`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltaserve.engine.media import MediaConfig
from deltaserve.engine.model_config import FP8_WEIGHTS, ModelConfig
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.engine.structured_config import StructuredOutputsConfig

if TYPE_CHECKING:
    from deltaserve.ipc.faults import FaultPlan

DEFAULT_MAX_MODEL_LEN = 8192
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16")
DEVICES = ("cpu", "cuda")
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    tp_size: int = 1
    device: str = "cpu"
    device_ids: tuple[int, ...] | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # default min(max_position_embeddings, 8192)
    max_num_seqs: int = 16
    # tokens per step; default 8192 on cuda (vLLM's and SGLang's chunk for large GPUs: a prompt
    # chunk that small leaves the matmuls and the launch overhead per token poor), 2048 on cpu
    max_num_batched_tokens: int | None = None
    max_queued_requests: int = 256
    # prompt tokens of the waiting choices (each held in memory until admitted); one call is
    # taken past it while nothing else waits
    max_queued_tokens: int = 4 * 1024 * 1024
    # vLLM's: "fcfs" admits in arrival order; "priority" by each request's priority (lower
    # first), then arrival. Nothing running is preempted for a waiting request.
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    # default: on cuda what gpu_memory_utilization leaves, on cpu max_num_seqs * max_model_len
    # / block_size
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9  # share of each device's memory the engine may use (cuda)
    enforce_eager: bool = False  # cuda: never replay CUDA graphs (vLLM's flag)
    # cuda: prompt-only steps of up to this many tokens replay a CUDA graph (engine/rank/
    # prompt_graphs.py); 0: prompts always run eagerly
    prompt_graph_tokens: int = 2048
    # the most logprobs (and prompt logprobs) a request may ask for, as vLLM's; -1: the vocabulary
    max_logprobs: int = 20
    # an FP8 checkpoint's projections: "widen"ed to the model's dtype as they load, or "keep"
    # FP8 (half their memory; engine/rank/loader.py)
    fp8_weights: str = "widen"
    # reuse a saved prompt's state and KV for later prompts that begin with it
    # (engine/prefix_cache.py; vLLM's flag); each rank keeps `prefix_cache_states` saved
    # states (default max_num_seqs), each the size of one request's DeltaNet state
    enable_prefix_caching: bool = False
    prefix_cache_states: int | None = None
    # send step N+1 while step N runs when it needs none of N's results (engine/scheduler.py;
    # vLLM's async scheduling); off: every step waits for the one before to be committed
    pipeline_steps: bool = True
    # each rank queues a pipelined step N+1 on the device before it reads N's samples, so the
    # device does not wait for the host between them; None: on cuda (on the cpu every op
    # waits, and N's reply would only come after N+1's forward)
    overlap_steps: bool | None = None
    step_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    monitor_endpoint: str | None = None  # None: no monitor; "auto", ipc://PATH, tcp://HOST:PORT
    # guided decoding's and stop regexes' engine and bounds (engine/structured_config.py)
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    # speculative decoding with the checkpoint's MTP head (vLLM's --speculative-config); None: off
    speculative: SpeculativeConfig | None = None
    force_mixed_steps: bool = False  # tests: the planner staggers prefills beside decodes
    fault: FaultPlan | None = None  # tests only

    # images and video (engine/media.py): vLLM's --limit-mm-per-prompt, --mm-processor-kwargs,
    # --allowed-local-media-path
    media: MediaConfig = field(default_factory=MediaConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model folder path, got {self.model!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", DEFAULT_BATCHED_TOKENS[self.device])
        if self.prefix_cache_states is None:
            object.__setattr__(self, "prefix_cache_states", self.max_num_seqs)
        positive = {
            "tp_size": self.tp_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_queued_requests": self.max_queued_requests,
            "max_queued_tokens": self.max_queued_tokens,
            "block_size": self.block_size,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so that every decode fits in a step"
            )
        if (
            not isinstance(self.max_logprobs, int)
            or isinstance(self.max_logprobs, bool)
            or self.max_logprobs < -1
        ):
            raise ValueError(
                f"max_logprobs must be an integer >= -1 (-1: the vocabulary), got {self.max_logprobs!r}"
            )
        if self.fp8_weights not in FP8_WEIGHTS:
            raise ValueError(
                f"fp8_weights must be one of {', '.join(FP8_WEIGHTS)}, got {self.fp8_weights!r}"
            )
        for name in ("prompt_graph_tokens", "prefix_cache_states"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        # optional integers: a float or a string here used to reach the ranks, which died at
        # start on msgspec's "Expected `int`, got `float`"
        for name, low in (("max_model_len", 2), ("num_kv_blocks", 1)):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < low
            ):
                raise ValueError(f"{name} must be an integer >= {low} or None, got {value!r}")
        util = self.gpu_memory_utilization
        if (
            not isinstance(util, int | float)
            or isinstance(util, bool)
            or not (math.isfinite(util) and 0 < util <= 1)
        ):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {util!r}")
        for name in ("step_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        endpoint = self.monitor_endpoint
        if endpoint is not None and (
            not isinstance(endpoint, str)
            or not (endpoint == "auto" or endpoint.startswith(("ipc://", "tcp://")))
        ):
            raise ValueError(
                f"monitor_endpoint must be 'auto', ipc://PATH or tcp://HOST:PORT, got {endpoint!r}"
            )
        if not isinstance(self.structured_outputs, StructuredOutputsConfig):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsConfig, got "
                f"{type(self.structured_outputs).__name__}"
            )
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(
                "speculative must be a SpeculativeConfig (engine/speculative_config.py), got "
                f"{type(self.speculative).__name__}"
            )
        if self.device_ids is not None:
            if self.device != "cuda":
                raise ValueError("device_ids is only meaningful with device='cuda'")
            if len(self.device_ids) != self.tp_size:
                raise ValueError(
                    f"device_ids has {len(self.device_ids)} entries for tp_size {self.tp_size}"
                )


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Model-dependent limits, resolved once at start."""

    max_model_len: int
    num_kv_blocks: int | None  # None: the ranks size it from gpu_memory_utilization (cuda)


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
    return EngineLimits(max_model_len, num_kv_blocks)
