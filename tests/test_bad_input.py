"""Bad input against the real server (engine, rank process, aiohttp app on 127.0.0.1): every
malformed, oversized or out-of-range request gets a 4xx whose message names the problem, and
the server stays healthy (an autouse fixture checks /health and that nothing stays on the
rank after every test).

- hand-picked cases: oversized body, invalid UTF-8, lone surrogates, deep nesting, huge
  n / max_tokens / logprobs / seed, token ids out of the vocabulary, ...;
- property-based fuzzing (hypothesis) of both endpoints' JSON bodies and of raw bytes: the
  answer is 200 (a valid request, fully served) or a 4xx OpenAI error body, never a 5xx;
- the same parsers without a server, many more examples: whatever they accept becomes
  sampling parameters that the control plane can encode (a huge top_k once killed the engine);
- `--api-key` is enforced on every /v1 route and method, and on no other (as vLLM).

`pytest --long` runs the fuzzers with 10x the examples.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import get, in_process_server, wait_idle

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.sampling_params import MAX_SEED, ParamError, SamplingParams
from deltaserve.http.errors import ApiError
from deltaserve.http.protocol import parse_chat_request, parse_completion_request
from deltaserve.http.server import ServerConfig, build_app
from deltaserve.ipc.messages import command_encoder

aio = pytest.mark.asyncio(loop_scope="module")  # one server for the module

API_KEY = "sk-bad-input"
MODEL = "tiny-bad"
MAX_MODEL_LEN = 48
MAX_BODY = 64 * 1024
VOCAB = 248320
HUGE = 10**30
QUICK_EXAMPLES, LONG_EXAMPLES = 40, 400


SERVER_CONFIG = ServerConfig(
    MODEL,
    api_key=API_KEY,
    max_request_bytes=MAX_BODY,
    enable_admin_routes=True,
    enable_sleep_mode=True,
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_queued_requests=64,
    )
    async with in_process_server(config, SERVER_CONFIG) as s:
        yield s


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def stays_healthy(server):
    yield
    await wait_idle(server.engine, timeout_s=30)
    assert (await get(server.url + "/health"))[0] == 200


@pytest.fixture
def examples(request: pytest.FixtureRequest) -> int:
    return LONG_EXAMPLES if request.config.getoption("--long") else QUICK_EXAMPLES


async def post(url: str, data: bytes, key: str | None = API_KEY) -> tuple[int, str, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(url, data=data, headers=headers) as r,
    ):
        return r.status, r.headers.get("Content-Type", ""), await r.read()


def check_error_body(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    return err


def j(obj: object) -> bytes:
    return json.dumps(obj).encode()


C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
# (path, body bytes, status, param or None, words the message must contain)
CASES = {
    "oversized body": (C, b'{"prompt": "' + b"a" * MAX_BODY + b'"}', 413, None, str(MAX_BODY)),
    "invalid utf-8": (C, b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    "lone surrogate": (C, b'{"prompt": "\\ud800"}', 400, None, "not valid JSON"),
    "deep nesting": (C, b"[" * 20_000 + b"]" * 20_000, 400, None, "nested too deeply"),
    "huge integer literal": (
        C,
        b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}",
        400,
        None,
        "out of range",
    ),
    "truncated": (C, b'{"prompt": "x",', 400, None, "not valid JSON"),
    "empty body": (C, b"", 400, None, "not valid JSON"),
    "not an object": (CHAT, b'["hi"]', 400, None, "JSON object"),
    "huge n": (C, j({"prompt": "x", "n": HUGE}), 400, "n", "n must be"),
    "huge max_tokens": (C, j({"prompt": "x", "max_tokens": HUGE}), 400, None, "max_tokens"),
    "negative max_tokens": (
        C,
        j({"prompt": "x", "max_tokens": -1}),
        400,
        "max_tokens",
        "max_tokens must",
    ),
    "max_completion_tokens 0": (
        CHAT,
        j({"messages": USER, "max_completion_tokens": 0}),
        400,
        "max_completion_tokens",
        ">= 1",
    ),
    "user not a string": (C, j({"prompt": "x", "user": 123}), 400, "user", "string"),
    "chat user not a string": (CHAT, j({"messages": USER, "user": ["u"]}), 400, "user", "string"),
    "huge logprobs": (C, j({"prompt": "x", "logprobs": HUGE}), 400, "logprobs", "0..20"),
    "logprobs past max_logprobs": (C, j({"prompt": "x", "logprobs": 21}), 400, "logprobs", "0..20"),
    "top_logprobs past max_logprobs": (
        CHAT,
        j({"messages": USER, "logprobs": True, "top_logprobs": 25}),
        400,
        "top_logprobs",
        "0..20",
    ),
    "huge top_logprobs": (
        CHAT,
        j({"messages": USER, "logprobs": True, "top_logprobs": HUGE}),
        400,
        "top_logprobs",
        "0..20",
    ),
    "huge max_completion_tokens": (
        CHAT,
        j({"messages": USER, "max_completion_tokens": HUGE}),
        400,
        None,
        "max_model_len",
    ),
    "huge seed": (C, j({"prompt": "x", "seed": 2**64}), 400, "seed", "seed must be"),
    "seed below int64": (C, j({"prompt": "x", "seed": -(2**63) - 1}), 400, "seed", "seed must be"),
    # A forced tool_choice needs tools.
    "tool_choice required": (
        CHAT,
        j({"messages": USER, "tool_choice": "required"}),
        400,
        "tool_choice",
        "tool",
    ),
    "tool_choice named": (
        CHAT,
        j({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        400,
        "tool_choice",
        "tool",
    ),
    # this server has no --enable-auto-tool-choice (tests/test_http_tools.py runs one that has)
    "tools with tool_choice auto": (
        CHAT,
        j(
            {
                "messages": USER,
                "tool_choice": "auto",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            }
        ),
        400,
        "tool_choice",
        "--enable-auto-tool-choice",
    ),
    "tool_choice auto, no tools": (
        CHAT,
        j({"messages": USER, "tool_choice": "auto"}),
        400,
        "tool_choice",
        "`tools` must be set",
    ),
    "tools []": (
        CHAT,
        j({"messages": USER, "tool_choice": "auto", "tools": []}),
        400,
        "tools",
        "empty array",
    ),
    "continuous_usage_stats not a bool": (
        CHAT,
        j({"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": 0}}),
        400,
        "stream_options.continuous_usage_stats",
        "boolean",
    ),
    "prompt id = vocab": (C, j({"prompt": [VOCAB]}), 400, "prompt", f"[0, {VOCAB})"),
    "prompt id 2**64": (C, j({"prompt": [1, 2**64]}), 400, "prompt", f"[0, {VOCAB})"),
    "negative prompt id": (C, j({"prompt": [-1]}), 400, "prompt", "non-negative"),
    "bad id in 2nd prompt": (
        C,
        j({"prompt": ["x", [5, VOCAB + 5]]}),
        400,
        "prompt",
        f"[0, {VOCAB})",
    ),
    "stop id out of vocab": (
        C,
        j({"prompt": "x", "stop_token_ids": [HUGE]}),
        400,
        "stop_token_ids",
        "vocabulary",
    ),
    "prompt longer than the model": (
        C,
        j({"prompt": list(range(1, MAX_MODEL_LEN + 1))}),
        400,
        None,
        "max_model_len",
    ),
    "chat longer than the model": (
        CHAT,
        j({"messages": [{"role": "user", "content": "word " * 200}]}),
        400,
        "messages",
        "max_model_len",
    ),  # was param "prompt"
    # More choices in one request than the queue can ever hold: refused (was a 429 forever).
    "more prompts than the queue holds": (
        C,
        j({"prompt": ["x"] * 65, "max_tokens": 1}),
        400,
        "prompt",
        "max_queued_requests",
    ),
    "prompts x n past the queue": (
        C,
        j({"prompt": [[5]] * 17, "n": 4, "max_tokens": 1}),
        400,
        "prompt",
        "max_queued_requests",
    ),
    # vLLM's priority needs the priority policy (as vLLM refuses it): not ignored
    "priority under fcfs": (
        CHAT,
        j({"messages": USER, "priority": 3}),
        400,
        "priority",
        "--scheduling-policy priority",
    ),
    "priority not an integer": (
        C,
        j({"prompt": "x", "priority": "high"}),
        400,
        "priority",
        "integer",
    ),
    # apply_chat_template's own options are not template variables: refused, not ignored.
    "chat_template_kwargs truncation": (
        CHAT,
        j({"messages": USER, "chat_template_kwargs": {"truncation": True, "max_length": 2}}),
        400,
        "chat_template_kwargs.truncation",
        "reserved",
    ),
    # An integer literal past the float range (json reads it exactly) in a float field (was a 500).
    "temperature huge integer": (
        C,
        b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
        400,
        "temperature",
        "finite",
    ),
    "chat top_p huge integer": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -1' + b"0" * 400 + b"}",
        400,
        "top_p",
        "finite",
    ),
    "unknown field": (
        C,
        j({"prompt": "x", "logits_processors": ["a"]}),
        400,
        "logits_processors",
        "unknown",
    ),
    # vLLM's sampling extras, honoured: refused only where vLLM refuses them
    "min_tokens past max_tokens": (
        C,
        j({"prompt": "x", "min_tokens": 17}),
        400,
        "min_tokens",
        "max_tokens=16",
    ),
    "logit_bias id out of vocab": (
        CHAT,
        j({"messages": USER, "logit_bias": {str(VOCAB): 1}}),
        400,
        "logit_bias",
        f"[{VOCAB}]",
    ),
    "logit_bias huge id": (
        C,
        j({"prompt": "x", "logit_bias": {"9" * 12: 1}}),
        400,
        "logit_bias",
        "vocabulary",
    ),
    "logit_bias 5000-digit id": (
        C,
        j({"prompt": "x", "logit_bias": {"9" * 5000: 1}}),
        400,
        "logit_bias",
        "not a token id",
    ),
    "logit_bias NaN": (
        C,
        b'{"prompt": "x", "logit_bias": {"5": NaN}}',
        400,
        "logit_bias",
        "finite",
    ),
    "stream not a bool": (C, j({"prompt": "x", "stream": "yes"}), 400, "stream", "boolean"),
    "temperature nan-ish string": (
        C,
        j({"prompt": "x", "temperature": "NaN"}),
        400,
        "temperature",
        "number",
    ),
    # Non-finite numbers (NaN and Infinity are not JSON, 1e400 overflows a float) are refused
    # naming the field, on both routes.
    "temperature NaN": (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "finite"),
    "temperature 1e400": (
        C,
        b'{"prompt": "x", "temperature": 1e400}',
        400,
        "temperature",
        "finite",
    ),
    "top_p Infinity": (C, b'{"prompt": "x", "top_p": Infinity}', 400, "top_p", "finite"),
    "min_p -Infinity": (C, b'{"prompt": "x", "min_p": -Infinity}', 400, "min_p", "finite"),
    "presence_penalty NaN": (
        C,
        b'{"prompt": "x", "presence_penalty": NaN}',
        400,
        "presence_penalty",
        "finite",
    ),
    "frequency_penalty -1e400": (
        C,
        b'{"prompt": "x", "frequency_penalty": -1e400}',
        400,
        "frequency_penalty",
        "finite",
    ),
    "repetition_penalty Infinity": (
        C,
        b'{"prompt": "x", "repetition_penalty": Infinity}',
        400,
        "repetition_penalty",
        "finite",
    ),
    "chat temperature Infinity": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
        400,
        "temperature",
        "finite",
    ),
    "chat top_p NaN": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
        400,
        "top_p",
        "finite",
    ),
    "chat repetition_penalty 1e400": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e400}',
        400,
        "repetition_penalty",
        "finite",
    ),
    "max_tokens Infinity": (
        C,
        b'{"prompt": "x", "max_tokens": Infinity}',
        400,
        "max_tokens",
        "integer",
    ),
    "NaN token id": (C, b'{"prompt": [1, NaN]}', 400, "prompt", "non-negative"),
    "NaN beside a lone surrogate": (
        C,
        b'{"prompt": "\\ud800", "temperature": NaN}',
        400,
        None,
        "not valid JSON",
    ),
}


@aio
@pytest.mark.parametrize("case", list(CASES))
async def test_bad_request_named(server, case):
    path, data, status, param, words = CASES[case]
    got, content_type, raw = await post(server.url + path, data)
    assert got == status, raw[:300]
    assert content_type.startswith("application/json")
    err = check_error_body(raw)
    if param is not None:
        assert err["param"] == param, err
    assert words in err["message"], err


@aio
@pytest.mark.parametrize(
    "encoding,data", [("gzip", b"not gzip at all"), ("deflate", b"0123456789")]
)
async def test_body_its_content_encoding_does_not_decode(server, encoding, data):
    """A body that its Content-Encoding does not decode is the client's error (was a 500)."""
    headers = {
        "Content-Type": "application/json",
        "Content-Encoding": encoding,
        "Authorization": f"Bearer {API_KEY}",
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + C, data=data, headers=headers) as r,
    ):
        assert r.status == 400, await r.read()
        assert "could not be read" in check_error_body(await r.read())["message"]
    assert (await get(server.url + "/health"))[0] == 200


