"""Large inputs are tokenized off the event loop: while the server tokenizes a prompt of
megabytes (seconds of work), /health still answers at once.

Also the tokenizer worker on its own: results and errors come back to the caller, a job
whose caller left before it started is skipped, jobs run in order on one thread.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import aiohttp
import pytest
import pytest_asyncio
from serve_helpers import in_process_server

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import EngineDeadError
from deltaserve.engine.tokenizer import INLINE_TOKENIZE_CHARS, TokenizerWorker, load_tokenizer
from deltaserve.http.server import ServerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-tokenize"
MAX_MODEL_LEN = 256
HEALTH_LIMIT_S = 0.5
WORDS = [
    "hello",
    "world",
    "quick",
    "brown",
    "fox",
    "jumps",
    "lazy",
    "dog",
    "Ünïcödé",
    "数据",
    "1234",
]


def big_text(num_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < num_bytes:
        w = rng.choice(WORDS)
        parts.append(w)
        size += len(w.encode()) + 1
    return " ".join(parts)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    async with in_process_server(config, ServerConfig(MODEL, max_request_bytes=8 * 2**20)) as s:
        yield s


async def post_watching_health(
    url: str, path: str, body: dict
) -> tuple[int, dict, list[float], float]:
    """POST `body`; meanwhile time /health over and over. Returns the POST's status and JSON,
    every /health latency, and how long the POST took."""
    latencies = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def big() -> tuple[int, dict]:
            async with s.post(url + path, json=body) as r:
                return r.status, await r.json()

        t0 = time.monotonic()
        task = asyncio.ensure_future(big())
        while not task.done():
            t = time.monotonic()
            async with s.get(url + "/health") as r:
                assert r.status == 200
            latencies.append(time.monotonic() - t)
            await asyncio.sleep(0.02)
        status, answer = await task
    return status, answer, latencies, time.monotonic() - t0


async def test_health_answers_while_a_large_prompt_is_tokenized(server):
    """~2 MiB of text (about 2 s of tokenizing on a small CPU, and the worker's tokenizer is
    loaded first): the completion is refused as too long only after it was tokenized in
    full, and /health answered within 0.5 s all along. Then the same through the chat
    template with 0.5 MiB."""
    text = big_text(2 * 2**20, seed=1)
    status, answer, latencies, took = await post_watching_health(
        server.url, "/v1/completions", {"prompt": text, "max_tokens": 1}
    )
    assert status == 400 and "max_model_len" in answer["error"]["message"], answer
    assert max(latencies) < HEALTH_LIMIT_S, (max(latencies), took)
    assert took > 0.5 and len(latencies) >= 5, (took, latencies)  # the window was watched
    print(
        f"completion: {took:.2f} s, {len(latencies)} /health calls, "
        f"slowest {max(latencies) * 1e3:.0f} ms"
    )

    text = big_text(2**19, seed=2)
    messages = [{"role": "user", "content": text}]
    status, answer, latencies, took = await post_watching_health(
        server.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}
    )
    assert status == 400 and "max_model_len" in answer["error"]["message"], answer
    assert len(latencies) >= 2 and max(latencies) < HEALTH_LIMIT_S, (max(latencies), took)
    print(
        f"chat: {took:.2f} s, {len(latencies)} /health calls, slowest {max(latencies) * 1e3:.0f} ms"
    )


async def test_encode_matches_the_tokenizer_inline_and_in_the_worker(server):
    tok = server.engine.tokenizer
    small = "Sphinx of black quartz, judge my vow."
    large = big_text(4 * INLINE_TOKENIZE_CHARS, seed=3)
    assert len(large) > INLINE_TOKENIZE_CHARS >= len(small)
    for text in (small, large):
        assert await server.engine.encode(text) == tok.encode(text, add_special_tokens=False)


async def test_no_tokenizing_once_shutting_down(server, monkeypatch):
    """A handler that passed the admission check when shutdown began gets EngineDeadError
    (HTTP 503), not the closed worker's error."""
    monkeypatch.setattr(server.engine, "_shutting_down", True)
    for text in ("short", big_text(2 * INLINE_TOKENIZE_CHARS, seed=4)):
        with pytest.raises(EngineDeadError, match="shut down"):
            await server.engine.encode(text)


