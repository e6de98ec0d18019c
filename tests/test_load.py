"""Load: many streaming requests at high concurrency through the real HTTP server, a fifth of
the clients disconnecting at random points (before the response, or after k chunks).

- every request that finished has its solo run's greedy text, finish reason and usage;
- a client that left got a prefix of its solo text, and its request stopped (aborts counted);
- afterwards the engine holds nothing: every state slot and KV block is free in the
  scheduler's ledger and on the rank, /health is 200, and the server serves again.

CI size: 120 requests at concurrency 24, 8 tokens each. `pytest --long`: 1,000 requests at
concurrency 64, 16 tokens each (figures written to bench/results/load_suite_long.json).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp
import pytest
from engine_helpers import reference_tokens
from serve_helpers import in_process_server, record_long_figures, wait_idle

from deltaserve.engine.config import EngineConfig
from deltaserve.http.server import ServerConfig

MODEL = "tiny-load"
QUICK = {"requests": 120, "concurrency": 24, "max_tokens": 8}
LONG = {"requests": 1000, "concurrency": 64, "max_tokens": 16}
DISCONNECT_FRACTION = 0.2
# Eight distinct prompts of different lengths (some cross a 16-token KV block, one is
# chunked across steps by the token budget below); two go through the chat endpoint.
TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Sphinx of black quartz, judge my vow. " * 3,
    "Pack my box with five dozen liquor jugs; " * 6,
    "0 1 2 3 4 5 6 7 8 9 " * 9,
    "In the beginning the Universe was created. " * 14,
]
CHATS = [
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why?"}],
]


@dataclass
class Outcome:
    kind: int  # prompt index: < len(TEXTS) completions, else chat
    cut: int | None  # disconnect after this many chunks (0: before the response); None: stay
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    disconnected: bool = False


def body(kind: int, max_tokens: int) -> tuple[str, dict]:
    common = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind < len(TEXTS):
        return "/v1/completions", {"prompt": TEXTS[kind], **common}
    return "/v1/chat/completions", {"messages": CHATS[kind - len(TEXTS)], **common}


def chunk_text(kind: int, choice: dict) -> str:
    if kind < len(TEXTS):
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def stream_one(session: aiohttp.ClientSession, url: str, o: Outcome, max_tokens: int) -> None:
    path, payload = body(o.kind, max_tokens)
    async with session.post(url + path, json=payload) as resp:
        assert resp.status == 200, await resp.text()
        chunks = 0
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            if o.cut is not None and chunks >= o.cut:
                o.disconnected = True
                resp.close()  # drop the connection mid-stream
                return
            chunks += 1
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            assert "error" not in event, event
            if event.get("usage"):
                o.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                o.text += chunk_text(o.kind, choice)
                o.finish = choice.get("finish_reason") or o.finish


async def client(session, url: str, o: Outcome, max_tokens: int, rng: random.Random) -> None:
    if o.cut == 0:  # leave before the response: cancel the request task after a moment
        task = asyncio.ensure_future(stream_one(session, url, o, max_tokens))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            o.disconnected = True
        return
    await stream_one(session, url, o, max_tokens)


async def solo(url: str, kind: int, max_tokens: int) -> Outcome:
    o = Outcome(kind, None)
    async with aiohttp.ClientSession() as session:
        await stream_one(session, url, o, max_tokens)
    return o


@pytest.fixture
def size(request: pytest.FixtureRequest) -> dict:
    return LONG if request.config.getoption("--long") else QUICK


async def test_streaming_load_with_disconnects(tiny_model_dir, size):
    n, concurrency, max_tokens = size["requests"], size["concurrency"], size["max_tokens"]
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=256,
        max_num_seqs=concurrency,
        max_num_batched_tokens=max(concurrency, 96),
        max_queued_requests=n,
    )
    async with in_process_server(config, ServerConfig(MODEL)) as server:
        engine = server.engine
        kinds = range(len(TEXTS) + len(CHATS))
        # Solo runs, one at a time through the same server; the completions ones must also
        # equal the plain single-process path.
        ref = {k: await solo(server.url, k, max_tokens) for k in kinds}
        tok = engine.tokenizer
        for k in range(len(TEXTS)):
            ids = tok.encode(TEXTS[k], add_special_tokens=False)
            plain = await asyncio.to_thread(reference_tokens, tiny_model_dir, ids, max_tokens)
            assert ref[k].text == tok.decode([s.token_id for s in plain], skip_special_tokens=True)
        for k, r in ref.items():
            assert (r.finish, r.completion_tokens) == ("length", max_tokens), (k, r)
        before = dict(engine.metrics.request_success_total)

        rng = random.Random(1234)
        outcomes = []
        for _ in range(n):
            cut = rng.randint(0, max_tokens) if rng.random() < DISCONNECT_FRACTION else None
            outcomes.append(Outcome(rng.choice(kinds), cut))
        sem = asyncio.Semaphore(concurrency)
        connector = aiohttp.TCPConnector(limit=0)

        async def limited(o: Outcome) -> None:
            async with sem:
                await client(session, server.url, o, max_tokens, rng)

        t0 = time.monotonic()
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(limited(o) for o in outcomes))
        duration = time.monotonic() - t0
        await wait_idle(engine, timeout_s=30)

        left = [o for o in outcomes if o.disconnected]
        stayed = [o for o in outcomes if not o.disconnected]
        assert len(left) >= n * DISCONNECT_FRACTION / 2, len(left)
        for o in stayed:
            assert (o.text, o.finish, o.completion_tokens) == (
                ref[o.kind].text,
                "length",
                max_tokens,
            ), o
        for o in left:
            assert ref[o.kind].text.startswith(o.text), o
        after = engine.metrics.request_success_total
        delta = {k: after[k] - before.get(k, 0) for k in after}
        aborted = delta.get("abort", 0)
        # every request the engine saw ended exactly once; those that left were aborted
        # unless they had already finished (or never reached the engine)
        assert delta.get("length", 0) + aborted == sum(delta.values()) <= n
        assert delta.get("length", 0) >= len(stayed)
        assert 0 < aborted <= len(left)
        async with aiohttp.ClientSession() as s, s.get(server.url + "/health") as r:
            assert r.status == 200
        again = await solo(server.url, 2, max_tokens)
        assert again.text == ref[2].text
        await wait_idle(engine)
    figures = {
        "requests": n,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "completed_checked_against_solo": len(stayed),
        "disconnected_clients": len(left),
        "aborted_by_engine": aborted,
        "duration_s": round(duration, 2),
        "leaked_slots": 0,
        "leaked_blocks": 0,
        "mismatches": 0,
    }
    print("load figures:", figures)
    record_long_figures(size is LONG, "streaming_load_with_disconnects", figures)