@aio
async def test_huge_top_k_means_off_and_the_engine_lives(server):
    """top_k past the vocabulary, or -1 (vLLM's "off"), samples as if top-k were off (same
    seed, same tokens); before the fix, a top_k over 2**64 could not be encoded and killed the
    engine."""
    base = {
        "prompt": "Sphinx of black quartz",
        "max_tokens": 4,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": 0,
        "ignore_eos": True,
    }
    texts = []
    for top_k in (0, 2**40, HUGE, -1):
        status, _, raw = await post(server.url + C, j({**base, "top_k": top_k}))
        assert status == 200, raw
        texts.append(json.loads(raw)["choices"][0]["logprobs"]["tokens"])
    assert texts[0] == texts[1] == texts[2] == texts[3]
    assert not server.engine.is_dead


# What vLLM accepts and clients send, each a no-op or honoured here: served, not refused.
VLLM_DEFAULTS = {
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "min_tokens": 0,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "priority": 0,
    "return_tokens_as_token_ids": False,
}
SYSTEM_HI = [{"role": "system", "content": "Be brief."}, *USER]
ACCEPTED = {
    "negative seed": (C, {"prompt": "x", "seed": -1, "temperature": 1.0}),
    "int64 min seed": (C, {"prompt": "x", "seed": -(2**63), "n": 2, "temperature": 1.0}),
    # tools with tool_choice "none" (rendered, no calls read): tests/test_http_tools.py; here the
    # demo template's tool listing alone is longer than this server's max_model_len
    "developer role": (CHAT, {"messages": [{"role": "developer", "content": "Be brief."}, *USER]}),
    "continuous_usage_stats true": (
        C,
        {
            "prompt": "x",
            "stream": True,
            "stream_options": {"continuous_usage_stats": True, "include_usage": True},
        },
    ),
    "continuous_usage_stats false": (
        C,
        {
            "prompt": "x",
            "stream": True,
            "stream_options": {"continuous_usage_stats": False, "include_usage": True},
        },
    ),
    "chat continuous_usage_stats false": (
        CHAT,
        {"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": False}},
    ),
    # vLLM's extra fields at their defaults, as clients send them (each a no-op here too)
    "vLLM extras at their defaults": (
        C,
        {"prompt": "x", **VLLM_DEFAULTS, "add_special_tokens": True},
    ),
    "chat vLLM extras at their defaults": (
        CHAT,
        {
            "messages": USER,
            **VLLM_DEFAULTS,
            "add_special_tokens": False,
            "add_generation_prompt": True,
            "continue_final_message": False,
        },
    ),
    # history as clients send it back: a name, the SDK's model_dump() of a reply (its
    # response-only fields null), an assistant message with null content
    "chat replayed history": (
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "hi", "name": "alice"},
                {
                    "role": "assistant",
                    "content": "Hello",
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": None,
                },
                {"role": "assistant", "content": None},
                *USER,
            ]
        },
    ),
}


