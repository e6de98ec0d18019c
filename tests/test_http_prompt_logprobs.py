"""Prompt logprobs over HTTP, as vLLM's server gives them: `prompt_logprobs` (on each completion
choice, on the chat response), and completions' `echo` with `logprobs` (the prompt tokens'
entries before the output's, streamed with the first chunk). A real engine (rank process) behind
the aiohttp app, driven by the official `openai` client; the logprobs' agreement with HF
transformers is the engine's test (tests/test_prompt_logprobs.py), here their agreement with
what the same server says of the same tokens as output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai
import pytest
import pytest_asyncio
from serve_helpers import in_process_server, wait_idle

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.responses import TokenStrings
from deltaserve.http.server import ServerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-test"
PROMPT = "The quick brown fox jumps over the lazy dog."
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class Served:
    engine: AsyncEngine
    client: openai.AsyncOpenAI
    strings: TokenStrings

    def ids(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=False)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=512, max_num_seqs=4)
    async with in_process_server(config, ServerConfig(MODEL)) as s:
        async with openai.AsyncOpenAI(
            base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            yield Served(s.engine, client, TokenStrings(s.engine.tokenizer))


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def nothing_leaks(served):
    yield
    await wait_idle(served.engine)


def extra(model: Any, name: str) -> Any:
    """A vLLM extra field of a response object (the SDK keeps unknown fields)."""
    return model.model_dump()[name]


def check_prompt_logprobs(served: Served, plp: list, prompt: list[int], k: int) -> None:
    """vLLM's list: None, then per token {id: {logprob, rank, decoded_token}} of the token
    (its own rank) and its k best alternatives (ranks 1..k, best first)."""
    assert len(plp) == len(prompt) and plp[0] is None
    for token, entry in zip(prompt[1:], plp[1:], strict=True):
        own = entry[str(token)]
        assert own["decoded_token"] == served.strings.text(token) and own["rank"] >= 1
        assert next(iter(entry)) == str(token)  # the token first, as vLLM's
        alts = sorted(
            (v for key, v in entry.items() if key != str(token) or own["rank"] <= k),
            key=lambda v: v["rank"],
        )
        assert [v["rank"] for v in alts] == list(range(1, k + 1)), entry
        assert [v["logprob"] for v in alts] == sorted((v["logprob"] for v in alts), reverse=True)


# ---- refused -----------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt_logprobs": -1}, ">= 0"),  # SamplingParams: vLLM's -1 (all) is past any bound
        ({"prompt_logprobs": 21}, "0..20"),
        ({"prompt_logprobs": True}, "integer"),
        ({"prompt_logprobs": "1"}, "integer"),
        (
            {"prompt_logprobs": 1, "stream": True},
            "`prompt_logprobs` are not available when `stream=True`.",
        ),
        (
            {"prompt_logprobs": -1, "stream": True},
            "`prompt_logprobs` are not available when `stream=True`.",
        ),
    ],
)
async def test_refused_naming_the_field(served: Served, chat, body, words):
    body = dict(body)  # shared by both endpoints' runs
    stream = body.pop("stream", False)
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            await served.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                stream=stream,
                extra_body=body,
            )
        else:
            await served.client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2, stream=stream, extra_body=body
            )
    error = info.value.response.json()["error"]
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == "prompt_logprobs" and words in error["message"], error


async def test_zero_streams_as_vllm(served: Served):
    """vLLM refuses a stream only where prompt_logprobs would give some: 0 is taken (and a
    stream has no field for them)."""
    stream = await served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all("prompt_logprobs" not in c.choices[0].model_dump() for c in chunks)


# ---- completions -------------------------------------------------------------------------


async def test_each_choice_carries_its_prompts(served: Served):
    """Two prompts (text and ids) x n=2: each choice its own prompt's list; usage unchanged."""
    prompts = [served.ids(PROMPT), served.ids("Hello there, world")]
    out = await served.client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=2,
        logprobs=1,
        **{**GREEDY, "extra_body": {"ignore_eos": True, "prompt_logprobs": 3}},
    )
    assert len(out.choices) == 4
    for choice in out.choices:
        prompt = prompts[choice.index // 2]
        check_prompt_logprobs(served, extra(choice, "prompt_logprobs"), prompt, k=3)
        assert len(choice.logprobs.tokens) == 2  # no echo: the output's only
    assert (
        out.choices[0].model_dump()["prompt_logprobs"]
        == out.choices[1].model_dump()["prompt_logprobs"]
    )
    assert (
        out.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])
        and out.usage.completion_tokens == 8
    )
    plain = await served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert "prompt_logprobs" not in plain.choices[0].model_dump()


