"""New weights while serving (an RL loop's update: AsyncEngine.update_weights, SGLang's
/update_weights_from_disk), on real rank processes at TP 1 and 2.

The reference is the plain path (`reference_tokens`, one process, no control plane) on each
checkpoint: before the update the engine answers as checkpoint A does, after it as B does (a
second seed, in the released layout: other names, two shards), and the two differ. A request
running when the update is asked for finishes on A; one that arrives meanwhile waits and runs
on B; a prompt state saved under A is never reused under B. A folder that is not the served
model's is refused before any rank copies a tensor, and the engine goes on serving A.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import pytest
from engine_helpers import (
    PLACEMENTS,
    assert_idle_and_empty,
    collect,
    ids_of,
    reference_tokens,
    start_placed,
)
from safetensors.torch import load_file, save_file
from serve_helpers import in_process_server

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import EngineDeadError, ErrorEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.server import ServerConfig
from deltaserve.tools.make_model import make_model

PROMPT = [
    9707,
    11,
    1879,
    0,
    358,
    1079,
    264,
    1273,
    2701,
    3331,
    17,
    88,
    1024,
    45,
    77,
    5,
    300,
    12,
]  # > one block
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp("tiny_b"),
        preset="tiny",
        dtype="fp32",
        seed=1,
        vlm_names=True,
        shard_size="20MB",
    )


@pytest.fixture(scope="module")
def refs(tiny_model_dir, model_b):
    """Each checkpoint's greedy tokens after PROMPT, on the plain path."""
    out = {
        name: [s.token_id for s in reference_tokens(path, PROMPT, 40)]
        for name, path in (("a", tiny_model_dir), ("b", model_b))
    }
    assert out["a"][:8] != out["b"][:8]  # else the test could not tell them apart
    return out


async def greedy(
    engine, max_tokens: int = 8, prompt: list[int] = PROMPT
) -> tuple[list[int], object]:
    tokens, end = await collect(
        engine.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    )
    return ids_of(tokens), end


