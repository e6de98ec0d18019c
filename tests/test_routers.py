"""deltaserve behind the routers people run: the real sglang-router and vllm-router binaries
(their PyPI wheels, the `test` extra) on loopback in front of two `deltaserve serve` processes
(the tiny model, prefix caching, KV-cache events).

What must hold: through either router the official openai client gets completions, chats and
streams (the routers add SGLang's request defaults, `no_stop_trim: false`, ..., which ask for
nothing and are accepted); through vllm-router (kv_aware, fed by our KV events in vLLM's format,
its render call answered) a conversation's later turn reaches the replica holding its earlier
turn (its prompt tokens come from a saved prefix); through sglang-router's cache_aware policy,
SGLang's /generate does the same; and when one replica's rank is killed that replica fails
closed (/health 503, then it exits non-zero) and the router's following requests all succeed
on the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from serve_helpers import ServeProcess, health, rank_pids

pytestmark = pytest.mark.asyncio(loop_scope="module")

BIN = Path(sys.executable).parent
ROUTERS = {name: BIN / name for name in ("vllm-router", "sglang-router")}
MODEL = "tiny-routed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, serve: ServeProcess, events: int, replay: int) -> None:
        self.serve, self.events, self.replay = serve, events, replay

    @property
    def url(self) -> str:
        return self.serve.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(tiny_model_dir) -> AsyncIterator[list[Worker]]:
    for name, path in ROUTERS.items():
        if not path.exists():
            pytest.skip(f"{name} is not installed (pip install -e '.[test]')")

    async def start() -> Worker:
        events, replay = free_port(), free_port()
        config = {  # vllm-router's static sources read the default (empty) topic
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        serve = await ServeProcess.start(
            str(tiny_model_dir),
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "4",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(config),
        )
        return Worker(serve, events, replay)

    started = await asyncio.gather(start(), start())
    yield started
    for w in started:
        await w.serve.kill()


@contextlib.asynccontextmanager
async def router(name: str, *args: str) -> AsyncIterator[str]:
    """The router binary on a free loopback port, ready once its /health answers 200."""
    port = free_port()
    log = open(os.devnull, "wb")  # noqa: SIM115 (closed below)
    proc = await asyncio.create_subprocess_exec(
        str(ROUTERS[name]),
        *(["launch"] if name == "sglang-router" else []),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        "--health-check-interval-secs",  # a replica that fails closed is seen within a second
        "1",
        "--health-failure-threshold",
        "1",
        *args,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if await health(url) == 200:
                break
            assert proc.returncode is None, f"{name} exited {proc.returncode}"
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{name} not ready")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        await proc.wait()
        log.close()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def conversation(k: int) -> str:
    """A prompt of 40-odd tokens, unlike conversation j's from its start."""
    return f"Conversation {k}: " + " ".join(f"{k * 7 + i}" for i in range(20)) + "."


async def next_turns_are_cached(first_turn, next_turn) -> None:
    """Three conversations: each second turn (`next_turn`, through the router) starts from its
    first turn's saved prompt (`first_turn(k, prompt)`), on whichever replica that went to: a
    router that picks the other one finds nothing there."""
    for k in range(3):
        first = conversation(k)
        await first_turn(k, first)
        await asyncio.sleep(0.5)  # the router hears of the saved blocks (KV events)
        cached = await next_turn(first + " And then?")
        assert cached > 0, f"conversation {k}'s second turn found no saved prefix"


async def openai_completion(url: str, prompt: str) -> int:
    async with client(url) as c:
        r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    details = r.usage.prompt_tokens_details
    return 0 if details is None else details.cached_tokens


async def sglang_generate(url: str, prompt: str) -> int:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["meta_info"]["cached_tokens"]


async def chat_and_stream(url: str) -> None:
    async with client(url) as c:
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3
        )
        assert chat.choices[0].finish_reason == "length"
        chunks = [
            ch
            async for ch in await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=3,
                stream=True,
            )
        ]
        assert chunks[-1].choices[0].finish_reason == "length"