async def test_echo_with_logprobs(served: Served):
    """As vLLM's: the prompt's tokens first (decoded one by one; the first with no logprob, the
    others with the token and up to `logprobs` alternatives), the same as `prompt_logprobs`
    gives (here logprobs=2, so prompt_logprobs=2); offsets over the whole; the choice carries
    the list; streamed, the prompt part comes with the first chunk, the same as not streamed."""
    prompt = served.ids(PROMPT)
    kwargs = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, **GREEDY)
    out = await served.client.completions.create(**kwargs)
    choice, plain = (
        out.choices[0],
        await served.client.completions.create(**{**kwargs, "echo": False}),
    )
    lp = choice.logprobs
    assert choice.text == PROMPT + plain.choices[0].text and out.usage == plain.usage
    assert lp.tokens == [served.strings.text(t) for t in prompt] + plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[len(prompt) :] == plain.choices[0].logprobs.token_logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plp = extra(choice, "prompt_logprobs")
    check_prompt_logprobs(served, plp, prompt, k=2)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == plp[i][str(prompt[i])]["logprob"]
        top: dict[str, float] = {}
        for v in list(plp[i].values())[:3]:
            top.setdefault(v["decoded_token"], v["logprob"])
        assert lp.top_logprobs[i] == top

    chunks = [c async for c in await served.client.completions.create(**kwargs, stream=True)]
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and len(first.logprobs.tokens) == len(prompt) + 1
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for key, values in streamed.items():
            values.extend(getattr(c.choices[0].logprobs, key) if c.choices[0].logprobs else [])
    assert streamed == lp.model_dump()

    fewer = await served.client.completions.create(
        **{**kwargs, "extra_body": {"ignore_eos": True, "prompt_logprobs": 0}}
    )
    assert all(
        top is None or len(top) == 1
        for top in fewer.choices[0].logprobs.top_logprobs[: len(prompt)]
    )


async def test_echo_logprobs_equal_the_outputs_of_the_same_tokens(served: Served):
    """lm-eval-harness's loglikelihood (echo=True, logprobs=1, max_tokens=1, temperature=0):
    a prompt whose last tokens are the greedy continuation of its start gets for them the
    logprobs the server gave them as output, each of rank 1."""
    start, n = served.ids(PROMPT), 3
    events = [
        e
        async for e in served.engine.generate(
            start, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
    ]
    greedy = [e.token_id for e in events if isinstance(e, TokenEvent)]
    out = await served.client.completions.create(
        model=MODEL, prompt=start, max_tokens=n, logprobs=1, **GREEDY
    )
    # the same tokens
    assert out.choices[0].logprobs.tokens == [served.strings.text(t) for t in greedy]
    prompt = start + greedy
    echo = await served.client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, **GREEDY
    )
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[len(start) : len(prompt)] == pytest.approx(
        out.choices[0].logprobs.token_logprobs, abs=1e-4
    )
    assert [
        e[str(t)]["rank"]
        for e, t in zip(
            extra(echo.choices[0], "prompt_logprobs")[len(start) :], greedy, strict=True
        )
    ] == [1] * n


# ---- chat --------------------------------------------------------------------------------


async def test_chat_prompt_logprobs_top_level(served: Served):
    """vLLM's top-level `prompt_logprobs` of the rendered prompt: as completions gives for
    the same token ids; absent unless asked."""
    messages = [{"role": "user", "content": PROMPT}]
    chat = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, n=2, extra_body={"prompt_logprobs": 2}
    )
    plp = chat.model_extra["prompt_logprobs"]
    tokenizer = served.engine.tokenizer
    prompt = served.ids(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    assert len(plp) == len(prompt) == chat.usage.prompt_tokens
    check_prompt_logprobs(served, plp, prompt, k=2)
    out = await served.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    assert plp[0] is None and extra(out.choices[0], "prompt_logprobs")[0] is None
    for mine, theirs in zip(plp[1:], extra(out.choices[0], "prompt_logprobs")[1:], strict=True):
        assert mine.keys() == theirs.keys()
        assert [v["logprob"] for v in mine.values()] == pytest.approx(
            [v["logprob"] for v in theirs.values()], abs=1e-4
        )
    plain = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2
    )
    assert "prompt_logprobs" not in plain.model_dump()
