"""`deltaserve serve` as a process, and the server when the engine dies.

- a rank SIGKILLed under load, in-process: every open request ends with an error, /health
  turns 503, new requests get 503, the rank processes are gone;
- the real `deltaserve serve` at TP=2: greedy output equal to the single-process path,
  SIGTERM drains (a short request finishes, a long one ends with an error event at the
  deadline), the listener closes, exit code 0, no rank left;
- the real `deltaserve serve` with no --model (the demo checkpoint) and a rank SIGKILLed
  under load: open streams end with an error event, exit code non-zero, no rank left.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

import deltaserve
from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.generate import generate_tokens
from deltaserve.http import serve
from deltaserve.http.server import ServerConfig, build_app, start_server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
DELTASERVE = str(Path(sys.executable).with_name("deltaserve"))


def rank_pids(parent_pid: int) -> list[int]:
    """Live rank processes (`python -m deltaserve.ipc.rank_main`) whose parent is
    `parent_pid`, from /proc (the engine exposes no public accessor for them)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == parent_pid and state != "Z" and b"deltaserve.ipc.rank_main" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


async def wait_gone(pids: list[int], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, (
            f"rank processes still alive: {[p for p in pids if alive(p)]}"
        )
        await asyncio.sleep(0.05)


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.text()


async def open_stream(client: openai.AsyncOpenAI, model: str, max_tokens: int):
    """A streaming completion whose first chunk has arrived."""
    stream = await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
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
    app = build_app(engine, ServerConfig("tiny"))
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
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert info.value.status_code == 503
        _, text = await get(url + "/metrics")
        assert 'deltaserve:engine_dead{model_name="tiny"} 1' in text
        assert 'vllm:request_success_total{model_name="tiny",finished_reason="error"} 3' in text
        await wait_gone(pids)
    finally:
        await client.close()
        await runner.cleanup()
        await engine.shutdown()
    assert rank_pids(os.getpid()) == []


class ServeProcess:
    """`deltaserve serve ...` with stderr collected; `url` once it logged its ready line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            m = re.search(r"ready: serving .* at (http://[\d.]+:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    @classmethod
    async def start(
        cls, *args: str, env: dict | None = None, timeout_s: float = 180
    ) -> ServeProcess:
        proc = await asyncio.create_subprocess_exec(
            DELTASERVE, "serve", "--port", "0", *args,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        self = cls(proc)
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        finally:
            if self.url is None:
                await self.kill()
        assert self.url is not None, "server did not become ready:\n" + self.log()
        return self

    def log(self) -> str:
        return "\n".join(self.lines[-40:])

    async def wait(self, timeout_s: float) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        await self._reader
        return code

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def test_serve_tp2_greedy_then_sigterm_drains(tiny_model_dir):
    server = await ServeProcess.start(
        "--model", str(tiny_model_dir), "--tp", "2", "--served-model-name", "tiny2",
        "--max-model-len", "4096", "--max-num-seqs", "4", "--shutdown-timeout", "10",
    )  # fmt: skip
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        pids = rank_pids(server.proc.pid)
        assert len(pids) == 2
        assert (await get(server.url + "/health"))[0] == 200

        # TP=2 greedy through HTTP == the single-process path.
        prompt_ids = await asyncio.to_thread(_tokenize, tiny_model_dir, PROMPT)
        ref = await asyncio.to_thread(
            generate_tokens, tiny_model_dir, prompt_ids, 8, ignore_eos=True
        )
        r = await client.completions.create(
            model="tiny2", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.usage.prompt_tokens == len(prompt_ids)
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(
            [s.logprob for s in ref], abs=1e-3
        )
        tok = await asyncio.to_thread(_tokenizer, tiny_model_dir)
        assert r.choices[0].text == tok.decode([s.token_id for s in ref], skip_special_tokens=True)

        short, _ = await open_stream(client, "tiny2", 12)
        long, _ = await open_stream(client, "tiny2", 4000)
        server.proc.send_signal(signal.SIGTERM)
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
    demo = home / ".cache" / "deltaserve" / f"demo-{deltaserve.__version__}"
    shutil.copytree(tiny_model_dir, demo)
    env = dict(os.environ, HOME=str(home))
    server = await ServeProcess.start("--max-model-len", "4096", env=env)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        assert "demo checkpoint" in server.lines[0] and str(demo) in server.lines[0], server.log()
        models = await client.models.list()
        assert [m.id for m in models.data] == [serve.DEMO_MODEL_NAME]
        pids = rank_pids(server.proc.pid)
        assert len(pids) == 1
        streams = [await open_stream(client, serve.DEMO_MODEL_NAME, 3000) for _ in range(2)]
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
    path, made = serve.ensure_demo_model()
    assert made and path == tmp_path / ".cache" / "deltaserve" / f"demo-{deltaserve.__version__}"
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    assert serve.ensure_demo_model() == (path, False)
