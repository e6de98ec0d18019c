"""`deltaserve serve`'s command line as a vLLM or SGLang user meets it: the flags' spellings,
the help's defaults, a listen address that cannot be had (found before any weight loads), and
the ready line's URL on an IPv6 address."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket

import pytest
from serve_helpers import DELTASERVE, get

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config_flags import engine_config
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.http import serve
from deltaserve.http.server import ServerConfig
from deltaserve.tools.demo_model import demo_checkpoint, demo_name


def test_vllm_and_sglang_spellings():
    """`-tp 2` as vLLM's short flag, `-dp 2` and SGLang's `--dp-size 2`; `--log-level debug`
    in SGLang's lower case."""
    assert serve.parse_args(["-tp", "2"]).tp_size == 2
    assert (
        serve.parse_args(["-dp", "2"]).data_parallel_size
        == serve.parse_args(["--dp-size", "2"]).data_parallel_size
        == 2
    )
    assert serve.parse_args(["--log-level", "debug"]).log_level == "DEBUG"
    assert serve.parse_args(["--log-level", "Warning"]).log_level == "WARNING"


def test_several_served_model_names(tmp_path, capsys):
    """`--served-model-name a b`, as vLLM's: every name is served, the first reported. The
    second name became MODEL ("unrecognized arguments" or a wrong checkpoint)."""
    model = str(tmp_path)
    for argv in (
        [model, "--served-model-name", "a", "b"],
        ["--served-model-name", "a", "b", "--model", model],
        ["--served-model-name", "a", "b", "--", model],
    ):
        args = serve.parse_args(argv)
        assert args.model == model, argv
        assert serve._server_config(args).served_model_name == ("a", "b"), argv
    assert ServerConfig("a").served_model_name == ("a",)  # one name, as library callers pass it
    for bad in ((), ("a", ""), ["a", 3]):
        with pytest.raises(ValueError, match="served_model_name"):
            ServerConfig(bad)
    args = serve.parse_args([model, "--served-model-name", "a"])
    assert serve._server_config(args).served_model_name == ("a",)
    assert serve._server_config(serve.parse_args([model])).served_model_name == (model,)
    # The names swallow a MODEL given after them (as in vLLM); said, not served as the demo.
    with pytest.raises(SystemExit) as info:
        serve.parse_args(["--served-model-name", "a", "b", model])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "MODEL" in err and f"{model!r}" in err and "--served-model-name" in err, err


def test_help_shows_no_none_default(capsys):
    """A flag whose default depends on the machine or the model says so in its help; a
    '(default: None)' after that (--device: 'cuda if available, else cpu (default: None)')
    contradicted it."""
    with pytest.raises(SystemExit) as info:
        serve.parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert "default: cuda if available, else cpu" in text
    assert re.search(r"--log-level .*\(default: INFO\)", text), text


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def engine_starts(monkeypatch) -> list:
    """AsyncEngine.start recorded and refused: the test must fail before any weight loads."""
    calls = []

    async def start(config):
        calls.append(config)
        raise RuntimeError("the engine was started")

    monkeypatch.setattr(AsyncEngine, "start", start)
    return calls


def test_port_in_use_fails_before_the_engine_starts(
    tiny_model_dir, taken_port, engine_starts, caplog
):
    """A port in use used to be found only after the weights had loaded (minutes on a GPU)."""
    code = serve.serve_main([str(tiny_model_dir), "--port", str(taken_port)])
    assert engine_starts == [], caplog.text
    assert code == 1
    assert f"cannot listen on 127.0.0.1:{taken_port}" in caplog.text


def test_bad_host_fails_before_the_demo_model_is_made(tmp_path, monkeypatch, engine_starts, caplog):
    """No --model and an address this machine does not have: no demo checkpoint made first."""
    try:  # TEST-NET-1: on no machine's interfaces, unless non-local binds are allowed
        socket.create_server(("192.0.2.1", 0)).close()
        pytest.skip("this machine binds 192.0.2.1")
    except OSError:
        pass
    monkeypatch.setenv("HOME", str(tmp_path))
    code = serve.serve_main(["--host", "192.0.2.1", "--port", "8000"], demo=demo_checkpoint())
    assert engine_starts == [], caplog.text
    assert code == 1
    assert "cannot listen on 192.0.2.1:8000" in caplog.text
    assert not (tmp_path / ".cache" / "deltaserve" / demo_name()).exists()