@pytest.mark.asyncio
@pytest.mark.parametrize("placement", PLACEMENTS["params"][:2], ids=PLACEMENTS["ids"][:2])
async def test_update_between_requests(placement, tiny_model_dir, model_b, refs):
    engine = await start_placed(
        placement, tiny_model_dir, enable_prefix_caching=True, prefix_cache_states=2
    )
    try:
        for _ in range(2):  # seen, then its state saved (a prompt seen twice): reused by the third
            assert (await greedy(engine))[0] == refs["a"][:8]
        ids, end = await greedy(engine)
        assert ids == refs["a"][:8] and end.cached_tokens > 0
        running = engine.generate(PROMPT, SamplingParams(max_tokens=30, **GREEDY))
        first = await anext(running)
        update = asyncio.ensure_future(engine.update_weights(model_b))
        while not engine.scheduler.maintenance.pending:
            await asyncio.sleep(0.005)
        waiting = asyncio.ensure_future(greedy(engine))  # arrives during the update: waits for it
        rest, end = await collect(running)
        assert [first.token_id, *ids_of(rest)] == refs["a"][:30] and end.reason == "length"
        await update
        ids, end = await waiting
        assert ids == refs["b"][:8] and end.cached_tokens == 0  # A's saved state is gone
        assert engine.weights_dir == str(model_b)
        # aborting what runs: it ends at once, and the update goes on (back to A)
        running = engine.generate(PROMPT, SamplingParams(max_tokens=200, **GREEDY))
        await anext(running)
        await engine.update_weights(tiny_model_dir, abort_running=True)
        _, end = await collect(running)
        assert end.reason == "abort" and end.output_tokens < 200
        assert (await greedy(engine))[0] == refs["a"][:8]
        # a flush frees the saved states' blocks at once; the ranks, with the next step
        assert engine.load().free_blocks < engine.load().num_blocks
        await engine.flush_cache()
        assert engine.load().free_blocks == engine.load().num_blocks
        await greedy(engine, prompt=PROMPT[:4])
        await assert_idle_and_empty(engine)
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_refused_folders_change_nothing(tiny_model_dir, refs, tmp_path):
    other = tmp_path / "other"  # another model: its config differs
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(config))
    short = tmp_path / "short"  # the same config, a tensor missing and one reshaped
    shutil.copytree(tiny_model_dir, short)
    tensors = load_file(short / "model.safetensors")
    names = sorted(tensors)
    del tensors[names[0]]
    tensors[names[1]] = tensors[names[1]].flatten()[:-1].clone()
    save_file(tensors, short / "model.safetensors")
    engine = await start_placed(("cpu", 1), tiny_model_dir)
    try:
        for folder, words in (
            (other, "differs in rms_norm_eps"),
            (short, f"{names[0]} missing"),
            (short, f"{names[1]} of shape"),
            (tmp_path / "absent", "config.json"),
        ):
            with pytest.raises(ValueError, match=words):
                await engine.update_weights(folder)
        assert (await greedy(engine))[0] == refs["a"][:8] and not engine.is_dead
        assert engine.weights_dir == str(tiny_model_dir)
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_sglang_routes(tiny_model_dir, model_b, refs, tmp_path):
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=256,
        max_num_seqs=2,
        enable_prefix_caching=True,
        prefix_cache_states=2,
    )
    async with (
        in_process_server(config, ServerConfig("tiny", enable_admin_routes=True)) as server,
        aiohttp.ClientSession() as session,
    ):

        async def post(path: str, body: dict | None = None) -> tuple[int, object]:
            async with session.post(server.url + path, json=body) as reply:
                return reply.status, await (
                    reply.json() if reply.content_type == "application/json" else reply.text()
                )

        generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, **GREEDY}}
        status, out = await post("/generate", generate)
        assert (
            out["output_ids"] == refs["a"][:8] and out["meta_info"]["weight_version"] == "default"
        )
        status, answer = await post(
            "/update_weights_from_disk",
            {"model_path": str(model_b), "weight_version": "step-1", "load_format": "auto"},
        )
        assert (status, answer["success"]) == (200, True), answer
        status, out = await post("/generate", generate)
        assert out["output_ids"] == refs["b"][:8] and out["meta_info"]["weight_version"] == "step-1"
        async with session.get(server.url + "/get_model_info") as reply:
            info = await reply.json()
        assert (info["model_path"], info["weight_version"]) == (str(model_b), "step-1")
        status, answer = await post("/update_weights_from_disk", {"model_path": str(tmp_path)})
        assert (
            status == 400 and answer["success"] is False and "config.json" in answer["message"]
        ), answer
        status, answer = await post(
            "/update_weights_from_disk", {"model_path": str(model_b), "flush_cache": False}
        )
        assert status == 400 and answer["error"]["param"] == "flush_cache", answer
        assert await post("/flush_cache") == (200, "Cache flushed.\n")
        status, out = await post("/generate", generate)
        assert out["output_ids"] == refs["b"][:8] and out["meta_info"]["cached_tokens"] == 0


@pytest.mark.asyncio
async def test_a_rank_that_fails_to_load_fails_closed(tiny_model_dir, model_b, tmp_path):
    """The folder checked, then its files gone before the ranks load (the update waited for a
    running request): a rank fails half-way, so the engine fails closed, as on any rank
    failure: the update and every request end with one error, and the engine says why."""
    folder = tmp_path / "b"
    shutil.copytree(model_b, folder)
    engine = await start_placed(("cpu", 2), tiny_model_dir)
    try:
        running = engine.generate(PROMPT, SamplingParams(max_tokens=30, **GREEDY))
        await anext(running)
        update = asyncio.ensure_future(engine.update_weights(folder))
        while not engine.scheduler.maintenance.pending:
            await asyncio.sleep(0.005)
        waiting = engine.generate(PROMPT, SamplingParams(max_tokens=4, **GREEDY))
        for shard in folder.glob("*.safetensors"):
            shard.unlink()
        _, end = await collect(running)
        assert end.reason == "length"  # it finished on the old weights
        with pytest.raises(EngineDeadError, match="load_weights failed"):
            await update
        events = [e async for e in waiting]
        assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
        assert engine.is_dead and "safetensors" in engine.dead_reason
    finally:
        await engine.shutdown()


async def still_waiting(engine, task: asyncio.Future, seconds: float = 0.3) -> bool:
    await asyncio.sleep(seconds)
    return not task.done() and engine.load().waiting == 1


