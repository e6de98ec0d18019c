"""`deltaserve serve` as a process, and the server when the engine dies.

- a rank SIGKILLed under load, in-process: every open request ends with an error, /health
  turns 503, new requests get 503, the rank processes are gone;
- the real `deltaserve serve` at TP=2: greedy output equal to the single-process path,
  SIGTERM to the whole process group drains (a short request finishes, a long one ends with an error
  event at the deadline), the listener closes, exit code 0, no rank left;
- the real `deltaserve serve` with no --model (the demo checkpoint) and a rank SIGKILLed
  under load: open streams end with an error event, exit code non-zero, no rank left.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import aiohttp
import openai
import pytest
from engine_helpers import reference_tokens
from serve_helpers import ServeProcess, get, metric_samples, rank_pids, wait_gone

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.http.listen import start_server
from deltaserve.http.server import ServerConfig, build_app
from deltaserve.tools import demo_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


async def open_stream(client: openai.AsyncOpenAI, model: str, max_tokens: int):
    """A streaming completion whose first chunk has arrived."""
    stream = await client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = stream.__aiter__()
    first = await it.__anext__()
    return it, first.choices[0].text


async def drain(it) -> tuple[str, str | None]:
    """The rest of a stream: (text, finish_reason); raises openai.APIError on an error event."""
    text, finish = "", None
    async for chunk in it:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


async def test_rank_sigkill_in_process(tiny_model_dir):
    engine = await AsyncEngine.start(
        EngineConfig(model=str(tiny_model_dir), max_num_seqs=2, max_model_len=4096)
    )
    app = build_app(engine, ServerConfig("tiny", enable_admin_routes=True))
    runner, _ = await start_server(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        pids = rank_pids(os.getpid())
        assert len(pids) == 1
        streams = [await open_stream(client, "tiny", 3000) for _ in range(2)]
        waiting = asyncio.ensure_future(
            client.completions.create(
                model="tiny", prompt="x", max_tokens=3000, extra_body={"ignore_eos": True}
            )
        )
        await asyncio.sleep(0.2)
        os.kill(pids[0], signal.SIGKILL)
        for it, _ in streams:
            with pytest.raises(openai.APIError) as info:
                await asyncio.wait_for(drain(it), 10)
            assert info.value.body["code"] == "engine_dead", info.value.body
            assert "SIGKILL" in info.value.message
        with pytest.raises(openai.APIStatusError) as info:
            await asyncio.wait_for(waiting, 10)
        assert info.value.status_code == 503
        status, body = await get(url + "/health")
        assert status == 503 and "engine_dead" in body
        for path in (
            "/resume",
            "/continue_generation",
            "/pause",
        ):  # routes that call the engine as it is
            async with aiohttp.ClientSession() as session, session.post(url + path) as reply:
                assert (
                    reply.status == 503 and (await reply.json())["error"]["code"] == "engine_dead"
                ), path
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert info.value.status_code == 503
        _, text = await get(url + "/metrics")
        samples = metric_samples(text, "tiny")
        assert samples["deltaserve:engine_dead"] == 1
        assert samples['vllm:request_success_total{finished_reason="error"}'] == 3
        await wait_gone(pids)
    finally:
        await client.close()
        await runner.cleanup()
        await engine.shutdown()
    assert rank_pids(os.getpid()) == []


async def test_serve_tp2_greedy_then_sigterm_drains(tiny_model_dir):
    server = await ServeProcess.start(
        str(tiny_model_dir),
        "--tp",
        "2",
        "--served-model-name",
        "tiny2",  # MODEL positional, as vLLM's
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "4",
        "--shutdown-timeout",
        "10",
    )
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        pids = rank_pids(server.proc.pid)
        assert len(pids) == 2
        assert (await get(server.url + "/health"))[0] == 200

        # TP=2 greedy through HTTP == the single-process path.
        prompt_ids = await asyncio.to_thread(_tokenize, tiny_model_dir, PROMPT)
        ref = await asyncio.to_thread(reference_tokens, tiny_model_dir, prompt_ids, 8)
        r = await client.completions.create(
            model="tiny2",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.prompt_tokens == len(prompt_ids)
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(
            [s.logprob for s in ref], abs=1e-3
        )
        tok = await asyncio.to_thread(_tokenizer, tiny_model_dir)
        assert r.choices[0].text == tok.decode([s.token_id for s in ref], skip_special_tokens=True)

        short, _ = await open_stream(client, "tiny2", 12)
        long, _ = await open_stream(client, "tiny2", 4000)
        # the whole group, as systemd and `timeout` stop it
        os.killpg(server.proc.pid, signal.SIGTERM)
        short_result = asyncio.ensure_future(drain(short))
        with pytest.raises(openai.APIError) as info:
            await asyncio.wait_for(drain(long), 30)
        assert info.value.body["code"] == "aborted", info.value.body
        _, finish = await short_result
        assert finish == "length"
        with pytest.raises(openai.APIConnectionError):  # the listener is closed
            await client.completions.create(model="tiny2", prompt="x", max_tokens=2)
        assert await server.wait(30) == 0, server.log()
        await wait_gone(pids)
    finally:
        await client.close()
        await server.kill()


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _tokenize(model_dir, text: str) -> list[int]:
    return _tokenizer(model_dir).encode(text, add_special_tokens=False)


async def test_serve_demo_then_rank_sigkill_exits_nonzero(tiny_model_dir, tmp_path):
    """No --model: the first log line says the demo checkpoint is served (taken from the
    cache here; `test_demo_model_made_once` covers making it). A rank SIGKILLed under load
    ends the open streams with an error event and the process with a non-zero code."""
    home = tmp_path / "home"
    demo = home / ".cache" / "deltaserve" / demo_model.demo_name()
    shutil.copytree(tiny_model_dir, demo)
    env = dict(os.environ, HOME=str(home))
    server = await ServeProcess.start("--max-model-len", "4096", env=env)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        assert "demo checkpoint" in server.lines[0] and str(demo) in server.lines[0], server.log()
        models = await client.models.list()
        assert [m.id for m in models.data] == [demo_model.DEMO_MODEL_NAME]
        pids = rank_pids(server.proc.pid)
        assert len(pids) == 1
        streams = [await open_stream(client, demo_model.DEMO_MODEL_NAME, 3000) for _ in range(2)]
        os.kill(pids[0], signal.SIGKILL)
        for it, _ in streams:
            with pytest.raises(openai.APIError) as info:
                await asyncio.wait_for(drain(it), 15)
            assert info.value.body["code"] == "engine_dead", info.value.body
        code = await server.wait(30)
        assert code != 0, server.log()
        assert any("engine died" in line for line in server.lines), server.log()
        await wait_gone(pids)
    finally:
        await client.close()
        await server.kill()


def test_demo_model_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(Path.home() / ".cache"))  # keep the tokenizer cache
    monkeypatch.setenv("HOME", str(tmp_path))
    path, made = demo_model.ensure_demo_model()
    assert made and path == tmp_path / ".cache" / "deltaserve" / demo_model.demo_name()
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    assert demo_model.ensure_demo_model() == (path, False)


def test_model_positional_or_flag_and_twice_only_if_equal(capsys):
    """`deltaserve serve DIR` as `vllm serve DIR` (the TP=2 test above serves so); DIR and
    --model together must name the same folder, else a usage error naming both."""
    from deltaserve.http.serve import parse_args

    assert (
        parse_args(["/m"]).model
        == parse_args(["--model", "/m"]).model
        == parse_args(["/m", "--model", "/m"]).model
        == "/m"
    )
    assert parse_args([]).model is None  # the demo checkpoint
    with pytest.raises(SystemExit):
        parse_args(["/a", "--model", "/b"])
    assert "MODEL '/a' and --model '/b'" in capsys.readouterr().err
