"""EngineConfig's command line: one flag a field, `dest` the field's name, its default read
from the field, vLLM's spelling where vLLM has the flag (and the spellings deltaserve took
before, which launch scripts still pass); `engine_config` makes the config from the parsed
flags. `deltaserve serve --help` lists them."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import MISSING, fields

from deltaserve.engine.config import DEFAULT_BATCHED_TOKENS, DEFAULT_MAX_MODEL_LEN, EngineConfig
from deltaserve.engine.kv_events import KVEventsConfig
from deltaserve.engine.media import DEFAULT_LIMITS, PROCESSOR_KWARGS
from deltaserve.engine.speculative_config import SpeculativeConfig, parse_speculative_config
from deltaserve.engine.structured_config import StructuredOutputsConfig
from deltaserve.ipc.messages import (
    DTYPES,
    FP8_WEIGHTS,
    KV_CACHE_DTYPES,
    MAMBA_SSM_CACHE_DTYPES,
)

# EngineConfig fields that no flag sets: tests' only
UNFLAGGED = frozenset({"fault", "force_mixed_steps"})

# vLLM's human_readable_int (vllm/engine/arg_utils.py): lower case k m g t are powers of
# 1000, upper case K M G T powers of 1024; a decimal only before a lower case suffix
_SUFFIXES = {
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def human_readable_int(text: str) -> int:
    """An integer as vLLM's --max-model-len and --max-num-batched-tokens take one: 32768,
    32k (32,000), 32K (32,768), 25.6k. vLLM's --max-model-len auto (or -1: as long as the
    KV cache allows) is refused: here the default is the model's context capped."""
    value = text.strip()
    if value.lower() in ("auto", "-1"):
        raise argparse.ArgumentTypeError(
            f"{text!r} (vLLM: as long as memory allows) is not supported: give a length, or "
            f"leave the flag out for min(max_position_embeddings, {DEFAULT_MAX_MODEL_LEN})"
        )
    match = _HUMAN_INT.fullmatch(value)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 32768, 32k or 32K, got {text!r}"
        )
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * _SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"a decimal needs a lower case (power of 1000) suffix such as 25.6k, got {text!r}"
        )
    return int(number) * _SUFFIXES.get(suffix, 1)


def _device_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--device-ids must be like 0,1 (got {text!r})") from None
    if not ids:
        raise argparse.ArgumentTypeError("--device-ids is empty")
    return ids


def _monitor_endpoint(text: str) -> str | None:
    return None if text == "off" else text