@aio
@pytest.mark.parametrize("case", list(ACCEPTED))
async def test_accepted_as_vllm_accepts(server, case):
    path, body = ACCEPTED[case]
    status, content_type, raw = await post(server.url + path, j({"max_tokens": 2, **body}))
    assert status == 200, raw[:300]
    check_served(status, content_type, raw)


@aio
async def test_negative_seeds_are_distinct_and_reproducible(server):
    """Any int64 seed is taken, as vLLM takes it: the same seed gives the same tokens, and a
    negative seed does not share its stream with a non-negative one (its wire seed is the
    seed modulo 2**64; modulo 2**63, -1 was 2**63 - 1 and -2**63 was 0)."""
    base = {
        "prompt": "Sphinx of black quartz",
        "max_tokens": 4,
        "temperature": 1.0,
        "logprobs": 0,
        "ignore_eos": True,
    }
    tokens = {}
    for seed in (-1, -1, 2**63 - 1, -(2**63), 0):
        status, _, raw = await post(server.url + C, j({**base, "seed": seed}))
        assert status == 200, raw
        got = json.loads(raw)["choices"][0]["logprobs"]["tokens"]
        assert tokens.setdefault(seed, got) == got  # the same seed twice: the same tokens
    assert tokens[-1] != tokens[2**63 - 1] and tokens[-(2**63)] != tokens[0]


