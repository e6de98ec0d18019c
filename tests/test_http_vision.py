"""Images through the server, driven by the official `openai` and `anthropic` clients (tiny
random VLM, real ranks): a chat with an image as a data URL answers HF transformers' greedy
tokens, streamed and not; the same image from an http URL (a local server) and as an
Anthropic base64 block answers the same; bad media are 400s naming the part, and the engine
stays healthy."""

from __future__ import annotations

import base64

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio
import torch
from aiohttp import web
from serve_helpers import in_process_server, wait_idle
from transformers import Qwen3_5ForConditionalGeneration
from vision_helpers import (
    TEST_PROCESSOR_KWARGS,
    chat,
    data_url,
    hf_logprobs,
    image,
    png,
    processor,
)

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.vision_config import VisionConfig
from deltaserve.http.server import ServerConfig

aio = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny-vlm"
KEY = "sk-test"
QUESTION = "What is in this picture? Answer in one word."
MAX_TOKENS = 5


PICTURE = image(80, 64, 11)
PNG = png(PICTURE)
DATA_URL = data_url(PICTURE)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_vlm_model_dir, tmp_path_factory):
    local = tmp_path_factory.mktemp("media")
    (local / "picture.png").write_bytes(PNG)
    config = EngineConfig(
        model=str(tiny_vlm_model_dir),
        max_model_len=1024,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 2, "video": 1},
        mm_processor_kwargs=TEST_PROCESSOR_KWARGS,
        allowed_local_media_path=str(local),
    )
    async with in_process_server(config, ServerConfig(MODEL, api_key=KEY)) as s:
        s.local = local
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def media_site():
    """A local http server: the picture, a redirect to a private address, a slow reply."""
    app = web.Application()
    app.router.add_get("/picture.png", lambda _: web.Response(body=PNG, content_type="image/png"))
    app.router.add_get("/elsewhere", lambda _: web.HTTPFound("http://10.0.0.1/picture.png"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(server):
    gpt = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    yield gpt, claude
    await gpt.close()
    await claude.close()


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def leaves_the_engine_idle(server):
    yield
    await wait_idle(server.engine, timeout_s=30)


@pytest.fixture(scope="module")
def hf_greedy(tiny_vlm_model_dir) -> list[int]:
    """HF's greedy tokens for the question and the picture, the prompt made by the
    checkpoint's processor from the template's text."""
    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        tiny_vlm_model_dir, dtype=torch.float32
    ).eval()
    vision = VisionConfig.from_model_dir(tiny_vlm_model_dir)
    text, images, _ = chat([QUESTION, PICTURE])
    prompt = processor(tiny_vlm_model_dir).process(text, images, [])
    tokens: list[int] = []
    for _ in range(MAX_TOKENS):
        tokens.append(int(hf_logprobs(model, prompt, vision, tokens)[-1].argmax()))
    return tokens


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def ask(gpt, messages, ignore_eos: bool = True, **body):
    return await gpt.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": ignore_eos},
        logprobs=True,
        **body,
    )


def token_ids(completion) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in completion.choices[0].logprobs.content]


@aio
async def test_a_data_url_image_answers_as_hf(clients, hf_greedy):
    gpt, _ = clients
    completion = await ask(gpt, user(image_part(DATA_URL)))
    assert token_ids(completion) == hf_greedy
    assert completion.usage.prompt_tokens > len(QUESTION.split()) + 4  # the image's tokens count


@aio
async def test_streamed_as_not(clients):
    gpt, _ = clients
    whole = await ask(gpt, user(image_part(DATA_URL)))
    stream = await ask(gpt, user(image_part(DATA_URL)), stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == whole.choices[0].message.content


@aio
async def test_an_http_url_and_a_local_file_answer_as_the_data_url(clients, media_site, server):
    gpt, _ = clients
    expected = token_ids(await ask(gpt, user(image_part(DATA_URL))))
    over_http = await ask(gpt, user(image_part(media_site + "/picture.png")))
    local = await ask(gpt, user(image_part((server.local / "picture.png").as_uri())))
    assert token_ids(over_http) == token_ids(local) == expected


@aio
async def test_an_anthropic_image_block_answers_as_the_chat(clients):
    gpt, claude = clients
    expected = await ask(gpt, user(image_part(DATA_URL)), ignore_eos=False)
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": DATA_URL.split(",")[1]},
    }
    message = await claude.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}, block]}],
        extra_body={"temperature": 0},
    )
    assert message.content[0].text == expected.choices[0].message.content


BAD = {
    "unreadable": (
        image_part("data:image/png;base64," + base64.b64encode(b"no").decode()),
        "not an image",
    ),
    "not base64": (image_part("data:image/png;base64,@@@"), "not valid base64"),
    "wrong scheme": (image_part("ftp://example.com/x.png"), "scheme"),
    "a file outside the allowed path": (
        image_part("file:///etc/hostname"),
        "allowed local media path",
    ),
    "too many images": ([image_part(DATA_URL)] * 3, "more than the limit of 2"),
    "a detail": (
        {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "high"}},
        "detail",
    ),
}


@aio
@pytest.mark.parametrize("case", list(BAD))
async def test_bad_media_are_400s_naming_the_part(case, clients):
    gpt, _ = clients
    parts, words = BAD[case]
    parts = parts if isinstance(parts, list) else [parts]
    with pytest.raises(openai.BadRequestError) as raised:
        await ask(gpt, user(*parts))
    message = raised.value.body["message"]
    assert words in message and ("messages[0].content[1]" in message or case == "too many images")
    assert (await ask(gpt, user(image_part(DATA_URL)))).choices[0].finish_reason == "length"


@aio
async def test_a_redirect_to_a_private_address_is_refused(clients, media_site):
    gpt, _ = clients
    with pytest.raises(openai.BadRequestError, match="redirected to a private"):
        await ask(gpt, user(image_part(media_site + "/elsewhere")))


@aio
async def test_an_anthropic_block_of_a_wrong_media_type_is_a_400(server):
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/bmp", "data": "AA=="},
                    }
                ],
            }
        ],
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}
        ) as response:
            assert response.status == 400
            assert "messages[0].content[0].source.media_type" in await response.text()
