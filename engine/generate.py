"""`deltaserve generate`: one request through the model in this process, no control plane.

It is the plain path that the engine and the server are compared against, and a quick way to
look at a checkpoint. With `--json` it prints one JSON object per generated token:
{"token_id": int, "text": str, "logprob": float, "top_logprobs": [[token_id, logprob], ...]}.
As `deltaserve serve` does, it samples with the settings of the model's generation_config.json
where no flag gives one (`--generation-config vllm`: ignored); greedy where neither does.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.model_config import ConfigError, ModelConfig
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.engine.sampling_params import SamplingParams, wire_seed
from deltaserve.engine.tokenizer import eos_token_ids, generation_sampling_defaults
from deltaserve.ipc.messages import NewRequest, Sample, StepItem


def generate_tokens(
    model_dir: str | Path,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    num_logprobs: int = 0,
    device: str = "cpu",
    dtype: str = "auto",
    ignore_eos: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> list[Sample]:
    """Generate up to `max_tokens` tokens after `prompt_ids`; stops after an EOS token. The
    sampling values are checked as the engine checks a request's (ValueError naming one)."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    total = len(prompt_ids) + max_tokens
    context = ModelConfig.from_model_dir(model_dir).max_position_embeddings
    if total > context:  # the engine refuses it too: positions past the model's context
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"the model's max_position_embeddings {context}"
        )
    block_size = 16
    executor = Executor(
        ExecutorConfig(
            str(model_dir),
            device=device,
            dtype=dtype,
            block_size=block_size,
            num_slots=1,
            num_blocks=-(-total // block_size),
        )
    )
    vocab = executor.model_config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids out of the vocabulary (size {vocab}): {bad[:5]}")
    eos = (
        frozenset() if ignore_eos else eos_token_ids(model_dir, executor.model_config)
    )  # the engine's set
    spec = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        logprobs=num_logprobs,
    ).to_spec(seed)
    samples = executor.run_step([StepItem(0, 0, list(prompt_ids), True, NewRequest(total, spec))])
    while samples[-1].token_id not in eos and len(samples) < max_tokens:
        position = len(prompt_ids) + len(samples) - 1
        samples += executor.run_step([StepItem(0, position, [samples[-1].token_id], True)])
    return samples


# a sampling setting's value when neither a flag nor generation_config.json gives one: greedy,
# nothing filtered
_SAMPLING_FALLBACKS = {
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltaserve generate", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", required=True, help="HF model folder (config.json, safetensors, tokenizer)"
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 for greedy; default: generation_config.json's, else 0",
    )
    for flag, kind, off in (
        ("--top-k", int, "0 (off)"),
        ("--top-p", float, "1"),
        ("--min-p", float, "0"),
        ("--repetition-penalty", float, "1"),
    ):
        p.add_argument(
            flag, type=kind, default=None, help=f"default: generation_config.json's, else {off}"
        )
    p.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="auto: the sampling settings of the model's generation_config.json are the "
        "defaults of those no flag gives, as serve's; vllm: ignore them",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="sampling seed, any int64 (random if unset)"
    )
    p.add_argument("--logprobs", type=int, default=0, help="alternatives to report per token")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "fp32", "bfloat16", "bf16")
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--json", action="store_true", help="one JSON object per generated token")
    args = p.parse_args(argv)
    try:  # serve's defaults of a request that leaves them out; its check of the file's values
        defaults = (
            generation_sampling_defaults(args.model) if args.generation_config == "auto" else {}
        )
    except ConfigError as exc:
        p.error(str(exc))
    args.file_defaults = {k: v for k, v in defaults.items() if getattr(args, k) is None}
    for name, fallback in _SAMPLING_FALLBACKS.items():
        if getattr(args, name) is None:
            setattr(args, name, args.file_defaults.get(name, fallback))
    try:  # the engine's checks and messages: NaN or inf temperatures, seeds outside int64 were taken
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            logprobs=args.logprobs,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
        )
    except ValueError as exc:
        p.error(f"--{str(exc).replace('_', '-')}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from deltaserve.engine.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(args.model)
    except (OSError, ValueError) as e:  # no folder, no tokenizer.json, a slow tokenizer
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            print(
                f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}",
                file=sys.stderr,
            )
            return 2
    else:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    seed = (
        wire_seed(args.seed) if args.seed is not None else random.randrange(2**63)
    )  # as the engine's
    if args.file_defaults:  # said, as serve says it: the output is no longer greedy by default
        print(
            "sampling defaults from the model's generation_config.json: "
            + ", ".join(f"{k}={v}" for k, v in args.file_defaults.items())
            + " (flags win; --generation-config vllm ignores the file)",
            file=sys.stderr,
        )
    try:
        samples = generate_tokens(
            args.model,
            prompt_ids,
            args.max_tokens,
            args.temperature,
            seed,
            args.logprobs,
            args.device,
            args.dtype,
            args.ignore_eos,
            args.top_k,
            args.top_p,
            args.min_p,
            args.repetition_penalty,
        )
    except (OSError, ValueError) as e:  # a bad config.json or checkpoint, refused parameters
        print(f"error: {e}", file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(tokenizer)
    for i, sample in enumerate(samples):
        text = detok.add(sample.token_id) + (detok.flush() if i == len(samples) - 1 else "")
        if args.json:
            print(
                json.dumps(
                    {
                        "token_id": sample.token_id,
                        "text": text,
                        "logprob": sample.logprob,
                        "top_logprobs": [[t, lp] for t, lp in sample.top_logprobs],
                    },
                    ensure_ascii=False,
                )
            )
        else:
            print(text, end="", flush=True)
    if not args.json:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
