"""The OpenAI-compatible server end to end: a real AsyncEngine (rank process, ZeroMQ, shared
memory) behind the aiohttp app on 127.0.0.1, driven by the official `openai` client.

One server per module (startup costs seconds); every test ends with the engine idle and the
rank holding nothing (checked by an autouse fixture), so a leak is caught where it happens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from engine_helpers import reference_tokens
from router_structs import VLLM_ROUTER_CHAT, VLLM_ROUTER_COMPLETION
from serve_helpers import metric_samples, wait_idle

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import FinishedEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.listen import start_server
from deltaserve.http.responses import TokenStrings
from deltaserve.http.server import ServerConfig, build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

API_KEY = "sk-deltaserve-test"
MODEL = "tiny-test"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 2
MAX_QUEUED = 4
MAX_BODY = 64 * 1024
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
LONG = 1500  # max_tokens of requests that must still be running when the test acts


@dataclass
class Served:
    engine: AsyncEngine
    url: str  # http://127.0.0.1:PORT
    client: openai.AsyncOpenAI
    tokenizer: Any
    strings: TokenStrings
    model_dir: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_queued_requests=MAX_QUEUED,
    )
    engine = await AsyncEngine.start(config)
    app = build_app(engine, ServerConfig(MODEL, api_key=API_KEY, max_request_bytes=MAX_BODY))
    runner, _ = await start_server(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    try:
        yield Served(
            engine,
            url,
            client,
            engine.tokenizer,
            TokenStrings(engine.tokenizer),
            str(tiny_model_dir),
        )
    finally:
        await client.close()
        await runner.cleanup()
        await engine.shutdown()


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def nothing_leaks(served):
    yield
    await wait_idle(served.engine)
    async with aiohttp.ClientSession() as s, s.get(served.url + "/health") as r:
        assert r.status == 200, await r.text()


async def engine_run(engine: AsyncEngine, prompt, params: SamplingParams) -> dict[int, list]:
    """The engine's own events per choice, for comparison with what HTTP returned."""
    out: dict[int, list] = {}
    async for ev in engine.generate(prompt, params):
        out.setdefault(ev.index, []).append(ev)
    return out


def prompt_ids(served: Served, text: str) -> list[int]:
    return served.tokenizer.encode(text, add_special_tokens=False)


async def metrics(served: Served) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as s, s.get(served.url + "/metrics", headers=headers) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    return metric_samples(text, MODEL)


# ---- completions -------------------------------------------------------------------------


async def test_completion_greedy_matches_engine_and_generate(served: Served):
    """Greedy tokens, logprobs (shape and values), text and usage equal the engine's own
    generate and the plain single-process path (`reference_tokens`)."""
    n_tokens, k = 12, 3
    ids = prompt_ids(served, PROMPT)
    ref = reference_tokens(served.model_dir, ids, n_tokens, num_logprobs=k)
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, logprobs=k, ignore_eos=True)
    events = (await engine_run(served.engine, PROMPT, params))[0]
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == [s.token_id for s in ref]

    r = await served.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=n_tokens,
        temperature=0,
        logprobs=k,
        extra_body={"ignore_eos": True},
    )
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert choice.text == served.tokenizer.decode(
        [s.token_id for s in ref], skip_special_tokens=True
    )
    lp = choice.logprobs
    assert lp.tokens == [served.strings.text(s.token_id) for s in ref]
    assert lp.token_logprobs == pytest.approx([s.logprob for s in ref], abs=1e-3)
    for top, sample in zip(lp.top_logprobs, ref, strict=True):
        expected = {served.strings.text(t): v for t, v in sample.top_logprobs}
        expected.setdefault(served.strings.text(sample.token_id), sample.logprob)
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-3)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(n_tokens)]  # as vLLM's
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n_tokens)
    assert r.usage.total_tokens == len(ids) + n_tokens

    # Streamed: the same text and logprobs in pieces, then the usage chunk.
    stream = await served.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=n_tokens,
        temperature=0,
        logprobs=k,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, tokens, offsets, finish, usage = "", [], [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            offsets += c.logprobs.text_offset
        finish = c.finish_reason or finish
    assert (text, tokens, offsets, finish) == (choice.text, lp.tokens, lp.text_offset, "length")
    assert usage == r.usage


async def test_prompt_as_token_ids_and_list_of_prompts_with_n2(served: Served):
    """Choices are indexed prompt-major (p * n + i); prompt tokens are counted once per
    prompt; seeded choice i of a prompt equals choice i of that prompt sent alone."""
    ids_b = prompt_ids(served, "Pack my box with five dozen liquor jugs.")
    kwargs = dict(
        model=MODEL, max_tokens=4, temperature=0.9, seed=11, n=2, extra_body={"ignore_eos": True}
    )
    both = await served.client.completions.create(
        prompt=["Sphinx of black quartz", ids_b], **kwargs
    )
    a = await served.client.completions.create(prompt="Sphinx of black quartz", **kwargs)
    b = await served.client.completions.create(prompt=ids_b, **kwargs)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [c.text for c in a.choices + b.choices]
    assert a.choices[0].text != a.choices[1].text  # seed + index: different samples
    assert (
        both.usage.prompt_tokens
        == a.usage.prompt_tokens + b.usage.prompt_tokens
        == (len(prompt_ids(served, "Sphinx of black quartz")) + len(ids_b))
    )
    assert both.usage.completion_tokens == 16

    stream = await served.client.completions.create(
        prompt=["Sphinx of black quartz", ids_b], stream=True, **kwargs
    )
    texts = [""] * 4
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in both.choices]