@aio
async def test_developer_role_is_a_system_message(server):
    """OpenAI's `developer` role renders as `system` (the Qwen template knows no other): the
    same prompt (usage, greedy tokens and their logprobs) as the system message."""
    answers = []
    for role in ("developer", "system"):
        body = {
            "messages": [{"role": role, "content": "Be brief."}, *USER],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
        }
        status, _, raw = await post(server.url + CHAT, j(body))
        assert status == 200, raw
        answer = json.loads(raw)
        answers.append(
            (answer["usage"], answer["choices"][0]["message"], answer["choices"][0]["logprobs"])
        )
    assert answers[0] == answers[1]


# ---- fuzzing -----------------------------------------------------------------------------

_ints = st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, VOCAB])
_floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e-320, 1e308, -0.0])
_scalars = st.none() | st.booleans() | _ints | _floats | st.text(max_size=12)
JSON = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
_ids = st.lists(st.integers(-2, VOCAB + 2), max_size=8)
_small = st.integers(-2, 24)
PLAUSIBLE = {
    "model": st.sampled_from([MODEL, "other", ""]),
    "prompt": st.text(max_size=30) | _ids | st.lists(st.text(max_size=8) | _ids, max_size=3),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x"])},
            optional={
                "content": st.text(max_size=20)
                | st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["text", "image_url"]),
                            "text": st.text(max_size=8),
                        }
                    ),
                    max_size=2,
                ),
                "name": st.none() | st.text(max_size=4),
            },
        ),
        max_size=4,
    ),
    "max_tokens": _small | st.just(HUGE),
    "max_completion_tokens": _small,
    "n": st.integers(-1, 17),
    "logprobs": st.integers(-1, 21) | st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "temperature": st.floats(-1, 3) | st.just(0),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-1, 10**25),
    "min_p": st.floats(-0.5, 1.5),
    "seed": _ints,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": _ids,
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {},
        optional={"include_usage": st.booleans() | _ints, "continuous_usage_stats": st.booleans()},
    ),
    "tool_choice": st.sampled_from(
        ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]
    ),
    "tools": st.just([]) | st.just([{"type": "function", "function": {"name": "f"}}]),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "echo": st.booleans(),
    "best_of": st.integers(0, 3),
    "logit_bias": st.dictionaries(
        st.text(max_size=3) | st.integers(0, VOCAB + 2).map(str), _ints | _floats, max_size=2
    ),
    "min_tokens": st.integers(-2, 24),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "tools", "x"]), JSON, max_size=2
    ),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "user": JSON,
}