@pytest.mark.asyncio
async def test_pause_modes_and_an_update_beside_frozen_requests(tiny_model_dir, model_b, refs):
    """vLLM's pause modes: "wait" lets the running request finish, "abort" ends it; either way a
    request that arrives waits until resume. "keep" freezes a running request (no token
    while paused), an update runs beside it, and it goes on after resume."""
    engine = await start_placed(("cpu", 1), tiny_model_dir)
    try:
        for mode in ("wait", "abort"):
            running = engine.generate(PROMPT, SamplingParams(max_tokens=40, **GREEDY))
            await anext(running)
            await engine.pause(mode)
            _, end = await collect(running)  # ended before pause returned
            assert end.reason == ("length" if mode == "wait" else "abort") and engine.is_paused
            waiting = asyncio.ensure_future(greedy(engine))
            assert await still_waiting(engine, waiting)
            engine.resume()
            assert (await waiting)[0] == refs["a"][:8] and not engine.is_paused
        events = []  # a consumer reading all along (one cancelled mid-read would abort the request)

        async def consume(stream) -> None:
            async for event in stream:
                events.append(event)

        consumer = asyncio.ensure_future(
            consume(engine.generate(PROMPT, SamplingParams(max_tokens=40, **GREEDY)))
        )
        while len(events) < 5:
            await asyncio.sleep(0.005)
        at_pause = len(events)  # more than 5 on a busy machine: the loop noticed late
        await engine.pause("keep")
        # the tokens of the steps in flight (two, pipelined), if any, have come
        await asyncio.sleep(0.1)
        frozen_at = len(events)
        await asyncio.sleep(0.4)
        # nothing while paused
        assert len(events) == frozen_at <= at_pause + 2 and not consumer.done()
        assert ids_of(events) == refs["a"][:frozen_at]
        await engine.update_weights(model_b)  # beside the frozen request
        assert len(events) == frozen_at
        engine.resume()
        await consumer
        assert events[-1].reason == "length" and len(events) == 41
        # it went on with B's weights
        assert ids_of(events[:-1])[frozen_at:] != refs["a"][frozen_at:40]
        assert (await greedy(engine))[0] == refs["b"][:8]
        with pytest.raises(ValueError, match="pause mode"):
            await engine.pause("retract")
        await assert_idle_and_empty(engine)
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_pause_routes(tiny_model_dir):
    """vLLM's /pause, /resume, /is_paused and SGLang's /pause_generation, /continue_generation:
    a request sent while paused waits for the resume; bad modes are refused, naming them."""
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=256, max_num_seqs=2)
    async with (
        in_process_server(config, ServerConfig("tiny", enable_admin_routes=True)) as server,
        aiohttp.ClientSession() as session,
    ):

        async def call(method: str, path: str, body: dict | None = None) -> tuple[int, object]:
            async with session.request(method, server.url + path, json=body) as reply:
                return reply.status, await reply.json()

        generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **GREEDY}}
        for pause, resume, answers in (
            ("/pause?mode=wait", "/resume", ({"status": "paused"}, {"status": "resumed"})),
            (
                "/pause_generation",
                "/continue_generation",
                (
                    {"message": "Generation paused successfully.", "status": "ok"},
                    {"message": "Generation continued successfully.", "status": "ok"},
                ),
            ),
        ):
            assert await call("POST", pause, {} if "generation" in pause else None) == (
                200,
                answers[0],
            )
            assert await call("GET", "/is_paused") == (200, {"is_paused": True})
            waiting = asyncio.ensure_future(call("POST", "/generate", generate))
            assert await still_waiting(server.engine, waiting)
            assert await call("POST", resume) == (200, answers[1])
            status, out = await waiting
            assert status == 200 and len(out["output_ids"]) == 4
            assert await call("GET", "/is_paused") == (200, {"is_paused": False})
        status, answer = await call("POST", "/pause?mode=later")
        assert status == 400 and answer["error"]["param"] == "mode", answer
        status, answer = await call("POST", "/pause_generation", {"mode": "retract"})
        assert (
            status == 400 and answer["error"]["param"] == "mode" and not server.engine.is_paused
        ), answer
