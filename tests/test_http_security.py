"""The server's doors (issue 48), each tried with a real request against a real server: the
module's engine (a rank process, ZeroMQ, shared memory) behind apps configured as
`deltaserve serve` configures them, and one `deltaserve serve` process whose every log line
(its ranks' too) is read.

What a web page in a browser could make a server on the same machine do (text/plain POSTs
from another site, DNS rebinding) is refused and changes nothing; every route but the
probes needs the key, the admin routes the admin key and a flag; new weights come only from
files inside their checkpoint folder, and no byte of any other file reaches a response or a
log; a level-2 sleep never serves the garbage left where the weights were; a client that
stops reading a stream cannot make the server hold its events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from serve_helpers import ServeProcess, metric_samples, wait_idle

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.http import serve
from deltaserve.http.access_flags import access_config
from deltaserve.http.listen import start_server
from deltaserve.http.server import ServerConfig, build_app

module_loop = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-sec"
KEY = "sk-api"
ADMIN_KEY = "sk-admin"
EVIL = "http://evil.example"
PROMPT = [9707, 11, 1879, 0, 358, 1079, 264, 1273]
COMPLETION = {
    "model": MODEL,
    "prompt": PROMPT,
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}
JSON = {"Content-Type": "application/json"}
OVERFLOW_METRIC = "deltaserve:stream_overflow_aborts_total"
SECRET = b"TOPSECRET: the bytes of a file outside every checkpoint, never to be shown\n"
ADMIN_CALLS = (  # (method, path, JSON body): each changes the engine when it runs
    ("POST", "/pause?mode=abort", None),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/sleep?level=2", None),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/wake_up", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp"}),
    ("POST", "/flush_cache", None),
    ("GET", "/flush_cache", None),
    ("POST", "/reset_prefix_cache", None),
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir) -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.start(
        EngineConfig(model=str(tiny_model_dir), max_model_len=2048, max_num_seqs=8)
    )
    try:
        yield engine
    finally:
        await engine.shutdown()


@contextlib.asynccontextmanager
async def served(engine: AsyncEngine, **config) -> AsyncIterator[str]:
    """An app with ServerConfig(MODEL, **config) on the module's engine: its base URL."""
    runner, _ = await start_server(build_app(engine, ServerConfig(MODEL, **config)), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def call(
    method: str,
    url: str,
    headers: dict[str, str] | None = None,
    body: dict | None = None,
    data: bytes | str | None = None,
) -> tuple[int, dict | str]:
    """Status and body (JSON when it is) of one request; a JSON `body` goes as JSON."""
    if body is not None:
        data, headers = json.dumps(body), {**JSON, **(headers or {})}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, headers=headers, data=data) as reply,
    ):
        text = await reply.text()
        return reply.status, json.loads(text) if reply.content_type == "application/json" else text


async def greedy_text(url: str, headers: dict[str, str] | None = None) -> str:
    status, answer = await call("POST", url + "/v1/completions", headers, COMPLETION)
    assert status == 200, answer
    return answer["choices"][0]["text"]


# ---- what a web page could make the server do --------------------------------------------


@module_loop
async def test_cross_site_admin_calls_and_a_foreign_host_change_nothing(engine):
    """The worst case: admin routes and sleep mode on, no key. A page on another site sends
    each admin call as a simple request (text/plain or a form, or no body; no preflight),
    with its Origin or only the browser's Sec-Fetch-Site (an <img>): 403. The same calls as
    curl would send them but with a text/plain body: 415, naming the route. DNS rebinding (a
    name pointed at 127.0.0.1: same-origin to the browser, a foreign Host): 400. Then the
    engine is neither paused nor asleep, its weights are its own, and it answers as before."""
    async with served(engine, enable_admin_routes=True, enable_sleep_mode=True) as url:
        before = await greedy_text(url)
        port = url.rsplit(":", 1)[1]
        for method, path, body in ADMIN_CALLS:
            text = json.dumps(body) if body is not None else ""
            for headers, data, status, code in (
                ({"Origin": EVIL, "Content-Type": "text/plain"}, text, 403, "cross_site_request"),
                (
                    {"Origin": EVIL, "Content-Type": "application/x-www-form-urlencoded"},
                    "mode=abort",
                    403,
                    "cross_site_request",
                ),
                ({"Origin": EVIL}, None, 403, "cross_site_request"),
                ({"Sec-Fetch-Site": "cross-site"}, None, 403, "cross_site_request"),
                ({"Content-Type": "text/plain"}, text or "x", 415, "unsupported_media_type"),
                ({"Host": f"evil.example:{port}", **JSON}, text or None, 400, "invalid_host"),
                (
                    {"Host": f"evil.example:{port}", "Origin": f"{EVIL}:{port}", **JSON},
                    text or None,
                    400,
                    "invalid_host",
                ),
            ):
                if method == "GET" and status == 415:
                    continue  # a GET has no body to refuse
                got, answer = await call(method, url + path, headers, data=data)
                assert (got, answer["error"]["code"]) == (status, code), (path, headers, answer)
                if status == 415:
                    assert f"{method} {path.split('?')[0]}" in answer["error"]["message"]
        assert not engine.is_paused and not engine.is_sleeping and not engine.weights_dropped
        assert engine.weights_dir == engine.config.model
        assert await greedy_text(url) == before
        assert (await call("GET", url + "/health"))[0] == 200