# ---- the worker alone ----------------------------------------------------------------------


async def test_worker_results_errors_order_and_one_thread():
    made = []

    def factory() -> str:
        made.append(threading.current_thread().name)
        return "TOK"

    worker = TokenizerWorker(factory)
    try:
        threads = set()

        def job(i: int):
            def fn(tok: str) -> tuple[str, int]:
                threads.add(threading.current_thread().name)
                return tok, i

            return fn

        results = await asyncio.gather(*(worker.run(job(i)) for i in range(20)))
        assert results == [("TOK", i) for i in range(20)]
        assert made == ["deltaserve-tokenizer"] and threads == {"deltaserve-tokenizer"}

        def fails(tok: str) -> None:
            raise ValueError("no good")

        with pytest.raises(ValueError, match="no good"):
            await worker.run(fails)
        assert await worker.run(lambda tok: tok.lower()) == "tok"  # still serving
    finally:
        worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        await worker.run(lambda tok: tok)


async def test_worker_makes_its_tokenizer_once_at_start():
    """The engine starts the worker at start-up, which loads the one tokenizer while the ranks
    start; the engine takes it from there, and the first large prompt waits for nothing."""
    made = threading.Event()
    calls = []

    def factory() -> str:
        calls.append(threading.current_thread().name)
        made.set()
        return "TOK"

    worker = TokenizerWorker(factory)
    try:
        worker.start()
        worker.start()
        assert made.wait(10), "start() made no tokenizer before any job"
        assert await worker.tokenizer() == "TOK"
        assert await worker.run(lambda tok: tok) == "TOK"
        assert calls == ["deltaserve-tokenizer"], "made once, in the worker's thread"
    finally:
        worker.close()


async def test_tokenizer_waits_for_the_load_and_raises_its_error():
    slow = threading.Event()
    worker = TokenizerWorker(lambda: slow.wait(10) and "TOK")
    try:
        waiting = asyncio.ensure_future(worker.tokenizer())
        await asyncio.sleep(0.2)
        assert not waiting.done(), "returned before the tokenizer was made"
        slow.set()
        assert await asyncio.wait_for(waiting, 10) == "TOK"
    finally:
        worker.close()

    def broken() -> str:
        raise OSError("no tokenizer.json")

    worker = TokenizerWorker(broken)
    try:
        with pytest.raises(OSError, match="no tokenizer.json"):
            await worker.tokenizer()
        with pytest.raises(OSError, match="no tokenizer.json"):
            await worker.run(lambda tok: tok)
    finally:
        worker.close()


async def test_worker_and_loop_share_one_tokenizer(tiny_model_dir):
    """Large chat prompts tokenized in the worker while the loop decodes and encodes small
    texts, on one instance: nothing raises (no "Already borrowed") and the ids are those of
    each call alone."""
    tok = load_tokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": big_text(200_000, seed=7)}]

    def render(t) -> list[int]:
        text = t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return t.encode(text, add_special_tokens=False)

    alone = render(tok)
    small = tok.encode("hello world", add_special_tokens=False)
    worker = TokenizerWorker(lambda: tok)
    try:
        jobs = asyncio.gather(*(worker.run(render) for _ in range(2)))
        loop_calls = 0
        while not jobs.done():
            for token_id in alone[loop_calls % 500 : loop_calls % 500 + 20]:
                tok.decode([token_id], skip_special_tokens=True)
                tok.convert_ids_to_tokens(token_id)
            assert tok.encode("hello world", add_special_tokens=False) == small
            loop_calls += 1
            await asyncio.sleep(0)
        assert await jobs == [alone] * 2
        assert loop_calls > 0
    finally:
        worker.close()


async def test_worker_skips_a_job_whose_caller_left():
    gate = threading.Event()
    ran = []
    worker = TokenizerWorker(lambda: None)
    try:
        first = asyncio.ensure_future(worker.run(lambda tok: gate.wait(10)))
        second = asyncio.ensure_future(worker.run(lambda tok: ran.append("second")))
        await asyncio.sleep(0.05)  # the first is running, the second queued
        second.cancel()
        await asyncio.sleep(0)
        gate.set()
        assert await first is True
        assert await worker.run(lambda tok: "third") == "third"
        assert ran == []
    finally:
        worker.close()