VALID = {
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50) | st.just(HUGE),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 2),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=2),
    "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "model": st.just(MODEL),
    "min_tokens": st.integers(0, 1),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(
        st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3
    ),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
}
VALID_PROMPT = st.text(min_size=1, max_size=20) | st.lists(
    st.integers(0, VOCAB - 1), min_size=1, max_size=8
)
VALID_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer"]),
            "content": st.text(max_size=16),
        }
    ),
    min_size=1,
    max_size=3,
)


def valid_bodies(required: str) -> st.SearchStrategy[dict]:
    """Bodies that should be served: every field in range (a chat template may still refuse
    an odd order of roles)."""
    first = {"prompt": VALID_PROMPT, "messages": VALID_MESSAGES}[required]
    return st.fixed_dictionaries(
        {required: first, "max_tokens": VALID["max_tokens"]},
        optional={k: v for k, v in VALID.items() if k != "max_tokens"},
    )


def bodies(required: str) -> st.SearchStrategy[dict]:
    """Bodies with the required field, any subset of the known ones (plausible or arbitrary
    values), and now and then an unknown field."""
    optional = {k: v | JSON for k, v in PLAUSIBLE.items() if k != required}
    optional["some_unknown_field"] = JSON
    return st.fixed_dictionaries({required: PLAUSIBLE[required] | JSON}, optional=optional)


