"""`deltaserve generate`: one request through the model in this process, no control plane.

It is the plain path that the engine and the server are compared against, and a quick way to
look at a checkpoint. With `--json` it prints one JSON object per generated token:
{"token_id": int, "text": str, "logprob": float, "top_logprobs": [[token_id, logprob], ...]}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.engine.rank.model_config import ModelConfig
from deltaserve.engine.sampling_params import SamplingParams, wire_seed
from deltaserve.engine.tokenizer import eos_token_ids
from deltaserve.ipc.messages import NewRequest, Sample, SamplingSpec, StepItem


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
) -> list[Sample]:
    """Generate up to `max_tokens` tokens after `prompt_ids`; stops after an EOS token."""
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
        ExecutorConfig(str(model_dir), device=device, dtype=dtype, block_size=block_size,
                       num_slots=1, num_blocks=-(-total // block_size))
    )
    vocab = executor.model_config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids out of the vocabulary (size {vocab}): {bad[:5]}")
    eos = frozenset() if ignore_eos else eos_token_ids(model_dir, executor.model_config)  # the engine's set
    spec = SamplingSpec(seed=seed, temperature=temperature, num_logprobs=num_logprobs)
    samples = executor.run_step([StepItem(0, 0, list(prompt_ids), True, NewRequest(total, spec))])
    while samples[-1].token_id not in eos and len(samples) < max_tokens:
        position = len(prompt_ids) + len(samples) - 1
        samples += executor.run_step([StepItem(0, position, [samples[-1].token_id], True)])
    return samples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltaserve generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model folder (config.json, safetensors, tokenizer)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, any int64 (random if unset)")
    p.add_argument("--logprobs", type=int, default=0, help="alternatives to report per token (0-20)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "fp32", "bfloat16", "bf16"))
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--json", action="store_true", help="one JSON object per generated token")
    args = p.parse_args(argv)
    try:  # the engine's checks and messages: NaN or inf temperatures, seeds outside int64 were taken
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                       logprobs=args.logprobs)  # fmt: skip
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
            print(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}", file=sys.stderr)
            return 2
    else:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    seed = wire_seed(args.seed) if args.seed is not None else random.randrange(2**63)  # as the engine's
    try:
        samples = generate_tokens(
            args.model, prompt_ids, args.max_tokens, args.temperature, seed, args.logprobs,
            args.device, args.dtype, args.ignore_eos,
        )
    except (OSError, ValueError) as e:  # a bad config.json or checkpoint, refused parameters
        print(f"error: {e}", file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(tokenizer)
    for i, sample in enumerate(samples):
        text = detok.add(sample.token_id) + (detok.flush() if i == len(samples) - 1 else "")
        if args.json:
            print(json.dumps({
                "token_id": sample.token_id,
                "text": text,
                "logprob": sample.logprob,
                "top_logprobs": [[t, lp] for t, lp in sample.top_logprobs],
            }, ensure_ascii=False))
        else:
            print(text, end="", flush=True)
    if not args.json:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
