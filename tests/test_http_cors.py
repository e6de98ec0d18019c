"""CORS as `vllm serve` answers it (http/cors.py): its flags --allowed-origins,
--allowed-methods, --allowed-headers (JSON lists) and --allow-credentials, Starlette's
CORSMiddleware's rules; no origin allowed by default (vLLM's default, `["*"]`, is given
here explicitly). Each configuration is made from the command line as `deltaserve serve`
makes it and served by an app on the module's one engine; plain aiohttp requests send what a
browser sends (Origin, preflight OPTIONS).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from multidict import CIMultiDictProxy

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.http import serve
from deltaserve.http.listen import start_server
from deltaserve.http.server import ServerConfig, build_app

module_loop = pytest.mark.asyncio(loop_scope="module")  # the module's engine and servers

MODEL = "tiny-cors"
KEY = "sk-cors"
UI = "http://ui.example:3000"
OTHER = "http://other.example"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    text: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir) -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.start(
        EngineConfig(model=str(tiny_model_dir), max_model_len=128, max_num_seqs=2)
    )
    try:
        yield engine
    finally:
        await engine.shutdown()


@contextlib.asynccontextmanager
async def served(engine: AsyncEngine, model_dir, *flags: str) -> AsyncIterator[str]:
    """The base URL of an app configured by `flags` as `deltaserve serve` reads them."""
    config = serve._server_config(
        serve.parse_args([str(model_dir), "--served-model-name", MODEL, "--api-key", KEY, *flags])
    )
    runner, _ = await start_server(build_app(engine, config), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def default_url(engine, tiny_model_dir) -> AsyncIterator[str]:
    async with served(engine, tiny_model_dir) as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def any_origin_url(engine, tiny_model_dir) -> AsyncIterator[str]:
    async with served(engine, tiny_model_dir, "--allowed-origins", '["*"]') as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def restricted_url(engine, tiny_model_dir) -> AsyncIterator[str]:
    async with served(
        engine,
        tiny_model_dir,
        "--allowed-origins",
        f'["{UI}"]',
        "--allowed-methods",
        '["POST"]',
        "--allowed-headers",
        '["Authorization"]',
    ) as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def credentials_url(engine, tiny_model_dir) -> AsyncIterator[str]:
    async with served(
        engine, tiny_model_dir, "--allowed-origins", '["*"]', "--allow-credentials"
    ) as url:
        yield url


async def call(method: str, url: str, headers: dict[str, str], json: dict | None = None) -> Reply:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, headers=headers, json=json) as r,
    ):
        return Reply(r.status, r.headers, await r.text())


def preflight(origin: str, method: str = "POST", headers: str | None = None) -> dict[str, str]:
    """The headers of a browser's preflight: it asks before a call that is not "simple"."""
    sent = {"Origin": origin, "Access-Control-Request-Method": method}
    return sent if headers is None else {**sent, "Access-Control-Request-Headers": headers}


async def chat(url: str, headers: dict[str, str], stream: bool = False) -> Reply:
    reply = await call("POST", url + "/v1/chat/completions", headers, {**CHAT, "stream": stream})
    if reply.status == 200 and stream:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        assert reply.text.endswith("data: [DONE]\n\n"), reply.text
    return reply