def check_served(status: int, content_type: str, raw: bytes) -> None:
    """200 with a complete response, or a 4xx error body: never a 5xx, never a stream that
    ends without [DONE] or with an error event."""
    assert status == 200 or 400 <= status < 500, (status, raw[:500])
    if status != 200:
        check_error_body(raw)
    elif content_type.startswith("text/event-stream"):
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", raw[-300:]
        for e in events[:-1]:
            assert b'"error"' not in e[:12], e
    else:
        assert json.loads(raw)["choices"], raw[:300]


def run_fuzz(
    server, loop: asyncio.AbstractEventLoop, path: str, strategy, examples: int
) -> list[int]:
    """Hypothesis in a worker thread; each example posts through the server's loop. Returns
    the statuses seen."""
    statuses = []

    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def one(data: bytes) -> None:
        future = asyncio.run_coroutine_threadsafe(post(server.url + path, data), loop)
        result = future.result(timeout=120)
        statuses.append(result[0])
        check_served(*result)

    one()
    return statuses


@aio
@pytest.mark.parametrize("path, required", [(C, "prompt"), (CHAT, "messages")])
async def test_fuzz_json_bodies(server, examples, path, required):
    """Half the bodies are valid (served in full), half anything (refused with a 4xx)."""
    strategy = (valid_bodies(required) | bodies(required)).map(j)
    loop = asyncio.get_running_loop()
    statuses = await asyncio.to_thread(run_fuzz, server, loop, path, strategy, examples)
    assert 200 in statuses and any(400 <= s < 500 for s in statuses), statuses


@aio
async def test_fuzz_raw_bytes(server, examples):
    """Arbitrary bytes, and valid bodies with bytes flipped, cut or inserted."""
    valid = j({"prompt": "hi", "max_tokens": 2, "temperature": 0})

    def mutate(draw_data: tuple[int, int, bytes]) -> bytes:
        at, cut, insert = draw_data
        at %= len(valid)
        return valid[:at] + insert + valid[at + cut :]

    mutated = st.tuples(st.integers(0, 10**6), st.integers(0, 4), st.binary(max_size=4)).map(mutate)
    strategy = st.binary(max_size=64) | mutated
    loop = asyncio.get_running_loop()
    for path in (C, CHAT):
        await asyncio.to_thread(run_fuzz, server, loop, path, strategy, examples)


@pytest.mark.parametrize(
    "parse, required", [(parse_completion_request, "prompt"), (parse_chat_request, "messages")]
)
def test_fuzz_parsers_accept_only_encodable_params(request, parse, required):
    """No server: whatever a parser accepts is SamplingParams (each refusal an ApiError naming
    the field) whose wire form the control plane can encode."""
    examples = 5 * (LONG_EXAMPLES if request.config.getoption("--long") else QUICK_EXAMPLES)

    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(valid_bodies(required) | bodies(required))
    def one(body: dict) -> None:
        try:
            req = parse(body)
        except ApiError as err:
            assert 400 <= err.status < 500 and err.message
            return
        try:  # a chat's max_tokens None: what the context leaves, as the engine resolves it
            params = req.sampling.resolve_max_tokens(1, 17)
        except ParamError as exc:  # min_tokens past it: the engine's refusal, naming it
            assert exc.param == "min_tokens", exc
            return
        assert isinstance(params, SamplingParams)
        if not params.is_prepared:  # compiled by AsyncEngine.prepare first (test_guided_engine)
            assert params.constraint() is not None or params.stop_regex
            return
        for seed in (0, MAX_SEED):  # the wire seeds' range
            command_encoder.encode(params.to_spec(seed=seed))

    one()