def _structured_outputs(text: str) -> StructuredOutputsConfig:
    try:
        return StructuredOutputsConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _speculative(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--kv-events-config: {exc}") from None


def _json_object(flag: str) -> Callable[[str], dict]:
    """An argparse type: a JSON object, else an error naming the flag."""

    def parse(value: str) -> dict:
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, got {value!r:.60}")
        return parsed

    return parse


def default_of(name: str) -> object:
    """EngineConfig's default of field `name`: a flag's default is the field's."""
    for f in fields(EngineConfig):
        if f.name == name and f.default is not MISSING:
            return f.default
    raise KeyError(name)


def add_engine_flags(group: argparse._ActionsContainer) -> None:
    """Every EngineConfig field's flag (but UNFLAGGED's), into `group`."""
    d = default_of
    add = group.add_argument
    add(
        "--model",
        default=None,
        help="checkpoint directory (HF layout); omitted: a tiny built-in demo checkpoint, "
        "made once under ~/.cache/deltaserve",
    )
    add(
        "--tensor-parallel-size",
        "-tp",
        "--tp-size",
        "--tp",
        dest="tp_size",
        type=int,
        default=d("tp_size"),
        help="tensor-parallel size (one rank process per device)",
    )
    add(
        "--data-parallel-size",
        "-dp",
        "--dp-size",
        dest="data_parallel_size",
        type=int,
        default=d("data_parallel_size"),
        help="replicas of the model, each on its own tp-size devices with its own ranks and "
        "caches; a request goes to the least busy (engine/data_parallel.py)",
    )
    add(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="device kind; default: cuda if available, else cpu",
    )
    add(
        "--device-ids",
        type=_device_ids,
        default=d("device_ids"),
        help="cuda ordinals, comma separated; default: 0..tp x dp - 1 (replica i: the i-th tp "
        "of them)",
    )
    add(
        "--dtype",
        choices=DTYPES,
        default=d("dtype"),
        help="weight/activation dtype; auto: the checkpoint's (float32 on cpu)",
    )
    add(
        "--max-model-len",
        type=human_readable_int,
        default=d("max_model_len"),
        help="longest prompt + completion in tokens; default: min(max_position_embeddings, "
        f"{DEFAULT_MAX_MODEL_LEN})",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=d("max_num_seqs"),
        help="most requests running at once (DeltaNet state slots)",
    )
    add(
        "--max-num-batched-tokens",
        type=human_readable_int,
        default=d("max_num_batched_tokens"),
        help="token budget of one scheduler step (prefill chunks + decodes); default: "
        + ", ".join(f"{n} on {device}" for device, n in DEFAULT_BATCHED_TOKENS.items()),
    )
    add(
        "--max-queued-requests",
        type=int,
        default=d("max_queued_requests"),
        help="waiting requests (each replica's) beyond which new ones get HTTP 429",
    )
    add(
        "--max-queued-tokens",
        type=human_readable_int,
        default=d("max_queued_tokens"),
        help="prompt tokens of the waiting requests beyond which new ones get HTTP 429 "
        "(one is taken past it while nothing else waits)",
    )
    add(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=d("scheduling_policy"),
        help="admission order: arrival (fcfs), or each request's priority (lower first), then "
        "arrival; when KV blocks run out, the running request preempted is the one with the "
        "highest priority value (fcfs: the latest arrival)",
    )
    add(
        "--kv-watermark",
        type=float,
        default=d("kv_watermark"),
        help="share of the KV blocks that admission leaves free for running requests' "
        "growth while any run (vLLM's block manager watermark); when they still run out, "
        "the youngest are preempted and recomputed",
    )
    add(
        "--reserve-lifetime",
        action="store_true",
        default=d("reserve_lifetime"),
        help="admit each request with the KV blocks of its whole lifetime (prompt + "
        "max_tokens): none is ever preempted, but fewer run at once",
    )
    add("--block-size", type=int, default=d("block_size"), help="KV cache positions per block")
    add(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",  # vLLM's
        dest="num_kv_blocks",
        type=int,
        default=d("num_kv_blocks"),
        help="KV blocks; default: on cuda what --gpu-memory-utilization leaves, on cpu "
        "max_num_seqs * max_model_len / block_size",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        default=d("gpu_memory_utilization"),
        help="share (0, 1] of each GPU's total memory the engine may use: weights, "
        "activations and CUDA graphs first, the request state (max_num_seqs state slots, then "
        "as many KV blocks as fit) takes the rest; cuda only, unused with --num-kv-blocks",
    )
    add(
        "--enforce-eager",
        action="store_true",
        default=d("enforce_eager"),
        help="cuda: run every step eagerly, capturing no CUDA graphs",
    )
    add(
        "--prompt-graph-tokens",
        type=int,
        default=d("prompt_graph_tokens"),
        help="cuda: prompt steps of up to this many tokens replay a CUDA graph (a short "
        "prompt's first token no longer waits on ~450 launches); 0: never",
    )
    add(
        "--max-logprobs",
        type=int,
        default=d("max_logprobs"),
        help="the most logprobs, top_logprobs or prompt_logprobs a request may ask for (as "
        "vLLM's); -1: the whole vocabulary",
    )
    add(
        "--fp8-weights",
        choices=FP8_WEIGHTS,
        default=d("fp8_weights"),
        help="an FP8 checkpoint's projections: widened to --dtype as they load, or kept FP8 "
        "(half their memory; faster at one row, slower at more on the H200: docs/GPU.md)",
    )
    add(
        "--mamba-ssm-cache-dtype",
        choices=MAMBA_SSM_CACHE_DTYPES,
        default=d("mamba_ssm_cache_dtype"),
        help="the DeltaNet recurrent states' dtype (vLLM's flag): auto is the checkpoint's "
        "mamba_ssm_dtype (float32 for Qwen3.5); bfloat16 halves their memory and the bytes "
        "a decode step moves for them",
    )
    add(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=d("kv_cache_dtype"),
        help="the full-attention KV cache's dtype (vLLM's flag): auto is --dtype; fp8 (e4m3) "
        "halves a bf16 cache, each layer's keys and values scaled per KV head",
    )
    add(
        "--calculate-kv-scales",
        action="store_true",
        default=d("calculate_kv_scales"),
        help="with --kv-cache-dtype fp8: the scales from the first prompt step's keys and "
        "values (vLLM's flag); else 1.0",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d("enable_prefix_caching"),
        help="a prompt that begins with a saved prompt (the last turn of its conversation, a "
        "shared system prompt) skips that part's prefill (engine/prefix_cache.py)",
    )
    add(
        "--limit-mm-per-prompt",
        type=_json_object("--limit-mm-per-prompt"),
        default=None,
        metavar="JSON",
        help='images and videos a prompt may hold, as vLLM\'s: \'{"image": 4, "video": 1}\' '
        f"(default: {', '.join(f'{n} {kind}' for kind, n in DEFAULT_LIMITS.items())})",
    )
    add(
        "--mm-processor-kwargs",
        type=_json_object("--mm-processor-kwargs"),
        default=None,
        metavar="JSON",
        help="the checkpoint's image and video processors' settings, as vLLM's: "
        f"{', '.join(PROCESSOR_KWARGS)} (min_pixels, max_pixels: each image and frame resized "
        "into them)",
    )
    add(
        "--allowed-local-media-path",
        default=d("allowed_local_media_path"),
        metavar="DIR",
        help="file:// image and video urls may name files under DIR (default: none may)",
    )
    add(
        "--prefix-cache-states",
        type=int,
        default=d("prefix_cache_states"),
        metavar="N",
        help="with --enable-prefix-caching: saved prompt states each rank keeps, each the "
        "size of one request's DeltaNet state (default: --max-num-seqs)",
    )
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=d("async_scheduling"),
        help="plan and send the next step while one runs when it needs none of its results "
        "(vLLM's async scheduling); --no-async-scheduling: each step waits for the one "
        "before to be committed",
    )
    add(
        "--no-pipelining",
        dest="async_scheduling",
        action="store_false",
        default=argparse.SUPPRESS,
        help="the same as --no-async-scheduling",
    )
    add(
        "--overlap-steps",
        action=argparse.BooleanOptionalAction,
        default=d("overlap_steps"),
        help="each rank queues the pipelined step behind the one running before it reads that "
        "one's samples, so the device never waits for the host between them; default: on "
        "cuda",
    )
    add(
        "--no-overlap",
        dest="overlap_steps",
        action="store_false",
        default=argparse.SUPPRESS,
        help="the same as --no-overlap-steps",
    )
    add(
        "--step-timeout",
        dest="step_timeout_s",
        type=float,
        default=d("step_timeout_s"),
        help="seconds a step may take before the replica is declared dead",
    )
    add(
        "--startup-timeout",
        dest="startup_timeout_s",
        type=float,
        default=d("startup_timeout_s"),
        help="seconds for every rank to load",
    )
    structured = ",".join(f"{f.name}={f.default}" for f in fields(StructuredOutputsConfig))
    add(
        "--structured-outputs-config",
        type=_structured_outputs,
        default=None,
        help="vLLM's: structured outputs' engine and bounds, as JSON or comma-separated "
        f"key=value pairs; the fields and their defaults: {structured} "
        "(engine/structured_config.py). backend auto and guidance: llguidance",
    )
    add(
        "--speculative-config",
        type=_speculative,
        default=d("speculative_config"),
        metavar="JSON",
        help="vLLM's: speculative decoding with the checkpoint's MTP head, e.g. "
        '\'{"method": "mtp", "num_speculative_tokens": 3}\' (optional disable_by_batch_size: '
        "no drafts in a step of that many decoding requests or more; draft_vocab_size: draft "
        "among the first that many token ids; engine/speculative_config.py); default: off",
    )
    add(
        "--kv-events-config",
        type=_kv_events_config,
        default=d("kv_events_config"),
        metavar="JSON",
        help="vLLM's: publish the prefix cache's blocks for routers (docs/ROUTING.md), e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv"}\'; needs --enable-prefix-caching',
    )
    add(
        "--monitor-endpoint",
        type=_monitor_endpoint,
        default="auto",
        help="ZeroMQ PUB endpoint for monitors (deltaserve monitor ENDPOINT; docs/MONITOR.md): "
        "auto (an ipc:// socket in a private 0700 folder), ipc://PATH, tcp://HOST:PORT, or off",
    )


def engine_config(args: argparse.Namespace, **given: object) -> EngineConfig:
    """The EngineConfig of the parsed flags (`given` wins, field by field). A flag left at
    None takes the field's default; --device left out is the machine's (`default_device`)."""
    from deltaserve.engine.config import default_device

    flagged = (f.name for f in fields(EngineConfig) if f.name not in UNFLAGGED)
    values = {name: value for name in flagged if (value := getattr(args, name)) is not None}
    values.setdefault("device", default_device())
    return EngineConfig(**{**values, **given})