async def test_seed_reproducible(served: Served):
    kwargs = dict(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True}
    )
    one = await served.client.completions.create(seed=123, **kwargs)
    two = await served.client.completions.create(seed=123, **kwargs)
    other = await served.client.completions.create(seed=124, **kwargs)
    assert one.choices[0].text == two.choices[0].text
    assert other.choices[0].text != one.choices[0].text


async def test_stop_strings_and_stop_token_ids(served: Served):
    kwargs = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    base = (await served.client.completions.create(**kwargs)).choices[0]
    text, offsets = base.text, base.logprobs.text_offset
    # A stop string spanning the boundary between tokens 4 and 5.
    start = offsets[5] - 1
    stop = text[start : start + 3]
    cut = await served.client.completions.create(stop=[stop, "never-seen"], **kwargs)
    # vLLM's field
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = [
        c async for c in await served.client.completions.create(stream=True, stop=[stop], **kwargs)
    ]
    assert streamed[-1].choices[0].stop_reason == stop and base.stop_reason is None
    # text held back for a stop string that never comes does not move the offsets (it did)
    held = (
        await served.client.completions.create(stop=["a stop string never seen"], **kwargs)
    ).choices[0]
    assert (held.text, held.logprobs.text_offset) == (text, offsets)

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = (await engine_run(served.engine, PROMPT, params))[0]
    tokens = [e.token_id for e in ref if isinstance(e, TokenEvent)]
    body = dict(kwargs)
    body["extra_body"] = {"ignore_eos": True, "stop_token_ids": [tokens[3]]}
    by_id = await served.client.completions.create(**body)
    first = tokens.index(tokens[3])
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].stop_reason == tokens[3]
    chat = dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0
    )
    said = (await served.client.chat.completions.create(**chat)).choices[0].message.content
    cut_chat = (await served.client.chat.completions.create(stop=[said[3:6]], **chat)).choices[0]
    assert len(said) >= 6 and (cut_chat.finish_reason, cut_chat.stop_reason) == ("stop", said[3:6])
    assert by_id.usage.completion_tokens == first + 1  # the stop token is generated ...
    assert by_id.choices[0].text == served.tokenizer.decode(
        tokens[:first], skip_special_tokens=True
    )  # ... not shown


# ---- chat --------------------------------------------------------------------------------


async def test_chat_matches_engine_streamed_and_not(served: Served):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ]
    text = served.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids = served.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    ref = [
        e for e in (await engine_run(served.engine, ids, params))[0] if isinstance(e, TokenEvent)
    ]

    kwargs = dict(
        model=MODEL,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    r = await served.client.chat.completions.create(messages=messages, **kwargs)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == "".join(e.text for e in ref)
    content = choice.logprobs.content
    assert [c.token for c in content] == [served.strings.text(e.token_id) for e in ref]
    assert [c.bytes for c in content] == [served.strings.bytes(e.token_id) for e in ref]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref], abs=1e-3)
    for c, e in zip(content, ref, strict=True):
        assert [t.token for t in c.top_logprobs] == [
            served.strings.text(t) for t, _ in e.top_logprobs
        ]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(
            [v for _, v in e.top_logprobs], abs=1e-3
        )
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)

    # Content parts are joined as text; the same conversation, streamed.
    parts = [
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]},
    ]
    stream = await served.client.chat.completions.create(
        messages=parts, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    assert chunks[-2].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert streamed == choice.message.content
    lps = [x for c in chunks[:-1] if c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.token for x in lps] == [c.token for c in content]


async def test_chat_n2_and_default_max_tokens(served: Served):
    """n=2 gives two choices; without max_tokens a chat may use the context left (here it
    ends at a stop token id instead)."""
    messages = [{"role": "user", "content": "hi"}]
    r = await served.client.chat.completions.create(
        model=MODEL, messages=messages, n=2, seed=3, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 12

    text = served.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids = served.tokenizer.encode(text, add_special_tokens=False)
    ref = (await engine_run(served.engine, ids, SamplingParams(max_tokens=4, temperature=0)))[0]
    tokens = [e.token_id for e in ref if isinstance(e, TokenEvent)]
    stream = await served.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"stop_token_ids": [tokens[2]]},
    )
    chunks = [c async for c in stream]
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == tokens.index(tokens[2]) + 1


