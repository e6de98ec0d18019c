"""Guided decoding, measured: what a JSON schema (or a regex) costs per output token.

`--batch` requests at once, each `--output-len` tokens at most, seeded at temperature 1 with
the same prompt length: unguided (ignore_eos, the reference), then guided by a JSON schema
twice: "cold" (rank 0 compiles the pattern and walks the vocabulary for every state it meets;
the first guided request in the process also reads tokenizer.json) and "warm" (the same
schema again: the masks are cached), then by a regex. Guided outputs end when their pattern
is complete, so the figure compared is time per output token of each request (its decode
steps after the first token), and every guided output is checked against its pattern.

    python -m tools.bench_guided --model DIR --device cuda --out bench/results/guided_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import FinishedEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.tools.hardware import host_info

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
        },
        "kind": {"enum": ["person", "company", "other"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "active"],
}
REGEX = r"(?:[A-Z][a-z]{1,10} ){1,6}[0-9]{1,4}(?:, [A-Z][a-z]{1,10}){0,3}\."


async def one(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    start = time.perf_counter()
    first = last = None
    tokens = []
    reason = ""
    async for event in engine.generate(prompt, params):
        if isinstance(event, TokenEvent):
            last = time.perf_counter()
            first = first or last
            tokens.append(event.token_id)
        elif isinstance(event, FinishedEvent):
            reason = event.reason
        else:
            raise RuntimeError(f"request failed: {event}")
    decode_s = (last - first) if len(tokens) > 1 else 0.0
    return {
        "ttft_s": first - start,
        "tpot_s": decode_s / max(1, len(tokens) - 1),
        "tokens": tokens,
        "reason": reason,
    }


async def workload(
    engine: AsyncEngine, name: str, args: argparse.Namespace, **guided
) -> dict[str, Any]:
    prompt = list(range(1000, 1000 + args.prompt_len))
    params = [
        SamplingParams(
            max_tokens=args.output_len, temperature=1.0, seed=i, ignore_eos=not guided, **guided
        )
        for i in range(args.batch)
    ]
    start = time.perf_counter()
    runs = await asyncio.gather(*(one(engine, prompt, p) for p in params))
    wall = time.perf_counter() - start
    texts = [engine.tokenizer.decode(r["tokens"], skip_special_tokens=True) for r in runs]
    valid = [_valid(t, r["reason"], guided) for t, r in zip(texts, runs, strict=True)]
    return {
        "workload": name,
        "wall_s": wall,
        "outputs": len(runs),
        "valid": sum(valid),
        "complete": sum(r["reason"] == "stop" for r in runs),
        "mean_tokens": statistics.mean(len(r["tokens"]) for r in runs),
        "tpot_ms_median": 1e3
        * statistics.median(r["tpot_s"] for r in runs if len(r["tokens"]) > 1),
        "ttft_ms_median": 1e3 * statistics.median(r["ttft_s"] for r in runs),
        "sample_text": texts[0][:300],
    }


def _valid(text: str, reason: str, guided: dict) -> bool:
    """A complete output matches its pattern; one cut by max_tokens is not checked here (the
    CPU tests check prefixes)."""
    if not guided or reason != "stop":
        return True
    if "guided_regex" in guided:
        return re.fullmatch(guided["guided_regex"], text) is not None
    doc = json.loads(text)
    return (
        isinstance(doc, dict)
        and {"name", "age", "kind", "active"} <= set(doc)
        and 0 <= doc["age"] <= 150
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    engine = await AsyncEngine.start(
        EngineConfig(model=args.model, device=args.device, max_num_seqs=max(8, args.batch))
    )
    try:
        await workload(engine, "warm-up", args)
        rows = [
            await workload(engine, "unguided", args),
            await workload(engine, "json cold", args, guided_json=json.dumps(SCHEMA)),
            await workload(engine, "json warm", args, guided_json=json.dumps(SCHEMA)),
            await workload(engine, "regex cold", args, guided_regex=REGEX),
            await workload(engine, "regex warm", args, guided_regex=REGEX),
        ]
    finally:
        await engine.shutdown()
    base = rows[0]["tpot_ms_median"]
    for row in rows:
        row["tpot_vs_unguided"] = row["tpot_ms_median"] / base
    return {
        "command": " ".join(sys.argv),
        "host": host_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--out", type=Path)
    result = asyncio.run(main(p.parse_args()))
    print(
        f"{'workload':12s} {'tpot ms':>8s} {'x unguided':>10s} {'ttft ms':>8s} {'tokens':>7s} {'complete':>8s} {'valid':>6s}"
    )
    for r in result["rows"]:
        print(
            f"{r['workload']:12s} {r['tpot_ms_median']:8.2f} {r['tpot_vs_unguided']:10.2f} {r['ttft_ms_median']:8.1f} "
            f"{r['mean_tokens']:7.1f} {r['complete']:8d} {r['valid']:6d}"
        )
    if result["host"] and (out := p.parse_args().out):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
