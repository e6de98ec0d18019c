"""Multi-turn driver of `python -m tools.bench_serve --multi-turn`.

`--num-conversations` conversations of `--min-turns`..`--max-turns` turns run with at most
`--max-concurrency` conversations in flight. Each turn appends a user message of
`--random-input-len` random tokens (decoded to text) and sends the whole history with the
previous answers, so every turn's prompt is longer than the last and the server must admit
ever larger requests while others decode. A conversation stops at its first failed turn.

Then the readmission probe: once every conversation has ended, the completed ones come back
(at the same concurrency), each with its whole history plus one more user message: the
largest prompts of the run. Every one must complete, and /health must answer 200 before and
after: the capacity that finished conversations held is admitted again.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from deltaserve.tools.bench_client import (
    RequestOutput,
    compute_metrics,
    gather_limited,
    health_status,
    per_request_fields,
    print_summary,
    send_request,
)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class Conversation:
    user_messages: list[str]  # one per turn, and one more for the readmission probe
    answers: list[str] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return len(self.user_messages) - 1

    @property
    def completed(self) -> bool:
        return len(self.outputs) == self.turns and all(o.success for o in self.outputs)


def _prompt(endpoint: str, users: list[str], answers: list[str]) -> Any:
    """The history so far: chat messages, or one transcript string for /v1/completions."""
    if endpoint == "chat":
        messages = []
        for i, text in enumerate(users):
            messages.append({"role": "user", "content": text})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        return messages
    parts = []
    for i, text in enumerate(users):
        parts.append(f"User: {text}\nAssistant:")
        if i < len(answers):
            parts.append(f" {answers[i]}\n")
    return "".join(parts)


def _body(args: argparse.Namespace, model: str, prompt: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.random_output_len,
        "temperature": args.temperature,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    body["messages" if args.endpoint == "chat" else "prompt"] = prompt
    return body


async def run_multi_turn(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    model: str,
    tokenizer: Any,
    headers: dict[str, str],
) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    n = args.num_conversations
    url = args.base_url + ENDPOINTS[args.endpoint]
    vocab = tokenizer.vocab_size

    def user_text() -> str:
        ids = rng.integers(0, vocab, size=args.random_input_len)
        return tokenizer.decode([int(t) for t in ids])

    convs = []
    for turns in rng.integers(args.min_turns, args.max_turns + 1, size=n):
        convs.append(Conversation([user_text() for _ in range(int(turns) + 1)]))
    print(
        f"multi-turn: {n} conversations, {sum(c.turns for c in convs)} turns, "
        f"max concurrency {args.max_concurrency}",
        flush=True,
    )

    async def converse(c: Conversation) -> None:
        for t in range(c.turns):
            prompt = _prompt(args.endpoint, c.user_messages[: t + 1], c.answers)
            out = await send_request(session, url, _body(args, model, prompt), headers)
            c.outputs.append(out)
            if not out.success:
                return
            c.answers.append(out.generated_text)

    t0 = time.perf_counter()
    await gather_limited([converse(c) for c in convs], args.max_concurrency)
    duration = time.perf_counter() - t0
    turns = [o for c in convs for o in c.outputs]
    metrics = compute_metrics(turns, duration, args.metric_percentiles, args.goodput_slos)
    print_summary("Multi-turn Benchmark Result (per turn)", metrics, args.metric_percentiles)

    probe = await readmission_probe(session, args, model, url, headers, convs)
    done = sum(c.completed for c in convs)
    print(
        f"conversations completed {done}/{n}; turns completed {metrics['completed']} of "
        f"{sum(c.turns for c in convs)} planned; readmission probe "
        f"{'ok' if probe['ok'] else 'FAILED'} ({probe['completed']}/{probe['requests']})"
    )
    return {
        "num_conversations": n,
        "min_turns": args.min_turns,
        "max_turns": args.max_turns,
        "conversations_completed": done,
        "conversations_failed": n - done,
        "turns_planned": sum(c.turns for c in convs),
        "turns_completed": metrics["completed"],
        "turns_failed": metrics["failed"],
        "turns_per_conversation": [c.turns for c in convs],
        **metrics,
        "readmission": probe,
        **per_request_fields(turns),
    }


async def readmission_probe(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    model: str,
    url: str,
    headers: dict[str, str],
    convs: list[Conversation],
) -> dict[str, Any]:
    """Every completed conversation once more, with its whole history."""
    back = [c for c in convs if c.completed]
    health_before = await health_status(session, args.base_url)
    t0 = time.perf_counter()
    outputs = await gather_limited(
        [
            send_request(
                session,
                url,
                _body(args, model, _prompt(args.endpoint, c.user_messages, c.answers)),
                headers,
            )
            for c in back
        ],
        args.max_concurrency,
    )
    duration = time.perf_counter() - t0
    health_after = await health_status(session, args.base_url)
    ok_count = sum(o.success for o in outputs)
    return {
        "ok": bool(back) and ok_count == len(back) and health_before == health_after == 200,
        "requests": len(back),
        "completed": ok_count,
        "failed": len(back) - ok_count,
        "health_before": health_before,
        "health_after": health_after,
        "duration": duration,
        "input_lens": [o.prompt_len for o in outputs],
        "max_ttft_ms": max((o.ttft for o in outputs if o.success), default=0.0) * 1000,
        "max_e2el_ms": max((o.latency for o in outputs if o.success), default=0.0) * 1000,
        "errors": [o.error for o in outputs if not o.success],
    }