# ---- other routes, metrics ---------------------------------------------------------------


async def test_models_version_and_metrics(served: Served):
    models = await served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == MAX_MODEL_LEN  # the KV cache holds more
    async with (
        aiohttp.ClientSession() as s,
        s.get(served.url + "/version", headers={"Authorization": f"Bearer {API_KEY}"}) as r,
    ):
        assert (await r.json())["version"]
    # 7 tokens take 7 steps, each after the prefill sent while the one before ran (pipelined):
    # the ranks never waited for the scheduler. A tiny CPU step can end before the loop gets
    # to send its follower (a busy 2-core machine, a collection of an earlier test's
    # garbage), so of up to three runs one must show every follower pipelined.
    pipelined = []
    for _ in range(3):
        before = await metrics(served)
        r = await served.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
        )
        after = await metrics(served)
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        assert delta["vllm:prompt_tokens_total"] == r.usage.prompt_tokens
        assert delta["vllm:generation_tokens_total"] == 7
        assert delta['vllm:request_success_total{finished_reason="length"}'] == 1
        assert delta["vllm:time_to_first_token_seconds_count"] == 1
        assert delta["vllm:inter_token_latency_seconds_count"] == 6
        assert delta["vllm:e2e_request_latency_seconds_count"] == 1
        assert delta["deltaserve:steps_total"] == 7
        assert (
            0
            < delta["deltaserve:step_seconds_total"]
            < delta["vllm:e2e_request_latency_seconds_sum"]
        )
        pipelined.append(
            (delta["deltaserve:pipelined_steps_total"], delta["deltaserve:scheduler_seconds_total"])
        )
        if pipelined[-1] == (6, 0):
            break
    assert pipelined[-1] == (6, 0), f"(pipelined steps, scheduler seconds) of each run: {pipelined}"
    assert (
        after['vllm:e2e_request_latency_seconds_bucket{le="+Inf"}']
        == after["vllm:e2e_request_latency_seconds_count"]
    )
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


# ---- errors: each produced by a real request; the autouse fixture checks health after ----


async def post(served: Served, path: str, data: bytes, key: str = API_KEY) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(served.url + path, data=data, headers=headers) as r,
    ):
        return r.status, await r.json()


def check_error(body: dict, param: str | None, words: str) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert words in err["message"], err


@pytest.mark.parametrize(
    "call, param, words",
    [
        (dict(prompt="x", extra_body={"prompt_logprobs": -1}), "prompt_logprobs", ">= 0"),
        (dict(prompt="x", extra_body={"prompt_logprobs": 21}), "prompt_logprobs", "0..20"),
        (dict(prompt="x", best_of=2), "best_of", "best_of"),
        (dict(prompt="x", logit_bias={"248320": 3}), "logit_bias", "[248320]"),
        (dict(prompt="x", suffix="y"), "suffix", "suffix"),
        (dict(prompt="x", logprobs=21), "logprobs", "0..20"),
        (dict(prompt="x", temperature=-0.5), "temperature", "temperature"),
        (dict(prompt="x", n=0), "n", "n must"),
        (dict(prompt="x", max_tokens=0), "max_tokens", "max_tokens must"),
        (dict(prompt="x", max_tokens=MAX_MODEL_LEN), "prompt", "max_model_len"),
        (dict(prompt=[248320]), "prompt", "[0, 248320)"),
        (dict(prompt="x", extra_body={"stop_token_ids": [10**6]}), "stop_token_ids", "vocabulary"),
        (
            dict(prompt="x", extra_body={"guided_grammar": "x"}),
            "guided_grammar",
            "Expected token ':'",
        ),
    ],
)
async def test_400_completions(served: Served, call, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        await served.client.completions.create(model=MODEL, **call)
    check_error(info.value.response.json(), param, words)


@pytest.mark.parametrize(
    "call, param, words",
    [
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
            "tool_choice",
            "--enable-auto-tool-choice",
        ),
        (dict(tool_choice="required"), "tool_choice", "tool"),
        (
            dict(response_format={"type": "structural_tag"}),
            "response_format",
            "triggers must be a non-empty list",
        ),
        (
            dict(
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            ),
            "messages",
            "messages[0].content[0].image_url: the model",  # a text-only checkpoint: no tower
        ),
        (dict(top_logprobs=2), "top_logprobs", "logprobs=true"),
    ],
)
async def test_400_chat(served: Served, call, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], **call}
    with pytest.raises(openai.BadRequestError) as info:
        await served.client.chat.completions.create(model=MODEL, **body)
    check_error(info.value.response.json(), param, words)


