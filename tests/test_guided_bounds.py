"""Issue 47's attacks on a real `deltaserve serve` (the tiny model, CPU, real rank process and
compile worker): each gets a 400 naming the field up front, or ends alone with an error
event naming the bound (or, within its bounds, completes), while a concurrent unguided stream
completes and /health keeps answering; afterwards the server's, the rank's and the compile
worker's memory are within 50 MB of what they were once guided decoding was warm.

Before llguidance (engine/guides.py), one lazy regex grew rank 0 by 8 GB in 36 tokens and
killed the engine, four stop regexes held the event loop (and /health) for 10 s, and nesting
gave 500s. The server here runs with max_lexer_states lowered to 2000 (a bound of
--structured-outputs-config), so that the lazy regex ends mid-stream on it: the per-request
failure path, through the rank's step result, the scheduler and the SSE stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from serve_helpers import ServeProcess, rank_pids

aio = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
MB = 2**20
HEALTH_POLL_S = 0.05


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


NESTED_250 = "(" * 250 + "a" + ")" * 250
LEFT_RECURSION = (
    "root ::= r0\n"
    + "".join(f'r{i} ::= r{i + 1} "x" | "y"\n' for i in range(999))
    + 'r999 ::= r0 "x" | "y"\n'
)
STOP_AT_CAP = [f"q{i:02d}" + "z" * 253 for i in range(16)]  # 16 x 256 bytes: 4096, the cap

# (name, route, body fields, the field a 400 names, words it says; None: a 200)
ATTACKS = [
    ("lazy regex", "/v1/completions", {"guided_regex": r"[\s\S]*[aeiou][\s\S]{300}"}, None, None),
    (  # its first mask takes ~2 s: past max_mask_ms, or on a busy host compile_timeout_s
        "counted regex",
        "/v1/completions",
        {"guided_regex": "(?:a{1000}){399}b0"},
        "guided_regex",
        ("max_mask_ms", "compile_timeout_s"),
    ),
    (
        "four stop regexes",
        "/v1/completions",
        {"stop_regex": [f"(?:a{{1000}}){{399}}b{i}" for i in range(4)]},
        None,
        None,
    ),
    (
        "stop regex of 300",
        "/v1/completions",
        {"stop_regex": [r"[aeiou][\s\S]{300}\x00"], "max_tokens": 200},
        None,
        None,
    ),
    ("nested regex", "/v1/completions", {"guided_regex": NESTED_250}, "guided_regex", "nested"),
    (
        "deep schema",
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": _deep_schema(400)},
            }
        },
        "response_format",
        "max_nesting_depth",
    ),
    (
        "10,000 properties",
        "/v1/completions",
        {
            "structured_outputs": {
                "json": {
                    "type": "object",
                    "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)},
                }
            }
        },
        "structured_outputs.json",
        "max_grammar_bytes",
    ),
    (
        "nested GBNF",
        "/v1/completions",
        {"guided_grammar": "root ::= " + "(" * 200 + '"a"' + ")" * 200},
        "guided_grammar",
        "nested",
    ),
    (
        "nested Lark",
        "/v1/completions",
        {"structured_outputs": {"grammar": "start: " + "(" * 200 + '"a"' + ")" * 200}},
        "structured_outputs.grammar",
        "nested",
    ),
    ("deep left recursion", "/v1/completions", {"guided_grammar": LEFT_RECURSION}, None, None),
    ("nested stop regex", "/v1/completions", {"stop_regex": [NESTED_250]}, "stop_regex", "nested"),
    ("16 stop regexes at the cap", "/v1/completions", {"stop_regex": STOP_AT_CAP}, None, None),
    (
        "one byte past the cap",
        "/v1/completions",
        {"stop_regex": [*STOP_AT_CAP[:15], STOP_AT_CAP[15] + "z"]},
        "stop_regex",
        "max_stop_regex_bytes",
    ),
    (
        "SGLang's nested regex",
        "/generate",
        {"sampling_params": {"regex": NESTED_250, "max_new_tokens": 8}},
        "sampling_params.regex",
        "nested",
    ),
]


def _rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096


def _worker_pid(server_pid: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"grammar_worker" in cmdline:
            return int(entry.name)
    return None


def _memory(server: ServeProcess) -> dict[str, int]:
    """Resident bytes of the server, its rank and its compile worker."""
    pid = server.proc.pid
    (rank,) = rank_pids(pid)
    worker = _worker_pid(pid)
    return {
        "server": _rss(pid),
        "rank": _rss(rank),
        "worker": 0 if worker is None else _rss(worker),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    proc = await ServeProcess.start(
        str(tiny_model_dir),
        *("--served-model-name", MODEL, "--device", "cpu", "--max-num-seqs", "4"),
        *("--max-model-len", "1024", "--structured-outputs-config", "max_lexer_states=2000"),
    )
    try:
        yield proc
    finally:
        await proc.kill()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def warm(server) -> dict[str, int]:
    """Guided decoding warm (the worker started, the rank's vocabulary read, a stop regex's
    matcher made); the memory then is each test's baseline."""
    async with aiohttp.ClientSession() as session:
        for extra in ({"guided_choice": ["yes", "no"]}, {"stop_regex": ["x{3}"]}):
            status, _ = await _post(session, server.url, "/v1/completions", extra)
            assert status == 200
    return _memory(server)


