r"""An RL loop's weight update, measured and checked: how long `AsyncEngine.update_weights`
takes to put another checkpoint of the same model on every rank, and that the engine then
answers exactly as a fresh engine started on that checkpoint (greedy, ignore_eos; on CUDA the
same graphs replay the new weights), and as before once the first weights are back.

    python -m tools.make_model --preset 4b --out /tmp/a --seed 0 --device cuda --dtype bf16
    python -m tools.make_model --preset 4b --out /tmp/b --seed 1 --device cuda --dtype bf16
    python -m tools.bench_weight_update --model /tmp/a --other /tmp/b --device cuda \
        --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.tools.hardware import host_info

PROMPT = [9707, 11, 1879, 0, 358, 1079, 264, 1273, 2701, 3331, 17, 88, 1024, 45, 77, 5]


async def greedy(engine: AsyncEngine, tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [e.token_id async for e in engine.generate(PROMPT, params) if isinstance(e, TokenEvent)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    def config(model: str) -> EngineConfig:
        return EngineConfig(
            model=model, device=args.device, tp_size=args.tp, max_model_len=2048, max_num_seqs=8
        )

    async with await AsyncEngine.start(config(args.model)) as engine:
        first = await greedy(engine, args.tokens)
        started = time.perf_counter()
        await engine.update_weights(args.other)
        to_other_s = time.perf_counter() - started
        updated = await greedy(engine, args.tokens)
        started = time.perf_counter()
        await engine.update_weights(args.model)
        back_s = time.perf_counter() - started
        again = await greedy(engine, args.tokens)
    async with await AsyncEngine.start(config(args.other)) as fresh:
        reference = await greedy(fresh, args.tokens)
    nbytes = sum(f.stat().st_size for f in Path(args.other).glob("*.safetensors"))
    return {
        "answers_as_a_fresh_engine": updated == reference,
        "answers_as_before_once_back": again == first,
        "weights_differ": first != reference,
        "update_s": round(to_other_s, 3),
        "update_back_s": round(back_s, 3),
        "checkpoint_gb": round(nbytes / 1e9, 3),
        "gb_per_s": round(nbytes / 1e9 / to_other_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--other", required=True, help="another checkpoint of the same model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args()
    figures = asyncio.run(run(args))
    record = {
        "command": " ".join(["python -m tools.bench_weight_update", *sys.argv[1:]]),
        "hardware": host_info(),
        "figures": figures,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(figures))
    if not (
        figures["answers_as_a_fresh_engine"]
        and figures["answers_as_before_once_back"]
        and figures["weights_differ"]
    ):
        sys.exit(1)


if __name__ == "__main__":
    main()