@module_loop
async def test_host_names_on_a_loopback_connection(engine):
    """By default a loopback connection serves IP addresses, localhost (and *.localhost) and
    this machine's name, nothing else; --allowed-hosts names the hosts instead (Starlette's
    patterns: `*`, `*.domain`)."""
    async with served(engine) as url:
        port = url.rsplit(":", 1)[1]
        for host, status in (
            (f"127.0.0.1:{port}", 200),
            ("127.0.0.1", 200),
            (f"[::1]:{port}", 200),
            (f"localhost:{port}", 200),
            (f"LocalHost.:{port}", 200),
            (f"ui.localhost:{port}", 200),
            (f"{socket.gethostname()}:{port}", 200),
            (f"evil.example:{port}", 400),
            (f"127.0.0.1.evil.example:{port}", 400),
        ):
            assert (await call("GET", url + "/v1/models", {"Host": host}))[0] == status, host
    async with served(engine, allowed_hosts=["api.example", "*.internal"]) as url:
        for host, status in (
            ("api.example:8000", 200),
            ("node-3.internal", 200),
            ("internal", 400),
            ("127.0.0.1", 400),
            ("localhost", 400),
        ):
            assert (await call("GET", url + "/v1/models", {"Host": host}))[0] == status, host
    async with served(engine, allowed_hosts=["*"]) as url:
        assert (await call("GET", url + "/v1/models", {"Host": "evil.example"}))[0] == 200


@module_loop
async def test_bodies_must_be_json(engine):
    """A POST body that is not `application/json` is a 415 naming the route (curl's -d sends
    a form); JSON with a charset is JSON; a POST with no body may say anything (aiohttp's
    client says application/octet-stream)."""
    async with served(engine) as url:
        raw = json.dumps(COMPLETION)
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            status, answer = await call(
                "POST",
                url + "/v1/completions",
                {} if content_type is None else {"Content-Type": content_type},
                data=raw,
            )
            assert status == 415 and "POST /v1/completions" in answer["error"]["message"], answer
        status, _ = await call(
            "POST",
            url + "/v1/completions",
            {"Content-Type": "application/json; charset=utf-8"},
            data=raw,
        )
        assert status == 200
        assert (await call("POST", url + "/ping", {"Content-Type": "application/octet-stream"}))[
            0
        ] == 200


# ---- keys and flags ----------------------------------------------------------------------


@module_loop
async def test_every_route_needs_its_key(engine):
    """With --api-key and --admin-api-key: each route the issue found open answers 401
    without the key, and with the admin key (SGLang's rule); the admin routes take only the
    admin key; the probes take none."""
    async with served(
        engine,
        api_key=KEY,
        admin_api_key=ADMIN_KEY,
        enable_admin_routes=True,
        enable_sleep_mode=True,
    ) as url:
        normal = (
            ("POST", "/tokenize", {"prompt": "hello"}),
            ("POST", "/detokenize", {"tokens": [1, 2]}),
            ("GET", "/health_generate", None),
            ("GET", "/get_model_info", None),
            ("GET", "/get_server_info", None),
            ("GET", "/server_info", None),
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", COMPLETION),
        )
        admin = (("GET", "/is_paused", None), ("GET", "/is_sleeping", None))
        for routes, good, bad in ((normal, KEY, ADMIN_KEY), (admin, ADMIN_KEY, KEY)):
            for method, path, body in routes:
                for key in (None, bad, good + "x"):
                    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
                    status, answer = await call(method, url + path, headers, body)
                    assert status == 401 and answer["error"]["code"] == "invalid_api_key", (
                        path,
                        key,
                    )
                status, answer = await call(method, url + path, {"x-api-key": good}, body)
                assert status == 200, (path, answer)
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert (await call("GET", url + path))[0] == 200, path