def test_bad_flag_fails_before_the_demo_model_is_made(tmp_path, monkeypatch, engine_starts, capsys):
    """A flag the engine refuses, with no --model: the usage error comes first, no demo
    checkpoint made for nothing (that took seconds, and a first run made it); data-parallel
    replicas' devices are checked then too."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert serve.serve_main(["--max-num-seqs", "0"], demo=demo_checkpoint()) == 2
    assert "error: max_num_seqs must be an integer >= 1, got 0" in capsys.readouterr().err
    flags = ["-dp", "2", "--device", "cuda", "--device-ids", "0,1,2"]
    assert serve.serve_main(flags, demo=demo_checkpoint()) == 2
    assert "error: device_ids (0, 1, 2): need 2 distinct devices" in capsys.readouterr().err
    assert engine_starts == []
    assert not (tmp_path / ".cache" / "deltaserve").exists()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
async def test_ready_line_url_on_ipv6(tiny_model_dir):
    """`--host ::1`: the ready line's URL brackets the address (it said http://::1:PORT/v1,
    which no client can open)."""
    proc = await asyncio.create_subprocess_exec(
        DELTASERVE,
        "serve",
        str(tiny_model_dir),
        "--host",
        "::1",
        "--port",
        "0",
        "--monitor-endpoint",
        "off",
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    lines = []
    try:
        async with asyncio.timeout(120):
            async for raw in proc.stderr:
                lines.append(raw.decode(errors="replace").rstrip())
                if "ready: serving" in lines[-1]:
                    break
        m = re.search(r" at (\S+)/v1 ", lines[-1])
        assert m and m.group(1).startswith("http://[::1]:"), "\n".join(lines[-5:])
        status, _ = await get(m.group(1) + "/health")
        assert status == 200
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0, "\n".join(lines[-5:])


async def test_ready_line_says_what_a_request_can_use_and_why(tiny_model_dir, caplog):
    """The ready line's max_model_len is what /v1/models reports and a request can use, and
    it says where the sizes came from. With a KV cache smaller than the context it said
    max_model_len=8192 while /v1/models said 64 and every longer request got a 400; the
    default cap (min(max_position_embeddings, 8192), where vLLM takes the model's whole
    context) was not said either."""
    import logging

    from deltaserve.engine.config import EngineConfig

    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=4, block_size=16, max_num_seqs=1)
    with caplog.at_level(logging.INFO, logger="deltaserve.serve"):
        engine = await serve._start_engine(config, asyncio.Event())
    try:
        assert engine.longest_sequence == 64
    finally:
        await engine.shutdown()
    ready = [r for r in caplog.records if "engine ready" in r.getMessage()]
    assert len(ready) == 1, caplog.text
    line = ready[0].getMessage()
    assert "max_model_len=64 " in line, line
    assert (
        "8192" in line and "max_position_embeddings 32768" in line and "--max-model-len" in line
    ), line
    assert "--num-kv-blocks" in line, line
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("64" in w and "8192" in w for w in warned), caplog.text


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--chat-template", "templates/chatml.jinja"],
            "--chat-template 'templates/chatml.jinja' looks like a file path, "
            "but it cannot be opened (No such file",
        ),
        (
            ["--chat-template", "{{ messages }"],
            "--chat-template (given inline): "
            "the chat template is not valid Jinja on line 1: unexpected '}'",
        ),
        (
            ["--chat-template", "FILE"],
            "--chat-template 'FILE': the chat template is not "
            "valid Jinja on line 2: No filter named 'nosuch'",
        ),
        (["--chat-template", "EMPTY"], "--chat-template 'EMPTY': the chat template is empty"),
        (
            ["--default-chat-template-kwargs", '{"enable_thinking": false, "tools": []}'],
            "default_chat_template_kwargs: tools reserved by the server",
        ),
    ],
)
def test_bad_chat_template_flags_fail_before_the_engine_starts(
    tiny_model_dir, tmp_path, monkeypatch, engine_starts, capsys, flags, words
):
    """A template path that opens nothing (vLLM refuses it too: it is no template), a Jinja
    error (found by compiling as transformers does; it was a 400 on every chat), an empty
    template, default kwargs the request path refuses: one line and exit 2, no weight loaded."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("{{ messages }}\n{{ messages | nosuch }}")
    (tmp_path / "EMPTY").write_text("\n")
    assert serve.serve_main([str(tiny_model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert f"deltaserve serve: error: {words}" in err, err
    assert engine_starts == []


@pytest.mark.parametrize("value", ["[1]", "{enable_thinking: false}", '"x"'])
def test_default_chat_template_kwargs_must_be_a_json_object(capsys, value):
    with pytest.raises(SystemExit) as info:
        serve.parse_args(["--default-chat-template-kwargs", value])
    assert info.value.code == 2
    assert "argument --default-chat-template-kwargs:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="default_chat_template_kwargs must map names"):
        ServerConfig("m", default_chat_template_kwargs=[1])


# vLLM launch-script flags deltaserve already does what they ask: accepted (they were "unrecognized
# arguments", exit 2), and what each sets
ACCEPTED = [
    (["--trust-remote-code"], {}),  # no code from the checkpoint is ever run
    (["--disable-log-requests"], {}),  # none are logged
    (["--disable-log-stats"], {}),  # no periodic stats are logged
    (["--disable-uvicorn-access-log"], {}),  # no access log is written
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),  # the default
    (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    (
        ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'],
        {"speculative_config": SpeculativeConfig("mtp", 2)},
    ),
    (["--enable-prefix-caching", "--prefix-cache-states", "4"], {"prefix_cache_states": 4}),
    (["--enable-chunked-prefill"], {}),  # prompts are always prefilled in chunks
    (["--kv-cache-dtype", "auto"], {"kv_cache_dtype": "auto"}),  # the model's dtype
    (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8", "calculate_kv_scales": False}),
    (["--kv-cache-dtype", "fp8_e4m3", "--calculate-kv-scales"], {"calculate_kv_scales": True}),
    (["--mamba-ssm-cache-dtype", "bfloat16"], {"mamba_ssm_cache_dtype": "bfloat16"}),
    (["--kv-watermark", "0.05"], {"kv_watermark": 0.05}),
    (["--reserve-lifetime"], {"reserve_lifetime": True}),
    (["--swap-space", "16"], {}),  # a preempted request is recomputed, nothing swapped
    (["--uvicorn-log-level", "warning"], {}),
    (["--max-model-len", "32k"], {"max_model_len": 32000}),  # vLLM's human-readable sizes
    (["--max-model-len", "32K"], {"max_model_len": 32768}),
    (["--max-num-batched-tokens", "16k"], {"max_num_batched_tokens": 16000}),
    (["--max-num-batched-tokens", "2.5k"], {"max_num_batched_tokens": 2500}),
    (["--max-num-seqs", "8"], {"max_num_seqs": 8}),
    (["--block-size", "32"], {"block_size": 32}),
    (["--seed", "7"], {"seed": 7}),
]
# flags deltaserve cannot honour: the start refused, saying why (they were "unrecognized arguments")
REFUSED = [
    (
        ["--no-enable-chunked-prefill"],
        "--no-enable-chunked-prefill: not supported: deltaserve always prefills",
    ),
    (
        ["--kv-cache-dtype", "fp8_e5m2"],
        "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'",
    ),
    (
        ["-q", "awq"],
        "--quantization awq: not supported: "
        "deltaserve loads unquantized (bf16/fp32) checkpoints and FP8 ones",
    ),
    (
        ["--enable-log-requests"],
        "--enable-log-requests: not supported: deltaserve logs no requests",
    ),
    (
        ["--max-model-len", "auto"],
        "argument --max-model-len: 'auto' (vLLM: as long as memory allows) is not supported",
    ),
    (
        ["--max-model-len", "-1"],
        "argument --max-model-len: '-1' (vLLM: as long as memory allows) is not supported",
    ),
    (["--max-model-len", "1.5K"], "argument --max-model-len: a decimal needs a lower case"),
    (["--swap-space", "-1"], "--swap-space must be a number of GiB >= 0"),
    (
        ["--speculative-config", '{"method": "ngram"}'],
        "argument --speculative-config: speculative_config.method 'ngram' is not supported",
    ),
]


@pytest.mark.parametrize(("flags", "sets"), ACCEPTED)
def test_vllm_flags_that_deltaserve_honours(tmp_path, flags, sets):
    args = serve.parse_args([str(tmp_path), *flags])
    config, server_config = engine_config(args), serve._server_config(args)
    for name, value in sets.items():
        assert getattr(server_config if name == "seed" else config, name) == value


@pytest.mark.parametrize(("flags", "words"), REFUSED)
def test_vllm_flags_that_deltaserve_cannot_honour(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as info:
        serve.parse_args([str(tmp_path), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {words}" in err, err


@pytest.fixture
def aiohttp_log_level():
    import logging

    logger = logging.getLogger("aiohttp")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_uvicorn_log_level_sets_the_http_servers(
    tiny_model_dir, taken_port, engine_starts, aiohttp_log_level
):
    """vLLM's --uvicorn-log-level is the HTTP server's log level: here aiohttp's loggers'."""
    import logging

    serve.serve_main(
        [str(tiny_model_dir), "--port", str(taken_port), "--uvicorn-log-level", "error"]
    )
    assert aiohttp_log_level.level == logging.ERROR
    serve.serve_main(
        [str(tiny_model_dir), "--port", str(taken_port), "--uvicorn-log-level", "TRACE"]
    )
    assert aiohttp_log_level.level == logging.DEBUG
