"""One streamed benchmark request over HTTP (aiohttp, SSE), and vLLM-style metrics over many.

Timing follows vLLM's serving benchmark (vllm/benchmarks/lib/endpoint_request_func.py and
vllm/benchmarks/serve.py; written anew here): TTFT is the time to the first chunk that
carries text, ITL the gaps between later chunks that carry text, TPOT is
(E2EL - TTFT) / (output tokens - 1), E2EL the whole request as the client saw it. Token
counts come from the server's usage chunk (`stream_options.include_usage`), never from
re-tokenizing text, so they are exact.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestOutput:
    """What the client saw of one request. `success` needs a finish reason, the usage
    chunk and `[DONE]`; anything else (an HTTP error, an error event, a cut connection)
    leaves `error` saying what happened."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    generated_text: str = ""
    finish_reason: str | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    cached_len: int = 0  # prompt tokens the server took from its prefix cache, where its usage says


def _error_message(text: str) -> str:
    try:
        err = json.loads(text)["error"]
        return f"{err.get('code') or err.get('type')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        return text[:300]


async def send_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> RequestOutput:
    """POST one streaming completion or chat request (`body` without the stream fields)
    and time its chunks."""
    chat = url.rstrip("/").endswith("chat/completions")
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = RequestOutput(start_time=time.perf_counter())
    last = out.start_time
    pieces: list[str] = []
    done = got_usage = False
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status} {_error_message(await resp.text())}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    out.error = "error event " + _error_message(json.dumps(data))
                    return out
                usage = data.get("usage")
                if usage:
                    out.prompt_len = usage["prompt_tokens"]
                    out.output_len = usage["completion_tokens"]
                    out.cached_len = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
                    got_usage = True
                for choice in data.get("choices") or ():
                    text = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    if text:
                        now = time.perf_counter()
                        if not pieces:
                            out.ttft = now - out.start_time
                        else:
                            out.itl.append(now - last)
                        last = now
                        pieces.append(text)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - out.start_time
    out.generated_text = "".join(pieces)
    if not pieces:  # no text at all (e.g. only an EOS token): first token = the end
        out.ttft = out.latency
    if not (done and got_usage and out.finish_reason):
        out.error = (
            f"stream ended early (done={done}, usage={got_usage}, "
            f"finish_reason={out.finish_reason})"
        )
        return out
    out.success = True
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` (milliseconds, vLLM's --goodput syntax) -> {"ttft": 500.0, ...}."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(
                f"--goodput takes KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_KEYS)}; "
                f"got {item!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}: {value!r} is not a number of ms") from None
        if not ms >= 0:
            raise ValueError(f"--goodput {key} must be >= 0 ms, got {value}")
        slos[key] = ms
    return slos


def _tpot(o: RequestOutput) -> float | None:
    return (o.latency - o.ttft) / (o.output_len - 1) if o.output_len > 1 else None


def _peak_concurrency(outputs: list[RequestOutput]) -> int:
    events = sorted(
        [(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs]
    )
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def compute_metrics(
    outputs: list[RequestOutput],
    duration_s: float,
    percentiles: tuple[float, ...] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """vLLM's result fields: counts, throughputs, and mean/median/std/pXX of every metric in
    ms (a metric with no sample reports 0, as vLLM does)."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": [t for o in ok if (t := _tpot(o)) is not None],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    good = len(ok)
    if goodput:
        good = 0
        for o in ok:
            seen = {"ttft": o.ttft, "tpot": _tpot(o) or 0.0, "e2el": o.latency}
            good += all(seen[k] * 1000 <= slo for k, slo in goodput.items())
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        # 0 unless the usage has details
        "total_cached_input_tokens": sum(o.cached_len for o in ok),
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_concurrent_requests": _peak_concurrency(ok),
    }
    for name in METRICS:
        values = np.asarray(series[name] or [0.0]) * 1000
        result[f"mean_{name}_ms"] = float(values.mean())
        result[f"median_{name}_ms"] = float(np.median(values))
        result[f"std_{name}_ms"] = float(values.std())
        for p in percentiles:
            result[f"p{p:g}_{name}_ms"] = float(np.percentile(values, p))
    return result


def per_request_fields(outputs: list[RequestOutput]) -> dict[str, list]:
    """The per-request lists of vLLM's result JSON."""
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_len if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }


def print_summary(title: str, m: dict[str, Any], percentiles: tuple[float, ...]) -> None:
    print(f"{' ' + title + ' ':=^60}")
    rows = [
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Benchmark duration (s):", f"{m['duration']:.2f}"),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Cached input tokens (usage details):", m["total_cached_input_tokens"]),
        ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
    ]
    if m["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{m['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
        ("Peak concurrent requests:", m["max_concurrent_requests"]),
    ]
    for label, value in rows:
        print(f"{label:<44}{value}")
    for name in METRICS:
        print(f"{' ' + name.upper() + ' (ms) ':-^60}")
        print(f"{'Mean / Median:':<44}{m[f'mean_{name}_ms']:.2f} / {m[f'median_{name}_ms']:.2f}")
        for p in percentiles:
            print(f"{f'P{p:g}:':<44}{m[f'p{p:g}_{name}_ms']:.2f}")
    print("=" * 60)


async def fetch_json(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> dict[str, Any]:
    async with session.get(url, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: HTTP {resp.status} {_error_message(await resp.text())}")
        return await resp.json(content_type=None)  # sglang-router's /v1/models says text/plain


async def health_status(session: aiohttp.ClientSession, base_url: str) -> int | None:
    try:
        async with session.get(base_url + "/health") as resp:
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        return None


async def gather_limited(coros: list, limit: int | None) -> list:
    """Run coroutines with at most `limit` at once (None: all at once), results in order."""
    if limit is None:
        return await asyncio.gather(*coros)
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))