@pytest.mark.parametrize(
    "path, routed, plain",
    [
        (
            "/v1/chat/completions",
            VLLM_ROUTER_CHAT,
            {"messages": VLLM_ROUTER_CHAT["messages"], "max_completion_tokens": 8},
        ),
        ("/v1/completions", VLLM_ROUTER_COMPLETION, {"prompt": "x", "max_tokens": 8}),
    ],
)
async def test_a_routers_forwarded_defaults_answer_as_the_plain_request(
    served: Served, path, routed, plain
):
    """What sglang-router and vllm-router forward (their structs, every default filled in)
    is answered as the client's plain request; a non-default value is a 400 naming it."""
    greedy = {"model": MODEL, "temperature": 0}
    status, answer = await post(served, path, json.dumps({**routed, **greedy}).encode())
    _, expected = await post(served, path, json.dumps({**plain, **greedy}).encode())
    assert status == 200, answer

    def texts(body: dict) -> list[str]:
        return [c["text"] if "text" in c else c["message"]["content"] for c in body["choices"]]

    assert texts(answer) == texts(expected)
    status, body = await post(
        served, path, json.dumps({**routed, **greedy, "no_stop_trim": True}).encode()
    )
    assert status == 400
    check_error(body, "no_stop_trim", "no_stop_trim")


async def test_400_bad_json_404_413(served: Served):
    status, body = await post(served, "/v1/completions", b'{"prompt": "x",')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = await post(served, "/v1/completions", b'["x"]')
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = await post(served, "/v1/nothing", b"{}")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = await post(served, "/v1/completions", b'{"prompt": "' + b"a" * MAX_BODY + b'"}')
    assert status == 413 and str(MAX_BODY) in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:
        await served.client.completions.create(model="gpt-4", prompt="x")
    check_error(info.value.response.json(), "model", "gpt-4")


async def test_401_everywhere_but_the_probes(served: Served):
    """The key guards every route but the probes: a Prometheus scrape of /metrics, /version,
    /health and /ping need none (/metrics and /version once answered 401)."""
    async with openai.AsyncOpenAI(
        base_url=served.url + "/v1", api_key="wrong", max_retries=0
    ) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model=MODEL, prompt="x")
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
    async with aiohttp.ClientSession() as s:
        for path, status in (
            ("/v1/models", 401),
            ("/v1/nothing", 401),
            ("/get_model_info", 401),
            ("/nothing", 401),
            ("/metrics", 200),
            ("/version", 200),
            ("/health", 200),
            ("/ping", 200),
        ):
            async with s.get(served.url + path) as r:
                assert r.status == status, (path, await r.text())
                if status == 401:
                    assert (await r.json())["error"]["code"] == "invalid_api_key"


async def test_several_served_model_names(served: Served):
    """`--served-model-name a b`, as vLLM: /v1/models lists both, a request may name either,
    a response carries the name its request used (the first when it named none), metrics
    label the first. A second app on the module's engine: no new engine."""
    names = (MODEL, "tiny-alias")
    runner, _ = await start_server(
        build_app(served.engine, ServerConfig(names, api_key=API_KEY)), "127.0.0.1", 0
    )
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    try:
        assert [(m.id, m.max_model_len) for m in (await client.models.list()).data] == [
            (n, MAX_MODEL_LEN) for n in names
        ]
        for name in names:
            assert (
                await client.completions.create(model=name, prompt="x", max_tokens=2)
            ).model == name
            stream = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
            )
            assert {c.model async for c in stream} == {name}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                assert (r.status, (await r.json())["model"]) == (200, MODEL)
            async with s.get(url + "/metrics") as r:
                assert f'model_name="{MODEL}"' in await r.text()
        with pytest.raises(openai.NotFoundError) as info:
            await client.completions.create(model="tiny", prompt="x")
        check_error(info.value.response.json(), "model", "tiny-alias")
    finally:
        await client.close()
        await runner.cleanup()


