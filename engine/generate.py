"""`deltaserve generate`: one prompt through the engine (AsyncEngine, its rank process
started for it and stopped after), a quick way to look at a checkpoint from the shell.

With `--json` it prints one JSON object per generated token:
{"token_id": int, "text": str, "logprob": float, "top_logprobs": [[token_id, logprob], ...]}.
As `deltaserve serve` does, it samples with the settings of the model's generation_config.json
where no flag gives one (`--generation-config vllm`: ignored); greedy where neither gives a
temperature. It stops where the engine does (max_tokens, an EOS unless --ignore-eos).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig, default_device
from deltaserve.engine.events import ErrorEvent, FinishedEvent, TokenEvent
from deltaserve.engine.model_config import ConfigError
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.tokenizer import generation_sampling_defaults, load_tokenizer
from deltaserve.ipc.messages import DTYPES
from deltaserve.ipc.replica_config import ReplicaStartupError

# the sampling flags that generation_config.json may give defaults for
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# the temperature when neither a flag nor generation_config.json gives one: greedy (a
# request's default is vLLM's, 1.0)
GREEDY = 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, and `args.params`: the request's SamplingParams (the engine's checks, each
    error naming its flag)."""
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
        help=f"0 for greedy; default: generation_config.json's, else {GREEDY}",
    )
    for flag, kind in (
        ("--top-k", int),
        ("--top-p", float),
        ("--min-p", float),
        ("--repetition-penalty", float),
    ):
        p.add_argument(
            flag, type=kind, default=None, help="default: generation_config.json's, else off"
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
    p.add_argument("--dtype", default="auto", choices=DTYPES)
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
    given = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    try:
        args.params = SamplingParams(
            **{"temperature": GREEDY, **args.file_defaults, **given},
            max_tokens=args.max_tokens,
            seed=args.seed,
            logprobs=args.logprobs,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:  # NaN or inf temperatures, seeds outside int64, ...
        p.error(f"--{str(exc).replace('_', '-')}")
    kind, _, ordinal = args.device.partition(":")
    if kind not in ("cpu", "cuda") or (ordinal and (kind == "cpu" or not ordinal.isdigit())):
        p.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if kind == "cuda" and default_device() != "cuda":
        p.error(f"--device {args.device}: this machine sees no CUDA device")
    args.device_kind, args.device_ids = kind, (int(ordinal),) if ordinal else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    if args.file_defaults:  # said, as serve says it: the output is no longer greedy by default
        print(
            "sampling defaults from the model's generation_config.json: "
            + ", ".join(f"{k}={v}" for k, v in args.file_defaults.items())
            + " (flags win; --generation-config vllm ignores the file)",
            file=sys.stderr,
        )
    try:
        config = EngineConfig(
            model=args.model,
            device=args.device_kind,
            device_ids=args.device_ids,
            dtype=args.dtype,
            max_num_seqs=1,
            max_model_len=max(2, len(prompt_ids) + args.max_tokens),  # this request's
            max_logprobs=-1,  # --logprobs: any number of alternatives
        )
        return asyncio.run(_generate(config, prompt_ids, args.params, args.json))
    except (OSError, ValueError) as e:  # a bad config.json or checkpoint, refused parameters
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ReplicaStartupError as e:  # a rank could not load the checkpoint
        print(f"error: {e}", file=sys.stderr)
        return 1


async def _generate(
    config: EngineConfig, prompt_ids: list[int], params: SamplingParams, as_json: bool
) -> int:
    """Print the tokens as they come; 0 once the request finished, 1 if it failed."""
    async with await AsyncEngine.start(config) as engine:
        held: TokenEvent | None = None  # printed once the next event says whether text follows
        async for event in engine.generate(prompt_ids, params):
            if isinstance(event, TokenEvent):
                _print(held, "", as_json)
                held = event
            elif isinstance(event, FinishedEvent):
                _print(held, event.text, as_json)  # the text held back, flushed at the end
                if not as_json:
                    print()
            elif isinstance(event, ErrorEvent):
                _print(held, "", as_json)
                print(f"\nerror: {event.message}", file=sys.stderr)
                return 1
    return 0


def _print(token: TokenEvent | None, tail: str, as_json: bool) -> None:
    if token is None:
        print(tail, end="", flush=True)
    elif as_json:
        row = {
            "token_id": token.token_id,
            "text": token.text + tail,
            "logprob": token.logprob,
            "top_logprobs": [[t, lp] for t, lp in token.top_logprobs],
        }
        print(json.dumps(row, ensure_ascii=False))
    else:
        print(token.text + tail, end="", flush=True)


if __name__ == "__main__":
    sys.exit(main())