async def _post(
    session: aiohttp.ClientSession, url: str, route: str, extra: dict[str, Any]
) -> tuple[int, Any]:
    """A request (streamed, but for /generate): (status, the JSON error or the SSE events)."""
    if route == "/generate":
        body = {"text": "The weather today is", **extra}
    elif route == "/v1/chat/completions":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    else:
        body = {"model": MODEL, "prompt": "The weather today is", **extra}
    if route != "/generate":
        body = {"max_tokens": 40, "temperature": 1.0, "seed": 1, "stream": True, **body}
    async with session.post(url + route, json=body) as reply:
        if reply.status != 200:
            return reply.status, await reply.json()
        raw = await reply.read()
    if route == "/generate":
        return 200, json.loads(raw)
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-300:]
    return 200, [json.loads(e) for e in events[:-1]]


async def _health(url: str, stop: asyncio.Event) -> list[tuple[int, float]]:
    """/health's (status, seconds to answer), polled until `stop`."""
    seen = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            started = time.perf_counter()
            async with session.get(url + "/health") as reply:
                seen.append((reply.status, time.perf_counter() - started))
            await asyncio.sleep(HEALTH_POLL_S)
    return seen


async def _idle(url: str) -> None:
    """Until the engine runs and holds no request (the /metrics gauges)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(400):
            async with session.get(url + "/metrics") as reply:
                text = await reply.text()
            gauges = [
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
            ]
            if gauges and not any(gauges):
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the engine did not become idle")


@aio
@pytest.mark.parametrize("name, route, extra, param, words", ATTACKS, ids=[a[0] for a in ATTACKS])
async def test_attack_is_bounded(server, warm, name, route, extra, param, words):
    stop = asyncio.Event()
    health = asyncio.ensure_future(_health(server.url, stop))
    async with aiohttp.ClientSession() as session:
        normal = asyncio.ensure_future(
            _post(session, server.url, "/v1/completions", {"max_tokens": 32, "ignore_eos": True})
        )
        status, answer = await _post(session, server.url, route, extra)
        normal_status, normal_events = await normal
    stop.set()
    polled = await health
    # the concurrent stream completed unharmed, and /health answered throughout
    assert normal_status == 200 and normal_events[-1]["choices"][0]["finish_reason"] == "length"
    assert polled and all(status == 200 for status, _ in polled), polled
    slowest = max(seconds for _, seconds in polled)
    print(f"{name}: slowest /health {1e3 * slowest:.0f} ms over {len(polled)} polls")
    assert slowest < 1.0, f"/health took {slowest:.2f} s: something blocked the event loop"
    if param is not None:
        assert status == 400, answer
        error = answer["error"]
        alternatives = (words,) if isinstance(words, str) else words
        assert error["param"] == param, error
        assert any(w in error["message"] for w in alternatives), error
    else:
        assert status == 200, answer
        if route != "/generate":
            _check_alone(name, answer)
    await _idle(server.url)
    now = _memory(server)
    print(f"{name}: memory MiB at start {_mib(warm)}, now {_mib(now)}")
    for part in ("server", "rank", "worker"):
        assert now[part] <= warm[part] + 50 * MB, (part, _mib(warm), _mib(now))


def _check_alone(name: str, events: list[dict[str, Any]]) -> None:
    """A 200 stream: its choice finished, or (past a bound mid-stream) finished with
    finish_reason "error", then an error event naming the bound."""
    if "error" in events[-1]:
        finish = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert finish and finish[-1]["choices"][0]["finish_reason"] == "error", events[-3:]
        message = events[-1]["error"]["message"]
        assert "went past" in message, message  # and names the bound
        print(f"{name}: ended alone: {message}")
        return
    reason = events[-1]["choices"][0]["finish_reason"]
    assert reason in ("stop", "length"), events[-1]
    print(f"{name}: {reason}")


def _mib(memory: dict[str, int]) -> dict[str, int]:
    return {part: size // MB for part, size in memory.items()}


@aio
async def test_not_streamed_a_request_past_its_bound_is_a_400(server, warm):
    """Without a stream, the lazy regex's end is the 400 naming the bound (nothing was sent)."""
    async with aiohttp.ClientSession() as session:
        extra = {"guided_regex": r"[\s\S]*[aeiou][\s\S]{300}", "stream": False}
        status, answer = await _post(session, server.url, "/v1/completions", extra)
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == "bound_exceeded" and "max_lexer_states (2000)" in error["message"]
