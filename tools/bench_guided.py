"""Guided decoding, measured: what a JSON schema, a regex and a GBNF grammar cost per output
token beside unguided decoding, cold and cached, at each batch size asked for.

At each batch size, `--batch` requests at once, each `--output-len` tokens at most, seeded at
temperature 1, the same prompt length: unguided (ignore_eos, the reference), then each
constraint twice: "cold" (a text the engine never saw: compiled, then its matcher built on
rank 0, both in the requests' way) and "cached" (the same text again). A guided warm-up
first reads the vocabulary for guided decoding, once per process. Each batch size gets
texts of its own, so its cold runs are cold. Guided outputs end when their constraint is
complete, so the figure compared is each request's time per output token (its decode steps
after the first token), median over the batch, as a ratio to unguided; every complete
output is checked against its constraint. Runs on engines that compile in
`AsyncEngine.prepare` and on those before it (where `generate` compiled), so the same file
measures before and after.

    python -m tools.bench_guided --model DIR --device cuda --batches 8,64 \\
        --out bench/results/guided_h100.json
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
from deltaserve.tools.hardware import git_commit, host_info

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
# a list of records: a context-free grammar's rules, JSON-like text (and a regular language,
# so that the check below can be a regex)
GRAMMAR = r"""
root ::= "[" record ("," " "? record){0,5} "]"
record ::= "{" "\"id\": " [0-9]{1,4} ", \"tags\": [" tag ("," " "? tag){0,3} "]}"
tag ::= "\"" [a-z]{1,8} "\""
"""
GRAMMAR_CHECK = re.compile(
    r'\[\{"id": [0-9]{1,4}, "tags": \["[a-z]{1,8}"(?:, ?"[a-z]{1,8}"){0,3}\]\}'
    r'(?:, ?\{"id": [0-9]{1,4}, "tags": \["[a-z]{1,8}"(?:, ?"[a-z]{1,8}"){0,3}\]\}){0,5}\]'
)


def constraints(batch: int) -> dict[str, dict[str, Any]]:
    """Each constraint, as a text of this batch size's own (a cold run compiles it anew)."""
    schema = {**SCHEMA, "title": f"person-{batch}"}
    return {
        "json": {"guided_json": json.dumps(schema)},
        "regex": {"guided_regex": f"(?:{REGEX}|x{{{batch}}})"},  # an alternative never taken
        "grammar": {"guided_grammar": GRAMMAR + f"# batch {batch}\n"},
    }


async def one(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    start = time.perf_counter()
    first = last = None
    tokens: list[int] = []
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
    engine: AsyncEngine, name: str, batch: int, args: argparse.Namespace, **guided: Any
) -> dict[str, Any]:
    prompt = list(range(1000, 1000 + args.prompt_len))
    params = [
        SamplingParams(
            max_tokens=args.output_len, temperature=1.0, seed=i, ignore_eos=not guided, **guided
        )
        for i in range(batch)
    ]
    start = time.perf_counter()
    prepare = getattr(engine, "prepare", None)  # engines before it compiled in generate
    if prepare is not None:
        params = list(await asyncio.gather(*(prepare(p) for p in params)))
    compile_s = time.perf_counter() - start
    runs = await asyncio.gather(*(one(engine, prompt, p) for p in params))
    wall = time.perf_counter() - start
    texts = [engine.tokenizer.decode(r["tokens"], skip_special_tokens=True) for r in runs]
    valid = [_valid(t, r["reason"], guided) for t, r in zip(texts, runs, strict=True)]
    decoding = [r["tpot_s"] for r in runs if len(r["tokens"]) > 1]
    return {
        "workload": name,
        "batch": batch,
        "wall_s": wall,
        "compile_s": compile_s,
        "outputs": len(runs),
        "valid": sum(valid),
        "complete": sum(r["reason"] == "stop" for r in runs),
        "mean_tokens": statistics.mean(len(r["tokens"]) for r in runs),
        "output_tokens_per_s": sum(len(r["tokens"]) for r in runs) / wall,
        "tpot_ms_median": 1e3 * statistics.median(decoding) if decoding else None,
        "ttft_ms_median": 1e3 * statistics.median(r["ttft_s"] for r in runs),
        "sample_text": texts[0][:300],
    }


def _valid(text: str, reason: str, guided: dict) -> bool:
    """A complete output matches its constraint; one cut by max_tokens is not checked here
    (the CPU tests check prefixes)."""
    if not guided or reason != "stop":
        return True
    if "guided_regex" in guided:
        return re.fullmatch(guided["guided_regex"], text) is not None
    if "guided_grammar" in guided:
        return GRAMMAR_CHECK.fullmatch(text) is not None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(doc, dict)
        and {"name", "age", "kind", "active"} <= set(doc)
        and 0 <= doc["age"] <= 150
    )


async def main(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    batches = [int(b) for b in args.batches.split(",")]
    engine = await AsyncEngine.start(
        EngineConfig(model=args.model, device=args.device, max_num_seqs=max(8, *batches))
    )
    rows = []
    try:
        await workload(engine, "warm-up", max(batches), args)
        # the vocabulary read for guided decoding (and the compile worker started): not a
        # constraint's cost
        await workload(engine, "warm-up", 1, args, guided_choice=["yes", "no"])
        for batch in batches:
            base = await workload(engine, "unguided", batch, args)
            rows.append(base)
            for kind, guided in constraints(batch).items():
                for temper in ("cold", "cached"):
                    row = await workload(engine, f"{kind} {temper}", batch, args, **guided)
                    rows.append(row)
            for row in rows[-7:]:
                ratio = (row["tpot_ms_median"] or 0) / (base["tpot_ms_median"] or float("inf"))
                row["tpot_vs_unguided"] = ratio
    finally:
        await engine.shutdown()
    return {
        "command": "python -m tools.bench_guided " + " ".join(argv),
        "commit": git_commit(),
        "hardware": host_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="8,64", help="batch sizes, comma separated")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = asyncio.run(main(args, argv))
    print(
        f"{'batch':>5s} {'workload':14s} {'tpot ms':>8s} {'x unguided':>10s} {'compile s':>9s} "
        f"{'tok/s':>8s} {'tokens':>7s} {'complete':>8s} {'valid':>6s}"
    )
    for r in result["rows"]:
        tpot = r["tpot_ms_median"] or 0.0
        print(
            f"{r['batch']:5d} {r['workload']:14s} {tpot:8.2f} {r['tpot_vs_unguided']:10.2f} "
            f"{r['compile_s']:9.3f} {r['output_tokens_per_s']:8.1f} {r['mean_tokens']:7.1f} "
            f"{r['complete']:8d} {r['valid']:6d}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    run()
