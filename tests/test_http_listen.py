"""Where `deltaserve serve` listens (http/listen.py): over TLS with vLLM's --ssl-* flags, on a
Unix domain socket with --uds; bad TLS flags and a socket in use refused before the engine
starts."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess

import aiohttp
import openai
import pytest
from serve_helpers import ServeProcess

from deltaserve.http import serve


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM), made by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = str(folder / "key.pem"), str(folder / "cert.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


async def test_tls(tiny_model_dir, certificate):
    """The OpenAI client, trusting the certificate, gets its completion over https; a plain
    http request to the same port gets no answer."""
    key, cert = certificate
    server = await ServeProcess.start(
        str(tiny_model_dir), "--ssl-keyfile", key, "--ssl-certfile", cert
    )
    try:
        assert server.url.startswith("https://127.0.0.1:")
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1",
            api_key="x",
            http_client=openai.DefaultAsyncHttpxClient(
                verify=ssl.create_default_context(cafile=cert)
            ),
        )
        out = await client.completions.create(
            model=str(tiny_model_dir), prompt="Hello", max_tokens=4
        )
        assert out.usage.completion_tokens == 4
        with pytest.raises(aiohttp.ClientError):
            async with aiohttp.ClientSession() as session:
                await session.get(server.url.replace("https", "http") + "/health")
    finally:
        await server.kill()
    assert await server.wait(10) == 0, server.log()


async def test_unix_socket(tiny_model_dir, tmp_path, caplog):
    """--uds: the routes answer on the socket; a second server there is refused before its engine
    starts; the socket file is gone after SIGTERM."""
    path = tmp_path / "deltaserve.sock"
    server = await ServeProcess.start(str(tiny_model_dir), "--uds", str(path))
    try:
        assert server.url == f"unix:{path}"
        async with aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(path))
        ) as session:
            async with session.get("http://localhost/health") as response:
                assert response.status == 200
            body = {"model": str(tiny_model_dir), "prompt": "Hello", "max_tokens": 3}
            async with session.post("http://localhost/v1/completions", json=body) as response:
                assert response.status == 200
                assert json.loads(await response.text())["usage"]["completion_tokens"] == 3
        assert serve.serve_main([str(tiny_model_dir), "--uds", str(path)]) == 1  # before its engine
        assert "another server listens there" in caplog.text
    finally:
        await server.kill()
    assert await server.wait(10) == 0, server.log()
    assert not path.exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (
            ["--ssl-cert-reqs", "2"],
            "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile",
        ),
        (
            ["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-cert-reqs", "2"],
            "--ssl-cert-reqs 2 needs --ssl-ca-certs",
        ),
        (
            ["--ssl-keyfile", "KEY", "--ssl-certfile", "/nonexistent.pem"],
            "--ssl-certfile /nonexistent.pem / --ssl-keyfile",
        ),
        (
            ["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-ca-certs", "/none.pem"],
            "--ssl-ca-certs /none.pem:",
        ),
    ],
)
def test_bad_tls_flags_are_refused_before_anything_loads(
    tiny_model_dir, certificate, capsys, flags, words
):
    key, cert = certificate
    flags = [{"KEY": key, "CERT": cert}.get(flag, flag) for flag in flags]
    assert serve.serve_main([str(tiny_model_dir), *flags]) == 2
    assert f"error: {words}" in capsys.readouterr().err


def test_socket_path_that_cannot_serve(tiny_model_dir, tmp_path, caplog):
    """A missing folder, or a file that is not a socket: refused before the engine starts."""
    assert serve.serve_main([str(tiny_model_dir), "--uds", str(tmp_path / "no" / "s.sock")]) == 1
    (tmp_path / "file").write_text("x")
    assert serve.serve_main([str(tiny_model_dir), "--uds", str(tmp_path / "file")]) == 1
    assert "no folder" in caplog.text and "exists and is not a socket" in caplog.text
