"""vLLM's `return_tokens_as_token_ids` (request field) and `--return-tokens-as-token-ids` (server
flag): logprobs name each token "token_id:{id}" instead of its text. One real engine behind two
apps, one without the flag and one with it, driven by the official `openai` client; each answer
is checked against the same request without token ids: the same positions, each id decoding to
the plain answer's token string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai
import pytest
import pytest_asyncio
from serve_helpers import wait_idle

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.http.listen import start_server
from deltaserve.http.server import ServerConfig, build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-token-ids"
PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": PROMPT}]
IDS = {"return_tokens_as_token_ids": True}


@dataclass
class Served:
    engine: AsyncEngine
    plain: openai.AsyncOpenAI  # a server without the flag
    flagged: openai.AsyncOpenAI  # --return-tokens-as-token-ids

    def text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_model_dir):
    engine = await AsyncEngine.start(
        EngineConfig(model=str(tiny_model_dir), max_model_len=512, max_num_seqs=4)
    )
    runners, clients = [], []
    try:
        for config in (ServerConfig(MODEL), ServerConfig(MODEL, return_tokens_as_token_ids=True)):
            runner, _ = await start_server(build_app(engine, config), "127.0.0.1", 0)
            runners.append(runner)
            clients.append(
                openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
                    api_key="x",
                    max_retries=0,
                    timeout=120,
                )
            )
        yield Served(engine, *clients)
    finally:
        for client in clients:
            await client.close()
        for runner in runners:
            await runner.cleanup()
        await engine.shutdown()


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def nothing_leaks(served):
    yield
    await wait_idle(served.engine)


def token_id(token: str) -> int:
    prefix, _, number = token.partition(":")
    assert prefix == "token_id" and number.isdigit() and str(int(number)) == number, token
    return int(number)


def greedy(**extra_body: Any) -> dict[str, Any]:
    return {"temperature": 0, "extra_body": {"ignore_eos": True, **extra_body}}


# ---- completions -------------------------------------------------------------------------


def check_completion_logprobs(served: Served, ids_lp: Any, plain_lp: Any) -> None:
    """Position by position: the id decodes to the plain token, the logprobs are the plain
    ones, the alternatives (keyed by id) are the plain ones (keyed by text, where two ids of
    one text keep the first); offsets count the "token_id:N" strings, as vLLM's."""
    ids = [token_id(t) for t in ids_lp.tokens]
    assert [served.text(t) for t in ids] == plain_lp.tokens
    assert ids_lp.token_logprobs == pytest.approx(plain_lp.token_logprobs, abs=1e-5)
    assert len(ids_lp.top_logprobs) == len(plain_lp.top_logprobs)
    for top, plain_top in zip(ids_lp.top_logprobs, plain_lp.top_logprobs, strict=True):
        if plain_top is None:
            assert top is None
            continue
        by_text: dict[str, float] = {}
        for key, lp in top.items():
            by_text.setdefault(served.text(token_id(key)), lp)
        assert by_text == pytest.approx(plain_top, abs=1e-5)
    assert ids_lp.text_offset == [sum(len(t) for t in ids_lp.tokens[:i]) for i in range(len(ids))]


async def test_completions_as_vllm(served: Served):
    """The field on a server without the flag, echo and prompt_logprobs too: the echoed prompt's
    tokens are its ids (the first with no logprob), then the output's; the text is unchanged;
    prompt_logprobs keep their decoded_token (vLLM's engine decodes them; the key is the id);
    streamed, the same entries."""
    prompt = served.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    kwargs = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=6)
    plain = (await served.plain.completions.create(**kwargs, **greedy(prompt_logprobs=3))).choices[
        0
    ]
    ids = (
        await served.plain.completions.create(**kwargs, **greedy(prompt_logprobs=3, **IDS))
    ).choices[0]
    assert ids.text == plain.text and ids.finish_reason == plain.finish_reason == "length"
    check_completion_logprobs(served, ids.logprobs, plain.logprobs)
    assert [token_id(t) for t in ids.logprobs.tokens[: len(prompt)]] == prompt
    assert ids.model_dump()["prompt_logprobs"] == plain.model_dump()["prompt_logprobs"]
    assert ids.model_dump()["prompt_logprobs"][1][str(prompt[1])]["decoded_token"] == served.text(
        prompt[1]
    )

    stream = await served.plain.completions.create(**kwargs, stream=True, **greedy(**IDS))
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    async for chunk in stream:
        for key, values in streamed.items():
            values.extend(
                getattr(chunk.choices[0].logprobs, key) if chunk.choices[0].logprobs else []
            )
    assert streamed == ids.logprobs.model_dump()


