"""What routers ask a worker, through a real server (the tiny model) and the official openai
client's raw calls. vLLM's render routes: a chat's token_ids are the ones the chat completion
runs (its usage counts them), a completion's are each prompt's, the sampling parameters are
the ones the generating route would use, nothing is submitted, and refusals name their field
as the generating routes'. SGLang's /get_load: the requests held and the KV in use.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import pytest_asyncio
from router_structs import VLLM_ROUTER_CHAT, VLLM_ROUTER_COMPLETION
from serve_helpers import in_process_server

from deltaserve.engine.config import EngineConfig
from deltaserve.http.server import ServerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-render"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=512, max_num_seqs=2)
    async with in_process_server(config, ServerConfig(MODEL)) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(server):
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    yield c
    await c.close()


async def render(client: openai.AsyncOpenAI, path: str, body: dict) -> Any:
    """The route's JSON, as the openai client posts any body to its base URL."""
    return await client.post(path, body=body, cast_to=object)


async def test_a_chat_renders_to_the_tokens_its_completion_runs(server, client):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0.0, "seed": 3}
    metrics = server.engine.metrics
    ran = metrics.prompt_tokens_total
    rendered = await render(client, "/chat/completions/render", body)
    assert metrics.prompt_tokens_total == ran  # rendered, not run
    tokenized = await client.post(
        "/../tokenize", body={"model": MODEL, "messages": MESSAGES}, cast_to=object
    )
    assert rendered["token_ids"] == tokenized["tokens"]
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == MODEL
    sampling = rendered["sampling_params"]
    assert (sampling["max_tokens"], sampling["temperature"], sampling["seed"]) == (5, 0.0, 3)
    assert (rendered["stream"], rendered["stream_options"], rendered["features"]) == (
        False,
        None,
        None,
    )
    completion = await client.chat.completions.create(**body)
    assert completion.usage.prompt_tokens == len(rendered["token_ids"])

    streamed = await render(
        client,
        "/chat/completions/render",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert streamed["stream"] is True and streamed["stream_options"]["include_usage"] is True
    # no max_tokens: what the context leaves, as the chat route
    assert streamed["sampling_params"]["max_tokens"] == 512 - len(streamed["token_ids"])


async def test_a_completion_renders_each_prompt(server, client):
    prompts = ["Once upon a time", [5, 6, 7, 8]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 7, "stop": ["\n"]}
    rendered = await render(client, "/completions/render", body)
    assert [r["token_ids"] for r in rendered][1] == [5, 6, 7, 8]
    completion = await client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1)
    assert len(rendered[0]["token_ids"]) == completion.usage.prompt_tokens
    for r in rendered:
        assert r["request_id"].startswith("cmpl-")
        assert (r["sampling_params"]["max_tokens"], r["sampling_params"]["stop"]) == (7, ["\n"])


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (
            "/chat/completions/render",
            {"model": MODEL, "messages": MESSAGES, "top_p": 2},
            400,
            "top_p",
        ),
        ("/completions/render", {"model": MODEL}, 400, "prompt"),
        ("/completions/render", {"model": "other", "prompt": "x"}, 404, "model"),
        (
            "/completions/render",
            {"model": MODEL, "prompt": "x", "use_beam_search": True},
            400,
            "use_beam_search",
        ),
    ],
)
async def test_refusals_name_the_field(client, path, body, status, param):
    with pytest.raises(openai.APIStatusError) as raised:
        await render(client, path, body)
    assert raised.value.status_code == status
    assert raised.value.body["param"] == param


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/chat/completions/render", VLLM_ROUTER_CHAT),
        ("/completions/render", VLLM_ROUTER_COMPLETION),
    ],
)
async def test_the_routers_default_fields_render_as_the_plain_request(client, path, body):
    """vllm-router's render call carries SGLang's defaults (no_stop_trim false, ...): they ask
    for nothing, so it renders; a non-default value is refused by name."""
    rendered = await render(client, path, {**body, "model": MODEL})
    first = rendered if isinstance(rendered, dict) else rendered[0]
    assert first["token_ids"] and first["sampling_params"]["max_tokens"] == 8
    with pytest.raises(openai.APIStatusError) as raised:
        await render(client, path, {**body, "model": MODEL, "no_stop_trim": True})
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == "no_stop_trim"


async def test_get_load_counts_what_the_engine_holds(server, client):
    idle = await client.get("/../get_load", cast_to=object)
    assert [(e["dp_rank"], e["num_reqs"], e["num_waiting_reqs"]) for e in idle] == [(0, 0, 0)]
    stream = await client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for _ in stream:  # its first token: it runs
        break
    (busy,) = await client.get("/../get_load", cast_to=object)
    assert busy["num_reqs"] == 1 and busy["num_tokens"] > 0
    await stream.close()