# ---- API key -----------------------------------------------------------------------------


OPEN = ("/health", "/ping", "/version", "/metrics")


@aio
async def test_api_key_on_every_route_but_the_probes(server):
    """Every route needs the key, whatever the method, and so does a path no route serves;
    /health, /ping, /version and /metrics answer as they do with the key, never 401 (a
    Prometheus scrape of /metrics got 401). The admin routes (routed here) take it too. The
    key is taken as a bearer token or as Anthropic's x-api-key."""
    app = build_app(server.engine, SERVER_CONFIG)  # the route table
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()}
    routes |= {
        ("GET", "/nope"),
        ("POST", "/v1/nope"),
        ("DELETE", "/v1/models"),
        ("GET", "/v1"),
        ("OPTIONS", "/v1/completions"),
        ("PUT", "/health/x"),
        ("POST", "/metrics"),
    }
    assert {("POST", "/v1/completions"), ("GET", "/metrics"), ("POST", "/sleep")} <= routes
    wrong = [
        None,
        "Bearer wrong",
        f"Basic {API_KEY}",
        API_KEY,
        f"Bearer {API_KEY}x",
        f"Bearer{API_KEY}",
        "Bearer ",
        f"Bearer {API_KEY}\u00e9",
    ]  # non-ASCII: was a 500
    ok = {"Authorization": f"Bearer {API_KEY}"}
    body = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        for method, path in sorted(routes):
            async with s.request(method, server.url + path, headers={**ok, **body}, data=b"{") as r:
                with_key = r.status
            await awake_and_going(server.engine)  # POST /sleep or /pause with the key
            async with s.request(
                method, server.url + path, headers={"x-api-key": API_KEY, **body}, data=b"{"
            ) as r:
                assert r.status == with_key, (method, path, "x-api-key")
            await awake_and_going(server.engine)
            for auth in [
                *wrong,
                {"x-api-key": "wrong"},
                {"x-api-key": API_KEY + "x", "Authorization": "Bearer x"},
            ]:
                headers = (
                    auth
                    if isinstance(auth, dict)
                    else {}
                    if auth is None
                    else {"Authorization": auth}
                )
                async with s.request(
                    method, server.url + path, headers={**headers, **body}, data=b"{"
                ) as r:
                    answer = await r.read()
                if path in OPEN:
                    assert r.status == with_key != 401, (method, path, auth, r.status)
                    continue
                assert r.status == 401, (method, path, auth, r.status)
                if method != "HEAD":
                    assert check_error_body(answer)["code"] == "invalid_api_key"
        for path, status in (
            ("/v1/models", 200),
            ("/metrics", 200),
            ("/version", 200),
            ("/nope", 404),
        ):
            async with s.get(server.url + path, headers=ok) as r:
                assert r.status == status, path
        async with s.post(server.url + C, headers={**ok, **body}, data=b"{") as r:
            assert r.status == 400  # past the key check, the body is looked at


async def awake_and_going(engine) -> None:
    """Undo what an admin route called with the key did: a sleep, a pause."""
    if engine.is_sleeping:
        await engine.wake_up()
    if engine.is_paused:
        engine.resume()


@aio
@pytest.mark.parametrize("bad", [[1] * MAX_MODEL_LEN, [VOCAB]])
async def test_refused_prompt_list_counts_nothing(server, bad):
    """A completion of several prompts refused for one of them (too long, an id outside the
    vocabulary) submits none: the prompts before it were opened, closed again and counted
    as aborts in /metrics (vLLM checks every prompt first and counts nothing)."""
    before = dict(server.engine.metrics.request_success_total)
    status, _, raw = await post(
        server.url + C, j({"prompt": [[1, 2, 3], [4, 5], bad], "max_tokens": 2, "n": 2})
    )
    assert status == 400 and b'"param":"prompt"' in raw, raw
    await wait_idle(server.engine)
    assert server.engine.metrics.request_success_total == before
