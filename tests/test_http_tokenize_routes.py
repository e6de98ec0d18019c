"""vLLM's /tokenize, /detokenize and /ping through a real server (the tiny model): a text's ids
are the ones a completion of it is counted with, a chat's count is a chat completion's
prompt_tokens, ids decode back to the text, a large text leaves /health answering, refusals
name their field, and no API key guards these paths (they are outside /v1, as in vLLM).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from serve_helpers import in_process_server

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.tokenizer import INLINE_TOKENIZE_CHARS
from deltaserve.http.listen import start_server
from deltaserve.http.server import ServerConfig, build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-tokenize-routes"
TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé 数据 1234"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
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


async def post(url: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_text_ids_are_the_completion_prompt(server, client):
    status, body = await post(server.url + "/tokenize", {"prompt": TEXT, "model": MODEL})
    assert status == 200, body
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]  # vLLM's order
    assert body["tokens"] == await server.engine.encode(TEXT) and body["count"] == len(
        body["tokens"]
    )
    assert (
        body["token_strs"] is None
        and body["max_model_len"] == server.engine.longest_sequence == 512
    )
    completion = await client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1)
    assert completion.usage.prompt_tokens == body["count"]

    status, strs = await post(server.url + "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert strs["tokens"] == body["tokens"]
    assert strs["token_strs"] == server.engine.tokenizer.convert_ids_to_tokens(body["tokens"])
    assert "Ġquick" in strs["token_strs"]  # the tokenizer's own strings, as vLLM's
    status, empty = await post(server.url + "/tokenize", {"prompt": ""})
    assert status == 200 and empty["count"] == 0 and empty["tokens"] == [], empty


async def test_chat_count_is_the_chat_prompt_tokens(server, client):
    for tools in (None, TOOLS):
        extra = {"tools": tools} if tools else {}
        status, body = await post(server.url + "/tokenize", {"messages": MESSAGES, **extra})
        assert status == 200, body
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=1,
            **extra,
            **({"tool_choice": "none"} if tools else {}),
        )
        assert body["count"] == chat.usage.prompt_tokens == len(body["tokens"]), tools
        rendered = server.engine.tokenizer.apply_chat_template(
            MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert body["tokens"] == server.engine.tokenizer.encode(rendered, add_special_tokens=False)
    with_tools = body["count"]
    status, plain = await post(server.url + "/tokenize", {"messages": MESSAGES})
    assert with_tools > plain["count"]

    status, bare = await post(
        server.url + "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}
    )
    assert (
        status == 200
        and plain["tokens"][: bare["count"]] == bare["tokens"]
        and bare["count"] < plain["count"]
    )
    prefill = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    status, cont = await post(
        server.url + "/tokenize",
        {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert status == 200, cont
    status, text = await post(server.url + "/detokenize", {"tokens": cont["tokens"]})
    assert text["prompt"].endswith("<|im_start|>assistant\nThe answer is"), text  # left open


async def test_detokenize_round_trips(server):
    status, body = await post(server.url + "/tokenize", {"prompt": TEXT})
    status, text = await post(
        server.url + "/detokenize", {"tokens": body["tokens"], "model": MODEL}
    )
    assert status == 200 and text == {"prompt": TEXT}
    status, chat = await post(server.url + "/tokenize", {"messages": MESSAGES})
    status, text = await post(server.url + "/detokenize", {"tokens": chat["tokens"]})
    # special tokens kept
    assert text["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert (await post(server.url + "/detokenize", {"tokens": []})) == (200, {"prompt": ""})


async def test_a_large_text_leaves_the_loop_free(server):
    """~1 MiB (about a second of tokenizing here): /health answers within 0.5 s all along, so
    the text went to the tokenizer thread; the ids are the completion route's."""
    words = ["hello", "world", "Ünïcödé", "数据", "1234", "fox"]
    text = " ".join(words[i * 7 % len(words)] + str(i % 97) for i in range(2**20 // 8))
    assert len(text) > 100 * INLINE_TOKENIZE_CHARS
    latencies = []
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(post(server.url + "/tokenize", {"prompt": text}))
        while not task.done():
            t = time.monotonic()
            async with s.get(server.url + "/health") as r:
                assert r.status == 200
            latencies.append(time.monotonic() - t)
            await asyncio.sleep(0.02)
    status, body = await task
    assert status == 200 and body["tokens"] == await server.engine.encode(text)
    assert len(latencies) >= 3 and max(latencies) < 0.5, latencies


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": TEXT, "temperature": 0}, 400, "temperature"),
        (
            "/tokenize",
            {"prompt": TEXT, "add_generation_prompt": False},
            400,
            "add_generation_prompt",
        ),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, 400, "messages"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": [1, 2, 3]}, 400, "prompt"),
        ("/tokenize", {"prompt": TEXT, "return_token_strs": 1}, 400, "return_token_strs"),
        ("/tokenize", {"prompt": TEXT, "model": "other"}, 404, "model"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
            400,
            "chat_template_kwargs.tokenize",
        ),
        ("/tokenize", {"messages": MESSAGES, "tools": []}, 400, "tools"),
        ("/tokenize", [TEXT], 400, None),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 10**12]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ],
)
async def test_refusals_name_the_field(server, path, body, status, param):
    got, answer = await post(server.url + path, body)
    assert (got, answer["error"]["param"]) == (status, param), answer
    assert answer["error"]["message"]


