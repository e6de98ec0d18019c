"""Serving benchmark against a running OpenAI-compatible server (ours or vLLM):
`python -m tools.bench_serve --base-url http://127.0.0.1:8000 --model NAME [...]`.

Flags carry vLLM's `vllm bench serve` names where they exist. The random dataset is
token-exact on /v1/completions: each prompt is `--random-input-len` random token ids (of the
tokenizer's regular vocabulary, no special tokens), sent as ids; on /v1/chat/completions
those ids are decoded to text, so the chat template and re-tokenization change the count (the
server's usage says how many). Requests arrive as a Poisson process at `--request-rate`
(gamma with `--burstiness` != 1; inf: all at once), at most `--max-concurrency` in flight.
One request is sent first, uncounted, to check that the arguments work.

With `--multi-turn` it runs conversations instead (tools/bench_multiturn.py).
Exit code 0 only if every request (and the multi-turn readmission probe) succeeded.
The result JSON (vLLM's field names: completed, failed, mean_ttft_ms, p99_itl_ms,
output_throughput, ...) goes to `--result-dir` with the command and the hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.tools.bench_client import (
    RequestOutput,
    compute_metrics,
    fetch_json,
    parse_goodput,
    per_request_fields,
    print_summary,
    send_request,
)
from deltaserve.tools.hardware import host_info

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _endpoint(text: str) -> str:
    for name, path in ENDPOINTS.items():
        if text in (name, path):
            return name
    raise argparse.ArgumentTypeError(
        "--endpoint must be completions, chat, "
        f"/v1/completions or /v1/chat/completions; got {text!r}"
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(",") if x.strip())
    if not values or any(not 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return values


DETAILED_FIELDS = ("itls", "generated_texts")  # stored only with --save-detailed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench_serve",
        description="Serving benchmark against a running OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, no /v1")
    p.add_argument("--model", default=None, help="served model name; default: the server's first")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder; default: the model card's `root` if it is a folder here",
    )
    p.add_argument(
        "--endpoint",
        type=_endpoint,
        default="completions",
        help="completions or chat (or their /v1/... paths)",
    )
    p.add_argument("--api-key", default=None, help="bearer key; default: $OPENAI_API_KEY")
    p.add_argument("--dataset-name", choices=("random",), default="random")
    p.add_argument("--random-input-len", type=_positive_int, default=1024)
    p.add_argument("--random-output-len", type=_positive_int, default=128)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [len*(1-r), len*(1+r)]",
    )
    p.add_argument("--num-prompts", type=_positive_int, default=1000)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s; inf: all at once"
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="1: Poisson; gamma shape otherwise"
    )
    p.add_argument("--max-concurrency", type=_positive_int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to run to max_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs in ms, KEY one of ttft, tpot, e2el; e.g. --goodput ttft:500 tpot:50",
    )
    p.add_argument("--metric-percentiles", type=_percentiles, default=(99.0,))
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    p.add_argument("--result-dir", default="bench/results")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None, help="a name for the run, stored in the JSON")
    p.add_argument(
        "--metadata",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="stored in the JSON, e.g. server_command='deltaserve serve ...' gpu=H200",
    )
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="also store each request's inter-token latencies and generated text (large)",
    )
    mt = p.add_argument_group("multi-turn (tools/bench_multiturn.py)")
    mt.add_argument(
        "--multi-turn",
        action="store_true",
        help="conversations: each turn sends the history plus the previous answer",
    )
    mt.add_argument(
        "--num-conversations", type=_positive_int, default=None, help="default: --num-prompts"
    )
    mt.add_argument("--min-turns", type=_positive_int, default=2)
    mt.add_argument("--max-turns", type=_positive_int, default=5)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 <= args.random_range_ratio < 1:
        p.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0:
        p.error(f"--request-rate must be > 0 (inf for all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        p.error(f"--burstiness must be > 0, got {args.burstiness}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.min_turns > args.max_turns:
        p.error(f"--min-turns {args.min_turns} > --max-turns {args.max_turns}")
    if args.multi_turn:  # refused, not ignored: these shape only the random run's arrivals
        if args.num_conversations is None:
            args.num_conversations = args.num_prompts
        if not math.isinf(args.request_rate) or args.burstiness != 1.0:
            p.error(
                "--request-rate/--burstiness do not apply to --multi-turn (conversations "
                "start as --max-concurrency allows)"
            )
        if args.random_range_ratio != 0.0:
            p.error("--random-range-ratio does not apply to --multi-turn")
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")
    args.metadata_dict = {}
    for item in args.metadata or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--metadata takes KEY=VALUE items, got {item!r}")
        args.metadata_dict[key] = value
    try:
        args.goodput_slos = parse_goodput(args.goodput)
    except ValueError as exc:
        p.error(str(exc))


# ---- prompts and arrivals ----------------------------------------------------------------


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def draw_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_token_prompts(
    rng: np.random.Generator, vocab: int, lengths: list[int]
) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


async def arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    """Yield 0..n-1, spaced by gamma(burstiness, 1/(rate*burstiness)) gaps (Poisson at 1)."""
    for i in range(n):
        yield i
        if math.isfinite(rate) and i < n - 1:
            await asyncio.sleep(float(rng.gamma(burstiness, 1.0 / (rate * burstiness))))


def request_body(
    args: argparse.Namespace, model: str, prompt: str | list[int], max_tokens: int
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


# ---- the run -----------------------------------------------------------------------------


async def resolve_model(
    session: aiohttp.ClientSession, args: argparse.Namespace, headers: dict[str, str]
) -> tuple[str, str | None]:
    """(served model name, tokenizer folder)."""
    cards = (await fetch_json(session, args.base_url + "/v1/models", headers))["data"]
    if not cards:
        raise RuntimeError(f"{args.base_url}/v1/models lists no model")
    card = next((c for c in cards if c["id"] == args.model), None) if args.model else cards[0]
    if card is None:
        raise RuntimeError(
            f"model {args.model!r} not served; the server has {[c['id'] for c in cards]}"
        )
    tokenizer = args.tokenizer
    root = card.get("root")
    if tokenizer is None and isinstance(root, str) and Path(root).is_dir():
        tokenizer = root
    return card["id"], tokenizer


async def run_random(session, args, model: str, tokenizer, headers) -> tuple[dict, list, dict]:
    """The run's metrics, its requests, and the engine's step counters over the run alone
    (read after the initial test request, which may pay first-use compiles)."""
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    in_lens = draw_lengths(rng, args.random_input_len, args.random_range_ratio, n)
    out_lens = draw_lengths(rng, args.random_output_len, args.random_range_ratio, n)
    ids = random_token_prompts(rng, tokenizer.vocab_size, in_lens)
    prompts = ids if args.endpoint == "completions" else [tokenizer.decode(x) for x in ids]
    url = args.base_url + ENDPOINTS[args.endpoint]

    first = await send_request(
        session, url, request_body(args, model, prompts[0], out_lens[0]), headers
    )
    if not first.success:
        raise RuntimeError(f"the initial test request failed: {first.error}")
    print(
        f"initial test request ok; starting {n} requests at rate {args.request_rate}, "
        f"max concurrency {args.max_concurrency}",
        flush=True,
    )

    async def one(i: int) -> RequestOutput:
        out = await send_request(
            session, url, request_body(args, model, prompts[i], out_lens[i]), headers
        )
        if out.success and args.endpoint == "completions" and out.prompt_len != in_lens[i]:
            out.success = False
            out.error = f"server counted {out.prompt_len} prompt tokens; {in_lens[i]} were sent"
        return out

    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def limited(i: int) -> RequestOutput:
        if sem is None:
            return await one(i)
        async with sem:
            return await one(i)

    before = await engine_counters(session, args.base_url, headers)
    t0 = time.perf_counter()
    tasks = [
        asyncio.ensure_future(limited(i))
        async for i in arrivals(n, args.request_rate, args.burstiness, rng)
    ]
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    engine = engine_overhead(before, await engine_counters(session, args.base_url, headers))
    metrics = compute_metrics(outputs, duration, args.metric_percentiles, args.goodput_slos)
    return metrics, outputs, engine


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model, tok_path = await resolve_model(session, args, headers)
        if tok_path is None:
            raise RuntimeError(
                "no tokenizer: pass --tokenizer DIR (the model card's root is "
                "not a folder on this machine)"
            )
        tokenizer = await asyncio.to_thread(load_tokenizer, tok_path)
        base = {"model_id": model, "tokenizer_id": tok_path, "endpoint_type": args.endpoint}
        if args.multi_turn:
            from deltaserve.tools.bench_multiturn import run_multi_turn

            return {**base, **await run_multi_turn(session, args, model, tokenizer, headers)}
        metrics, outputs, engine = await run_random(session, args, model, tokenizer, headers)
        print_summary("Serving Benchmark Result", metrics, args.metric_percentiles)
        for key, value in engine.items():
            print(f"{key}: {value:.4g}")
        return {**base, **metrics, **engine, **per_request_fields(outputs)}


ENGINE_COUNTERS = (
    "deltaserve:steps_total",
    "deltaserve:step_seconds_total",
    "deltaserve:scheduler_seconds_total",
    "deltaserve:pipelined_steps_total",
)


async def engine_counters(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> dict[str, float]:
    """Our server's step counters from /metrics, and when they were read (empty for a server
    without them, e.g. vLLM)."""
    read_at = time.perf_counter()
    try:
        async with session.get(base_url + "/metrics", headers=headers) as resp:
            text = await resp.text() if resp.status == 200 else ""
    except aiohttp.ClientError:
        return {}
    try:
        values = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name in ENGINE_COUNTERS
        }
    except ValueError:  # not a Prometheus exposition
        return {}
    return {**values, "read_at": read_at} if values else {}


def engine_overhead(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between the two reads (the run): steps, mean step time
    on the ranks, mean scheduler time between steps (the ranks idle), the share of the
    time the ranks were busy, and the share of steps sent while the one before ran."""
    if not before or set(before) != set(after):
        return {}
    duration = after["read_at"] - before["read_at"]
    steps, step_s, sched_s, pipelined = (after[k] - before[k] for k in ENGINE_COUNTERS)
    if steps <= 0:
        return {}
    return {
        "engine_steps": steps,
        "engine_mean_step_ms": step_s / steps * 1e3,
        "engine_mean_scheduler_ms": sched_s / steps * 1e3,
        "engine_busy_fraction": step_s / duration,
        "engine_pipelined_fraction": pipelined / steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.base_url = args.base_url.rstrip("/")
    if args.base_url.endswith("/v1"):
        args.base_url = args.base_url[:-3]
    started = datetime.now(UTC)
    hw = host_info()
    try:
        try:
            import uvloop

            result = uvloop.run(run(args))
        except ImportError:
            result = asyncio.run(run(args))
    except (RuntimeError, aiohttp.ClientError) as exc:
        print(f"bench_serve: error: {exc}", file=sys.stderr)
        return 1
    argv = sys.argv[1:] if argv is None else argv
    report = {
        "date": started.strftime("%Y%m%d-%H%M%S"),
        "command": "python -m tools.bench_serve " + shlex.join(argv),
        "hardware": hw,
        "label": args.label,
        "backend": "openai-compatible",
        "dataset_name": args.dataset_name,
        "num_prompts": None if args.multi_turn else args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "goodput_slos_ms": args.goodput_slos or None,
        "metadata": args.metadata_dict,
        **result,
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    if not args.save_detailed:  # vLLM's rule too: megabytes per run otherwise
        for key in DETAILED_FIELDS:
            report.pop(key, None)
    if not args.no_save:
        kind = "multiturn" if args.multi_turn else args.endpoint
        name = args.result_filename or (
            f"bench_serve-{kind}-{report['model_id'].replace('/', '_')}-{report['date']}.json"
        )
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out / name}")
    if report["failed"] or not report["completed"]:
        return 1
    if args.multi_turn and not report["readmission"]["ok"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