def test_keys_and_flags_from_the_environment():
    """The keys from the environment (kept out of `ps`): DELTASERVE_API_KEY before vLLM's
    VLLM_API_KEY, a flag before either; VLLM_SERVER_DEV_MODE=1 routes the admin routes as it
    routes vLLM's."""
    args = serve.parse_args(["m"])
    assert access_config(args, {})["api_key"] is None
    assert access_config(args, {"VLLM_API_KEY": "v"})["api_key"] == "v"
    env = {"VLLM_API_KEY": "v", "DELTASERVE_API_KEY": "d", "DELTASERVE_ADMIN_API_KEY": "a"}
    config = access_config(args, env)
    assert (config["api_key"], config["admin_api_key"]) == ("d", "a")
    flags = serve.parse_args(["m", "--api-key", "f", "--admin-api-key", "g"])
    assert (access_config(flags, env)["api_key"], access_config(flags, env)["admin_api_key"]) == (
        "f",
        "g",
    )
    assert not access_config(args, {})["enable_admin_routes"]
    assert access_config(args, {"VLLM_SERVER_DEV_MODE": "1"})["enable_admin_routes"]
    config = serve._server_config(serve.parse_args(["m", "--enable-sleep-mode"]))
    assert config.enable_sleep_mode and not config.enable_admin_routes
    assert config.allowed_origins == () and config.allowed_hosts is None


@module_loop
async def test_admin_routes_404_unless_enabled(engine):
    """Not routed unless the flag that enables them was given: a 404 that names the flag."""
    async with served(engine) as url:
        for path in ("/pause", "/update_weights_from_disk", "/is_paused", "/flush_cache"):
            status, answer = await call("POST" if path != "/is_paused" else "GET", url + path)
            assert status == 404 and "--enable-admin-routes" in answer["error"]["message"], path
        for path in ("/sleep", "/wake_up", "/release_memory_occupation"):
            status, answer = await call("POST", url + path)
            assert status == 404 and "--enable-sleep-mode" in answer["error"]["message"], path
    async with served(engine, enable_sleep_mode=True) as url:
        assert await call("GET", url + "/is_sleeping") == (200, {"is_sleeping": False})
        assert (await call("POST", url + "/pause"))[0] == 404


# ---- new weights only from their folder ---------------------------------------------------


def _copy(model_dir: Path, target: Path) -> Path:
    shutil.copytree(model_dir, target)
    return target


@pytest.mark.asyncio
async def test_weights_only_from_inside_their_folder(tiny_model_dir, tmp_path):
    """A `deltaserve serve` with the key from the environment and weight updates confined
    to a root. Refused, naming the rule: an index naming `../../secret.txt`, an absolute shard
    path, a shard in a subfolder, a shard that links out of the folder, a folder outside
    --allowed-weights-root, a "config.json" that is the secret. No byte of the secret (nor
    its first 8 bytes read as a length) is in any answer or any log line of the server or its
    rank; a good folder under the root loads; the server answers throughout."""
    root = tmp_path / "root"
    root.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    bad = {}
    for case, shard in (
        ("dotdot", "../../secret.txt"),
        ("absolute", str(secret)),
        ("subfolder", "sub/model.safetensors"),
    ):
        folder = _copy(tiny_model_dir, root / case)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.embed_tokens.weight": shard}})
        )
        bad[case] = (folder, "not a plain file name")
    linked = _copy(tiny_model_dir, root / "linked")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(secret)
    bad["linked"] = (linked, "resolves outside the checkpoint folder")
    config = _copy(tiny_model_dir, root / "config")
    (config / "config.json").unlink()
    (config / "config.json").symlink_to(secret)
    bad["config"] = (config, "has no config.json that reads as a model's config")
    bad["outside"] = (_copy(tiny_model_dir, tmp_path / "elsewhere"), "--allowed-weights-root")
    good = _copy(tiny_model_dir, root / "good")

    env = {**os.environ, "DELTASERVE_API_KEY": KEY}
    server = await ServeProcess.start(
        str(tiny_model_dir),
        "--served-model-name",
        MODEL,
        "--enable-admin-routes",
        "--allowed-weights-root",
        str(root),
        "--log-level",
        "DEBUG",
        env=env,
    )
    auth = {"Authorization": f"Bearer {KEY}"}
    answers = []
    try:
        assert KEY.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        before = await greedy_text(server.url, auth)
        for case, (folder, rule) in bad.items():
            status, answer = await call(
                "POST", server.url + "/update_weights_from_disk", auth, {"model_path": str(folder)}
            )
            answers.append(json.dumps(answer))
            message = answer["message"] if "message" in answer else answer["error"]["message"]
            assert status == 400 and rule in message, (case, answer)
            assert await greedy_text(server.url, auth) == before, case
        status, answer = await call(
            "POST", server.url + "/update_weights_from_disk", auth, {"model_path": str(good)}
        )
        assert (status, answer["success"]) == (200, True), answer
        assert await greedy_text(server.url, auth) == before  # the same weights, from `good`
    finally:
        await server.kill()
        await server.wait(30)
    shown = "\n".join([*answers, *server.lines])
    length = str(int.from_bytes(SECRET[:8], "little"))
    for needle in (SECRET.decode().strip(), "TOPSECRE", length):
        assert needle not in shown, needle