@module_loop
async def test_default_allows_no_other_site(default_url):
    """No --allowed-origins: a preflight from any origin is refused, and a request from
    another site (its Origin, or the browser's Sec-Fetch-Site) is refused before the key is
    looked at, with no CORS header; the server's own origin, and no Origin, are served."""
    port = default_url.rsplit(":", 1)[1]
    pre = await call("OPTIONS", default_url + "/v1/chat/completions", preflight(UI))
    assert (pre.status, pre.text) == (400, "Disallowed CORS origin")
    for headers in ({"Origin": UI}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
        r = await chat(default_url, {**AUTH, **headers})
        assert r.status == 403 and "cross_site_request" in r.text, (headers, r.text)
        assert "Access-Control-Allow-Origin" not in r.headers
    own = {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}
    for headers in (own, {}):
        r = await chat(default_url, {**AUTH, **headers}, stream=True)
        assert r.status == 200, (headers, r.text)
    probe = await call("GET", default_url + "/health", {"Origin": UI})  # probes stay open
    assert probe.status == 200


@module_loop
async def test_any_origin_preflight_needs_no_key(any_origin_url):
    """vLLM's defaults given as flags (every origin, method and header; no credentials): a
    chat UI's preflight is answered without the API key, the requested headers echoed back."""
    default_url = any_origin_url
    r = await call(
        "OPTIONS",
        default_url + "/v1/chat/completions",
        preflight(UI, headers="authorization, content-type"),
    )
    assert (r.status, r.text) == (200, "OK")
    assert r.headers["Access-Control-Allow-Origin"] == "*"
    assert r.headers["Access-Control-Allow-Methods"] == ALL_METHODS
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert r.headers["Access-Control-Max-Age"] == "600"
    assert "Vary" not in r.headers and "Access-Control-Allow-Credentials" not in r.headers
    bare = await call("OPTIONS", default_url + "/v1/completions", preflight(UI))
    assert bare.status == 200 and "Access-Control-Allow-Headers" not in bare.headers
    # Chrome's Private Network Access: refused, as vLLM's Starlette refuses it
    pna = await call(
        "OPTIONS",
        default_url + "/v1/models",
        {**preflight(UI, "GET"), "Access-Control-Request-Private-Network": "true"},
    )
    assert (pna.status, pna.text) == (400, "Disallowed CORS private-network")


@module_loop
async def test_any_origin_every_response_allows_it(any_origin_url):
    """A request with Origin gets `access-control-allow-origin: *`: answers, SSE streams,
    401s and 404s alike; one without Origin gets no CORS header."""
    default_url = any_origin_url
    origin = {"Origin": UI}
    for stream in (False, True):
        r = await chat(default_url, {**AUTH, **origin}, stream)
        assert r.status == 200, r.text
        assert r.headers["Access-Control-Allow-Origin"] == "*", stream
        assert "Vary" not in r.headers and "Access-Control-Allow-Credentials" not in r.headers
    unauthorized = await chat(default_url, origin)
    assert unauthorized.status == 401 and unauthorized.headers["Access-Control-Allow-Origin"] == "*"
    missing = await call("GET", default_url + "/nowhere", {**AUTH, **origin})
    assert missing.status == 404 and missing.headers["Access-Control-Allow-Origin"] == "*"
    plain = await chat(default_url, AUTH, stream=True)
    assert plain.status == 200
    assert not [h for h in plain.headers if h.lower().startswith("access-control-")], plain.headers


@module_loop
async def test_restricted_origins_methods_headers(restricted_url):
    """--allowed-origins/-methods/-headers lists: an allowed origin is echoed with Vary: Origin;
    another origin's preflight is refused (400), and its requests (403)."""
    url = restricted_url + "/v1/chat/completions"
    ok = await call("OPTIONS", url, preflight(UI, headers="Authorization, Content-Type"))
    assert (ok.status, ok.text) == (200, "OK")
    assert ok.headers["Access-Control-Allow-Origin"] == UI and ok.headers["Vary"] == "Origin"
    assert ok.headers["Access-Control-Allow-Methods"] == "POST"
    assert ok.headers["Access-Control-Allow-Headers"] == (
        "Accept, Accept-Language, Authorization, Content-Language, Content-Type"
    )
    other = await call("OPTIONS", url, preflight(OTHER))
    assert (other.status, other.text) == (400, "Disallowed CORS origin")
    assert "Access-Control-Allow-Origin" not in other.headers and other.headers["Vary"] == "Origin"
    wrong = await call("OPTIONS", url, preflight(UI, "PUT", "X-Trace"))
    assert (wrong.status, wrong.text) == (400, "Disallowed CORS method, headers")
    for stream in (False, True):
        r = await chat(restricted_url, {**AUTH, "Origin": UI}, stream)
        assert r.status == 200, r.text
        assert r.headers["Access-Control-Allow-Origin"] == UI and r.headers["Vary"] == "Origin"
    refused = await chat(restricted_url, {**AUTH, "Origin": OTHER})
    assert refused.status == 403 and "Access-Control-Allow-Origin" not in refused.headers


@module_loop
async def test_allow_credentials_echoes_the_origin(credentials_url):
    """--allow-credentials: a browser refuses "*" on a credentialed call, so every origin
    allowed means each one echoed (Vary: Origin), with allow-credentials."""
    pre = await call("OPTIONS", credentials_url + "/v1/chat/completions", preflight(UI))
    assert pre.status == 200 and pre.headers["Access-Control-Allow-Credentials"] == "true"
    assert pre.headers["Access-Control-Allow-Origin"] == UI and pre.headers["Vary"] == "Origin"
    for stream in (False, True):
        r = await chat(credentials_url, {**AUTH, "Origin": OTHER}, stream)
        assert r.status == 200, r.text
        assert r.headers["Access-Control-Allow-Origin"] == OTHER and r.headers["Vary"] == "Origin"
        assert r.headers["Access-Control-Allow-Credentials"] == "true"


@pytest.mark.parametrize("flag", ["--allowed-origins", "--allowed-methods", "--allowed-headers"])
@pytest.mark.parametrize("value", ['"*"', "[POST]", '["GET", 1]', "{}"])
def test_bad_list_flag_refused_naming_it(flag, value, capsys):
    """Not a JSON list of strings: the start is refused (exit 2) naming the flag."""
    with pytest.raises(SystemExit) as exit_:
        serve.parse_args([flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_config_holds_the_lists():
    """The flags' defaults are vLLM's but for the origins (none); the config refuses what is
    not a list of strings (a bare "*" would otherwise be read letter by letter)."""
    config = serve._server_config(serve.parse_args(["m", "--allowed-methods", '["GET", "POST"]']))
    assert (config.allowed_origins, config.allowed_methods, config.allowed_headers) == (
        (),
        ("GET", "POST"),
        ("*",),
    )
    assert config.allow_credentials is False
    with pytest.raises(ValueError, match="allowed_origins must be a list of strings"):
        ServerConfig(MODEL, allowed_origins="*")