# ---- chat --------------------------------------------------------------------------------


def check_chat_logprobs(served: Served, content: list[Any], plain: list[Any]) -> None:
    """`token` and each alternative's `token` are ids decoding to the plain strings; `bytes` as
    vLLM's: the sampled token's its own (the plain ones), an alternative's its string's."""
    assert len(content) == len(plain) > 0
    for entry, plain_entry in zip(content, plain, strict=True):
        assert served.text(token_id(entry.token)) == plain_entry.token
        assert entry.bytes == plain_entry.bytes and entry.logprob == pytest.approx(
            plain_entry.logprob, abs=1e-5
        )
        alts = [(served.text(token_id(a.token)), a.logprob) for a in entry.top_logprobs]
        assert alts == [
            (a.token, pytest.approx(a.logprob, abs=1e-5)) for a in plain_entry.top_logprobs
        ]
        assert all(a.bytes == list(a.token.encode()) for a in entry.top_logprobs)
    assert len(plain[0].top_logprobs) == 3


async def test_chat_as_vllm(served: Served):
    """The field on chat, streamed and not; prompt_logprobs (top-level) keep their text."""
    kwargs = dict(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, max_tokens=6)
    plain = await served.plain.chat.completions.create(**kwargs, **greedy(prompt_logprobs=1))
    ids = await served.plain.chat.completions.create(**kwargs, **greedy(prompt_logprobs=1, **IDS))
    assert ids.choices[0].message.content == plain.choices[0].message.content
    check_chat_logprobs(served, ids.choices[0].logprobs.content, plain.choices[0].logprobs.content)
    assert ids.model_dump()["prompt_logprobs"] == plain.model_dump()["prompt_logprobs"]

    stream = await served.plain.chat.completions.create(**kwargs, stream=True, **greedy(**IDS))
    streamed = [
        e
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [
        e.model_dump() for e in ids.choices[0].logprobs.content
    ]


# ---- the server's flag -------------------------------------------------------------------


async def test_the_flag_is_the_default(served: Served):
    """--return-tokens-as-token-ids (vLLM's spelling, and its --no- form): ids where a request
    leaves the field out or null; a request's own false wins (vLLM takes the request's value
    when it gives one)."""
    from deltaserve.http.serve import _server_config, parse_args

    def flag(*argv: str) -> bool:
        return _server_config(parse_args(["m", *argv])).return_tokens_as_token_ids

    assert (
        flag(),
        flag("--return-tokens-as-token-ids"),
        flag("--no-return-tokens-as-token-ids"),
    ) == (False, True, False)
    kwargs = dict(model=MODEL, prompt=PROMPT, logprobs=2, max_tokens=4)
    plain = (await served.plain.completions.create(**kwargs, **greedy())).choices[0].logprobs
    for extra in ({}, {"return_tokens_as_token_ids": None}):
        out = (
            (await served.flagged.completions.create(**kwargs, **greedy(**extra)))
            .choices[0]
            .logprobs
        )
        check_completion_logprobs(served, out, plain)
    off = await served.flagged.completions.create(
        **kwargs, **greedy(return_tokens_as_token_ids=False)
    )
    assert off.choices[0].logprobs.model_dump() == plain.model_dump()

    chat = dict(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, max_tokens=4)
    plain_chat = await served.plain.chat.completions.create(**chat, **greedy())
    stream = await served.flagged.chat.completions.create(**chat, stream=True, **greedy())
    streamed = [
        e
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    check_chat_logprobs(served, streamed, plain_chat.choices[0].logprobs.content)


# ---- refused -----------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("value", [1, "true", [True]])
async def test_refused_when_not_a_boolean(served: Served, chat, value):
    body = {"return_tokens_as_token_ids": value}
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            await served.flagged.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=body
            )
        else:
            await served.flagged.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=body
            )
    error = info.value.response.json()["error"]
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert (
        error["param"] == "return_tokens_as_token_ids" and "must be a boolean" in error["message"]
    ), error