async def open_stream(served: Served, max_tokens: int = LONG, **kw):
    """A streaming completion whose first token has arrived."""
    stream = await served.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        **kw,
    )
    it = stream.__aiter__()
    await it.__anext__()
    return stream, it


async def test_429_when_the_queue_is_full(served: Served):
    """2 running (all slots) + 4 waiting (the bound): the next request is refused at once."""
    holders = [await open_stream(served) for _ in range(MAX_NUM_SEQS)]
    waiting = [
        await served.client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True)
        for _ in range(MAX_QUEUED)
    ]
    try:
        deadline = time.monotonic() + 5  # the load snapshot is refreshed once per tick
        while served.engine.load().waiting != MAX_QUEUED:
            assert time.monotonic() < deadline, served.engine.load()
            await asyncio.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            await served.client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert info.value.response.json()["error"]["code"] == "queue_full"
    finally:
        for stream in [h[0] for h in holders] + waiting:
            await stream.close()


async def test_disconnect_under_load_cancels_at_once(served: Served):
    """Clients that go away (two streams mid-way, one non-streaming request given up while it
    waits in the engine's queue) are cancelled at once and counted as aborts; a request sharing
    the engine completes unharmed; nothing stays on the rank (autouse fixture)."""
    before = await metrics(served)
    streams = [await open_stream(served) for _ in range(MAX_NUM_SEQS)]
    survivor = asyncio.ensure_future(
        served.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
    )
    body = b'{"prompt": "x", "max_tokens": 1000, "ignore_eos": true}'
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    async def given_up() -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(served.url + "/v1/completions", data=body, headers=headers) as r,
        ):
            await r.read()

    waiting = asyncio.ensure_future(given_up())
    # given up only once it waits in the engine (with the survivor, behind the streams): a
    # client gone before its request reached the engine has nothing to abort (a fixed 0.5 s
    # timeout fired before that on a loaded machine)
    deadline = time.monotonic() + 10
    while (await metrics(served))["vllm:num_requests_waiting"] < 2:
        assert time.monotonic() < deadline, "the request never queued"
        await asyncio.sleep(0.02)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for stream, it in streams:
        for _ in range(3):
            await it.__anext__()
        await stream.close()
    t0 = time.monotonic()
    result = await survivor
    await wait_idle(served.engine, timeout_s=10)
    elapsed = time.monotonic() - t0
    after = await metrics(served)
    aborted = after['vllm:request_success_total{finished_reason="abort"}'] - before.get(
        'vllm:request_success_total{finished_reason="abort"}', 0
    )
    assert aborted == 3
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 2 * LONG / 4, f"cancelled streams kept generating ({generated} tokens)"
    assert elapsed < 10
    ref = (
        await engine_run(
            served.engine, PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        )
    )[0]
    assert result.choices[0].text == "".join(
        e.text for e in ref if isinstance(e, TokenEvent | FinishedEvent)
    )


async def test_disconnect_of_a_multi_prompt_stream(served: Served):
    """A stream over several prompts (one engine stream each, merged) cancels all of them."""
    before = await metrics(served)
    stream = await served.client.completions.create(
        model=MODEL,
        prompt=[PROMPT, "Sphinx of black quartz"],
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = set()
    async for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if seen == {0, 1}:
            break
    await stream.close()
    await wait_idle(served.engine, timeout_s=10)
    after = await metrics(served)
    key = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[key] - before.get(key, 0) == 2


async def test_chat_default_max_tokens_fits_a_cache_smaller_than_the_context(tiny_model_dir):
    """With a KV cache (num_kv_blocks) of fewer positions than max_model_len, a chat without
    max_tokens takes what the cache leaves, as it takes the context left: it was refused with
    a 400 for needing more blocks than the cache has, whatever its prompt."""
    from serve_helpers import in_process_server

    config = EngineConfig(
        model=str(tiny_model_dir), max_model_len=256, num_kv_blocks=4, block_size=16, max_num_seqs=1
    )
    async with in_process_server(config, ServerConfig(MODEL)) as s:
        client = openai.AsyncOpenAI(
            base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60
        )
        r = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].finish_reason == "length"
        # every position the cache has
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 4 * 16
        # /v1/models reports what a request can use, not the configured 256
        assert [m.max_model_len for m in (await client.models.list()).data] == [4 * 16]
        await client.close()
