"""The `vllm serve` flags that launch scripts carry, as `deltaserve serve` takes them: the
spelling accepted where deltaserve already does what the flag asks, the start refused with the
reason where it cannot (never a flag silently dropped).

The vLLM flags that set a config field are the field's own flag, spelled as vLLM does
(engine/config_flags.py: --max-model-len, --enforce-eager, --async-scheduling, ...; serve.py:
--seed, --chat-template, ...); this module holds those that change nothing here and those
refused, each with its reason, and --uvicorn-log-level's levels.
"""

from __future__ import annotations

import argparse
import logging

from deltaserve.engine.model_config import FP8_SCALE_SUFFIXES

# uvicorn's level names (vLLM's --uvicorn-log-level choices) as logging levels; trace is
# uvicorn's level below debug
UVICORN_LOG_LEVELS = {
    "critical": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": logging.DEBUG,
}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags that change nothing here or are refused (`refused_vllm_flag`)."""
    g = parser.add_argument_group(
        "vLLM flags that launch scripts pass (accepted where deltaserve already does what "
        "they ask, refused at start where it cannot)"
    )
    # vLLM's flag lets transformers import Python shipped in the checkpoint folder (custom
    # architectures, tokenizers). deltaserve runs no code from the checkpoint, with the flag
    # or without it, and a checkpoint that cannot load without such code fails to load either
    # way: the flag grants nothing here, so it is accepted and changes nothing.
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted, no effect: deltaserve runs no code from the checkpoint folder",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted, no effect: deltaserve logs no requests",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="refused: deltaserve logs no requests (/metrics and `deltaserve monitor` show them)",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted, no effect: deltaserve logs no periodic stats (/metrics has them)",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="accepted, no effect: the HTTP server writes no access log",
    )
    g.add_argument(
        "--uvicorn-log-level",
        choices=tuple(UVICORN_LOG_LEVELS),
        type=str.lower,
        default=None,
        help="the HTTP server's (aiohttp's) log level, as vLLM's sets uvicorn's; "
        "default: --log-level",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--enable-chunked-prefill is accepted (what deltaserve does: prompts are "
        "prefilled in chunks of --max-num-batched-tokens); --no-... is refused",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="fp8 (Qwen's -FP8 releases) or compressed-tensors (llm-compressor's FP8), what the "
        "checkpoint is; it loads as such without it. Quantizing at load is refused",
    )
    # vLLM (v0) could swap a preempted request's KV blocks to this much CPU memory; here, as
    # in vLLM v1, a preempted request is recomputed, so no swap space is ever needed: any size
    # is honoured by using none of it.
    g.add_argument(
        "--swap-space",
        type=float,
        default=None,
        metavar="GiB",
        help="accepted, no effect: a preempted request is recomputed, nothing is swapped",
    )


def refused_vllm_flag(args: argparse.Namespace) -> str | None:
    """Why the start is refused for a vLLM flag deltaserve cannot honour; None if none is."""
    if args.enable_log_requests:
        return (
            "--enable-log-requests: not supported: deltaserve logs no requests; /metrics "
            "counts them and `deltaserve monitor` shows each live"
        )
    if args.enable_chunked_prefill is False:
        return (
            "--no-enable-chunked-prefill: not supported: deltaserve always prefills a prompt "
            "in chunks of at most --max-num-batched-tokens tokens"
        )
    if args.quantization not in (None, *FP8_SCALE_SUFFIXES):
        return (
            f"--quantization {args.quantization}: not supported: deltaserve loads unquantized "
            "(bf16/fp32) checkpoints and FP8 ones (--quantization fp8 or compressed-tensors)"
        )
    if args.swap_space is not None and not args.swap_space >= 0:
        return f"--swap-space must be a number of GiB >= 0, got {args.swap_space}"
    return None


def check_quantization(method: str | None, model_dir: str | None) -> None:
    """ValueError unless --quantization names what the checkpoint is (`model_dir` None: the
    demo's, unquantized): vLLM would quantize an unquantized checkpoint as it loads."""
    if method is None:
        return
    from deltaserve.engine.model_config import ModelConfig

    try:
        config = ModelConfig.from_model_dir(model_dir) if model_dir is not None else None
    except FileNotFoundError as e:  # no config.json
        raise ValueError(str(e)) from None
    if config is None or config.fp8_block is None:
        raise ValueError(
            f"--quantization {method}: {model_dir or 'the demo checkpoint'} is not an FP8 "
            "checkpoint (no FP8 quantization_config in its config.json), and quantizing a "
            "checkpoint as it loads is not supported"
        )
    if config.fp8_scale_suffix != FP8_SCALE_SUFFIXES[method]:
        actual = next(
            name for name, suffix in FP8_SCALE_SUFFIXES.items() if suffix == config.fp8_scale_suffix
        )
        raise ValueError(
            f"--quantization {method}: {model_dir}'s quantization_config says {actual}"
        )