async def test_out_of_vocabulary_names_the_id(server):
    vocab = server.engine.model_config.vocab_size
    status, answer = await post(server.url + "/detokenize", {"tokens": [5, vocab - 1, vocab + 7]})
    assert status == 400 and f"tokens[2] is {vocab + 7}" in answer["error"]["message"], answer


async def test_chat_continues_the_final_message(server, client):
    """vLLM's continue_final_message (with add_generation_prompt false): the chat renders the
    assistant's start unclosed, exactly as /tokenize does with the same flags, and the output
    goes on from it (greedy: the completion of those ids); both flags true is refused in
    vLLM's words."""
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite is"},
    ]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    status, body = await post(server.url + "/tokenize", {"messages": messages, **flags})
    assert status == 200, body
    assert server.engine.tokenizer.decode(body["tokens"]).endswith("My favourite is")
    reference = await client.completions.create(
        model=MODEL, prompt=body["tokens"], max_tokens=6, temperature=0
    )
    answer = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=flags
    )
    assert (
        answer.choices[0].message.content == reference.choices[0].text
        and answer.usage.prompt_tokens == body["count"]
    )
    with pytest.raises(openai.BadRequestError, match="Cannot set both") as info:
        await client.chat.completions.create(
            model=MODEL, messages=messages, extra_body={"continue_final_message": True}
        )
    assert info.value.body["param"] == "continue_final_message"


async def test_invocations_is_a_chat_or_a_completion(server, client):
    """SageMaker's /invocations, as vLLM's: a body with messages is the chat route's answer,
    one with prompt the completion route's (greedy, the same text); neither is a 400."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    status, body = await post(server.url + "/invocations", chat)
    direct = await client.chat.completions.create(**chat)
    assert status == 200 and body["object"] == "chat.completion", body
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    status, body = await post(
        server.url + "/invocations", {"prompt": TEXT, "max_tokens": 4, "temperature": 0}
    )
    direct = await client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)
    assert status == 200 and body["choices"][0]["text"] == direct.choices[0].text, body
    status, body = await post(server.url + "/invocations", {"input": "x"})
    assert status == 400 and "messages" in body["error"]["message"], body


async def test_ping_open_and_the_rest_behind_the_key(server):
    """/ping answers as /health (GET and POST), with or without --api-key; /tokenize and
    /detokenize need the key as every route but the probes does (a 7.9 MB text tokenized
    in 3.6 s without one), /v1 and /invocations too."""
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "POST"):
            async with s.request(method, server.url + "/ping") as r:
                assert r.status == 200 and await r.read() == b"", method
    runner, _ = await start_server(
        build_app(server.engine, ServerConfig(MODEL, api_key="secret")), "127.0.0.1", 0
    )
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        for path, body in (
            ("/tokenize", {"prompt": TEXT}),
            ("/detokenize", {"tokens": [1]}),
            ("/v1/completions", {"prompt": TEXT}),
            ("/invocations", {"prompt": TEXT}),
        ):
            assert (await post(url + path, body))[0] == 401, path
        async with aiohttp.ClientSession() as s, s.post(url + "/ping") as r:
            assert r.status == 200
        key = {"x-api-key": "secret"}
        assert (await post(url + "/tokenize", {"prompt": TEXT}, key))[0] == 200
    finally:
        await runner.cleanup()
