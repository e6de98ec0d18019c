"""Sleep mode (AsyncEngine.sleep / wake_up; vLLM's /sleep, /wake_up, /is_sleeping; SGLang's
/release_memory_occupation, /resume_memory_occupation) on real rank processes: the ranks give
the memory of their weights and cache back between requests and take it again.

On the CPU the memory given back is not measured (tests/test_gpu_path.py does on CUDA); what
must hold here: a request sent while asleep waits until both the weights and the cache are
back, and is then answered as before the sleep (level 1: the weights came back from the host);
after a level-2 sleep the weights loaded next are the ones served; saved prompt states are
gone; what cannot be done asleep is refused, naming why, and the engine stays healthy.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from engine_helpers import start_placed
from serve_helpers import in_process_server, wait_idle
from test_weight_update import GREEDY, PROMPT, greedy, model_b, refs, still_waiting  # noqa: F401 (fixtures)

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import NoWeightsError
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.server import ServerConfig


@pytest.mark.asyncio
@pytest.mark.parametrize("placement", [("cpu", 1), ("cpu", 2)], ids=["tp1", "tp2"])
async def test_sleep_and_wake_up(placement, tiny_model_dir, model_b, refs):  # noqa: F811
    engine = await start_placed(
        placement, tiny_model_dir, enable_prefix_caching=True, prefix_cache_states=2
    )
    try:
        for _ in range(3):  # the third starts from the state the second saved
            ids, end = await greedy(engine)
        assert ids == refs["a"][:8] and end.cached_tokens > 0
        await engine.sleep(1)
        assert engine.is_sleeping
        waiting = asyncio.ensure_future(greedy(engine))
        assert await still_waiting(engine, waiting)
        with pytest.raises(ValueError, match="asleep already"):
            await engine.sleep(2)
        with pytest.raises(ValueError, match="weights are asleep"):
            await engine.update_weights(model_b)
        await engine.wake_up(["weights"])
        # the cache is not back yet
        assert await still_waiting(engine, waiting) and engine.is_sleeping
        await engine.wake_up(["kv_cache"])
        ids, end = await waiting
        # saved states: gone
        assert ids == refs["a"][:8] and end.cached_tokens == 0 and not engine.is_sleeping
        # level 2: the weights are dropped; nothing is served from the memory they were in
        # (awake or not) until the next ones loaded (B's), which are served
        await engine.sleep(2)
        await engine.wake_up(["weights"])
        with pytest.raises(NoWeightsError, match="level-2 sleep"):
            engine.generate(PROMPT, SamplingParams(max_tokens=2))
        await engine.update_weights(model_b)
        await engine.wake_up()
        assert (await greedy(engine))[0] == refs["b"][:8]
        await engine.wake_up()  # awake: nothing to do
        for bad in (
            lambda: engine.sleep(3),
            lambda: engine.wake_up(["kv"]),
            lambda: engine.wake_up([]),
        ):
            with pytest.raises(ValueError):
                await bad()
        # what the ranks hold is the saved prefixes, as the ledger says
        await wait_idle(engine, prefixes=True)
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_sleep_routes(tiny_model_dir, refs):  # noqa: F811
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=256, max_num_seqs=2)
    async with (
        in_process_server(config, ServerConfig("tiny", enable_sleep_mode=True)) as server,
        aiohttp.ClientSession() as session,
    ):

        async def call(method: str, path: str, body: dict | None = None) -> tuple[int, object]:
            async with session.request(method, server.url + path, json=body) as reply:
                return reply.status, (
                    await reply.json() if reply.content_type == "application/json" else None
                )

        generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, **GREEDY}}
        assert await call("POST", "/sleep?level=1") == (200, None)
        assert await call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
        waiting = asyncio.ensure_future(call("POST", "/generate", generate))
        assert await still_waiting(server.engine, waiting)
        assert await call("POST", "/wake_up?tags=weights") == (200, None)
        assert await still_waiting(server.engine, waiting)
        assert await call("POST", "/wake_up?tags=kv_cache") == (200, None)
        status, out = await waiting
        assert status == 200 and out["output_ids"] == refs["a"][:8]
        assert await call("GET", "/is_sleeping") == (200, {"is_sleeping": False})
        ok = {"success": True}
        status, body = await call("POST", "/release_memory_occupation", {})
        assert status == 200 and body.items() >= ok.items() and server.engine.is_sleeping, body
        status, body = await call(
            "POST", "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}
        )
        assert status == 200 and body.items() >= ok.items() and not server.engine.is_sleeping, body
        for path, body, param in (
            ("/sleep?level=3", None, "level"),
            ("/wake_up?tags=kv", None, "tags"),
            ("/release_memory_occupation", {"tags": ["kv_cache"]}, "tags"),
        ):
            status, answer = await call("POST", path, body)
            assert status == 400 and answer["error"]["param"] == param, (path, answer)
        status, out = await call("POST", "/generate", generate)
        assert (
            status == 200 and out["output_ids"] == refs["a"][:8] and not server.engine.is_sleeping
        )


@pytest.mark.asyncio
async def test_sleep_gives_the_gpu_memory_back(tiny_model_dir, refs):  # noqa: F811
    """On CUDA (graphs captured, prefix caching on): asleep, the device has the cache's and the
    weights' memory free again (seen from this process, as a trainer beside the engine sees
    it); awake, the graphs are captured again and the answers are the ones before."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    engine = await start_placed(
        ("cuda", 1),
        tiny_model_dir,
        num_kv_blocks=None,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=True,
    )
    try:
        before = (await greedy(engine))[0]
        free_awake, total = torch.cuda.mem_get_info()
        await engine.sleep(1)
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep - free_awake > 0.2 * total, (
            free_awake,
            free_asleep,
            total,
        )  # the cache: ~0.3 of it
        await engine.wake_up()
        assert torch.cuda.mem_get_info()[0] < free_asleep - 0.2 * total
        assert (await greedy(engine))[0] == before
    finally:
        await engine.shutdown()