# ---- no garbage served ---------------------------------------------------------------------


@module_loop
async def test_level_2_sleep_then_wake_up_serves_nothing_until_new_weights(engine):
    """A level-2 sleep drops the weights; woken without new ones, the engine refuses to
    generate (503 naming the state, on every generating route and /health) instead of
    answering from the memory left there; new weights loaded, it answers as before."""
    async with served(engine, enable_admin_routes=True, enable_sleep_mode=True) as url:
        before = await greedy_text(url)
        assert (await call("POST", url + "/sleep?level=2"))[0] == 200
        assert (await call("POST", url + "/wake_up"))[0] == 200
        assert not engine.is_sleeping and engine.weights_dropped
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for method, path, body in (
            ("POST", "/v1/completions", COMPLETION),
            ("POST", "/v1/chat/completions", chat),
            ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}),
            ("GET", "/health_generate", None),
            ("GET", "/health", None),
            ("GET", "/ping", None),
        ):
            status, answer = await call(method, url + path, body=body)
            assert status == 503, (path, answer)
            if isinstance(answer, dict):
                assert answer["error"]["code"] == "no_weights", (path, answer)
                assert "level-2 sleep" in answer["error"]["message"]
        assert engine.load().waiting == 0  # refused, not queued
        status, answer = await call(
            "POST",
            url + "/update_weights_from_disk",
            body={"model_path": engine.config.model},
        )
        assert (status, answer["success"]) == (200, True), answer
        assert not engine.weights_dropped and await greedy_text(url) == before
        assert (await call("GET", url + "/health"))[0] == 200


# ---- streams bounded -----------------------------------------------------------------------


@module_loop
async def test_a_client_that_stops_reading_is_aborted(engine, tmp_path):
    """A client asks for a long stream of fat events (8 choices, 20 alternatives a token),
    reads its headers and stops reading. Once the socket's buffer is full the server's write
    waits; the events that then pile up for it stay under the bound
    (--max-pending-stream-events per choice): past it the request is aborted, its connection
    closed, counted in /metrics, long before the tokens asked for were made; other clients are
    served meanwhile. The server listens on a Unix socket, whose buffer is a fixed ~200 KiB
    (a loopback TCP connection's grows to megabytes, minutes of tokens on the CPU)."""
    bound, choices, max_tokens = 8, 8, 1500
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": max_tokens,
        "n": choices,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
    raw = json.dumps(body).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    path = str(tmp_path / "s.sock")
    assert len(path) < 100  # what sun_path holds
    app = build_app(engine, ServerConfig(MODEL, max_pending_stream_events=bound))
    runner, _ = await start_server(app, "127.0.0.1", 0, uds=path)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX)
    sock.setblocking(False)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path)) as others:
            url = "http://localhost"

            async def aborts() -> int:
                async with others.get(url + "/metrics") as reply:
                    text = await reply.text()
                return int(metric_samples(text, MODEL)[OVERFLOW_METRIC])

            assert await aborts() == 0
            await loop.sock_connect(sock, path)
            made_before = engine.metrics.generation_tokens_total
            await loop.sock_sendall(sock, request)
            head = await loop.sock_recv(sock, 1024)
            assert head.startswith(b"HTTP/1.1 200"), head
            async with asyncio.timeout(180):
                while await aborts() == 0:
                    async with others.post(url + "/v1/completions", json=COMPLETION) as reply:
                        assert reply.status == 200  # another client, served meanwhile
            await wait_idle(engine, timeout_s=30)
            made = engine.metrics.generation_tokens_total - made_before
            assert made < choices * max_tokens / 4, made  # aborted, not run to its end
            with contextlib.suppress(ConnectionResetError):  # the abort, seen as a reset
                async with asyncio.timeout(30):  # what the socket held, then its end
                    while await loop.sock_recv(sock, 1 << 16):
                        pass
            assert await aborts() == 1
    finally:
        sock.close()
        await runner.cleanup()