def vllm_router_args(workers: list[Worker], model_dir: Path) -> list[str]:
    """kv_aware over our KV events; it tokenizes prompts with the checkpoint's tokenizer."""
    args = ["--worker-urls", *(w.url for w in workers), "--policy", "kv_aware"]
    for w in workers:
        args += ["--kv-event-source", f"{w.url}=tcp://127.0.0.1:{w.events}"]
        args += ["--kv-event-replay-source", f"{w.url}=tcp://127.0.0.1:{w.replay}"]
    return [*args, "--kv-event-block-size", "16", "--kv-event-model", str(model_dir)]


async def test_vllm_router_gives_completions_chats_and_streams(workers, tiny_model_dir):
    async with router("vllm-router", *vllm_router_args(workers, tiny_model_dir)) as url:
        await chat_and_stream(url)
        async with client(url) as c:
            text = await c.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
            assert text.choices[0].finish_reason == "length"
            chunks = [
                ch
                async for ch in await c.completions.create(
                    model=MODEL, prompt="Hello", max_tokens=3, stream=True
                )
            ]
            assert chunks[-1].choices[0].finish_reason == "length"


async def test_vllm_router_kv_aware_follows_our_kv_events(workers, tiny_model_dir):
    """vllm-router renders each completion on a worker first (/v1/completions/render, with
    SGLang's defaults added; a refusal would leave it placing by load alone)."""
    async with router("vllm-router", *vllm_router_args(workers, tiny_model_dir)) as url:
        # each first turn sent to a replica of our choosing, not the router's: only the KV
        # events tell the router where it is (with no saved prefix it picks by load)
        await next_turns_are_cached(
            lambda k, p: openai_completion(workers[(k + 1) % 2].url, p),
            lambda p: openai_completion(url, p),
        )


async def test_sglang_router_cache_aware_generate(workers):
    args = ["--worker-urls", *(w.url for w in workers), "--policy", "cache_aware"]
    async with router("sglang-router", *args) as url:
        await next_turns_are_cached(
            lambda k, p: sglang_generate(url, p), lambda p: sglang_generate(url, p)
        )


async def test_sglang_router_openai_routes(workers):
    async with router("sglang-router", "--worker-urls", *(w.url for w in workers)) as url:
        assert await openai_completion(url, "Hello") == 0
        await chat_and_stream(url)


async def test_a_replica_that_fails_closed_leaves_the_router_the_other(workers, tiny_model_dir):
    """Last: it kills one of the module's workers. A request running there when its rank dies
    gets its end (an error), not silence."""
    survivor, victim = workers
    async with router("vllm-router", *vllm_router_args(workers, tiny_model_dir)) as url:
        async with client(victim.url) as c:
            running = await c.completions.create(
                model=MODEL,
                prompt="Hello",
                max_tokens=480,
                stream=True,
                extra_body={"ignore_eos": True, "min_tokens": 480},
            )
            async for _ in running:  # its first token: it runs
                break
            # watched from before the kill: the failed-closed server may be gone by the time
            # the stream's error arrives
            statuses = set()
            watch = asyncio.ensure_future(_watch_health(victim.url, statuses))
            os.kill(rank_pids(victim.serve.proc.pid)[0], signal.SIGKILL)
            with pytest.raises(openai.APIError):
                await asyncio.wait_for(_drain(running), 30)
        await asyncio.wait_for(watch, 30)
        assert 503 in statuses and await victim.serve.wait(30) != 0
        await asyncio.sleep(3)  # three health intervals: the router has marked it down
        results = await asyncio.gather(*(openai_completion(url, f"Hi {i}") for i in range(6)))
        assert results == [0] * 6
        assert await health(survivor.url) == 200


async def _watch_health(url: str, statuses: set[int]) -> None:
    """`url`'s /health statuses into `statuses` until it answers no more."""
    while (status := await health(url)) is not None:
        statuses.add(status)
        await asyncio.sleep(0.01)


async def _drain(stream) -> None:
    async for chunk in stream:
        assert chunk.choices[0].finish_reason is None, "it ran to its end before the kill"


async def test_bench_routed_names_the_route_it_cannot_run(capsys):
    """tools/bench_routed.py (its runs: docs/ROUTING.md) refuses a route before it starts
    anything."""
    from deltaserve.tools.bench_routed import main

    with pytest.raises(SystemExit):
        main(["--model", "m", "--route", "nginx:round_robin"])
    assert "--route 'nginx:round_robin'" in capsys.readouterr().err
