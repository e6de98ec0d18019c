"""Beam search (vLLM's use_beam_search on /v1/completions and /v1/chat/completions;
engine/beam_search.py) through a real server and the openai client: one beam is greedy
decoding, each beam's cumulative logprob is what the model gives its tokens (rescored as a
prompt), beams come best first, chat answers the beams of its rendered prompt, and the fields
a search would not honour are refused."""

from __future__ import annotations

import math

import aiohttp
import openai
import pytest
import pytest_asyncio
from serve_helpers import in_process_server, openai_client, wait_idle

from deltaserve.engine.beam_search import beam_search
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import PromptLogprobsEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.server import ServerConfig

aio = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
PROMPT = [9707, 11, 1879, 0, 358, 1079, 264, 1273]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir), max_model_len=256, max_num_seqs=8, enable_prefix_caching=True
    )
    async with in_process_server(config, ServerConfig(MODEL)) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(server):
    async with openai_client(server) as client:
        yield client


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def leaves_the_engine_idle(server):
    yield
    await wait_idle(server.engine, timeout_s=30, prefixes=True)


@aio
async def test_one_beam_is_greedy(client):
    greedy = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    beam = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    assert [c.text for c in beam.choices] == [greedy.choices[0].text] and beam.choices[
        0
    ].finish_reason == "length"
    assert beam.usage.prompt_tokens == len(PROMPT) and beam.usage.completion_tokens == 6


@aio
async def test_beams_carry_the_models_logprobs_best_first(server, client):
    """Width 3, no length penalty: each beam's cumulative logprob equals the model's logprobs
    of its tokens given as a prompt, the beams are distinct and best first, and the route
    answers the same beams."""
    engine = server.engine
    beams = await beam_search(
        engine, PROMPT, 3, 5, engine.eos_token_ids, length_penalty=0.0, ignore_eos=True
    )
    assert len({b.tokens for b in beams}) == 3 and all(len(b.tokens) == 5 for b in beams)
    assert [b.cum_logprob for b in beams] == sorted((b.cum_logprob for b in beams), reverse=True)
    for beam in beams:
        stream = engine.generate(
            PROMPT + list(beam.tokens), SamplingParams(max_tokens=1, prompt_logprobs=0)
        )
        scored = [ev async for ev in stream if isinstance(ev, PromptLogprobsEvent)][
            0
        ].token_logprobs
        assert math.isclose(sum(scored[-5:]), beam.cum_logprob, abs_tol=1e-3), (scored[-5:], beam)
    answer = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        n=3,
        extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.0},
    )
    texts = await engine.run_tokenizer(lambda tok: [tok.decode(list(b.tokens)) for b in beams], 1)
    assert [c.text for c in answer.choices] == texts and [c.index for c in answer.choices] == [
        0,
        1,
        2,
    ]


def reference_beams(
    tiny_model_dir, prompt: list[int], width: int, length: int
) -> list[tuple[tuple[int, ...], float]]:
    """Beam search written from its definition over HF transformers' model (fp32, no cache:
    every step scores each beam's whole sequence): at each step the `width` best of all
    (beam, token) extensions of the whole vocabulary by cumulative logprob; no EOS, no length
    penalty. (HF's own `generate(num_beams=...)` is no reference here: on this hybrid model its
    beams' scores are not what its forward gives their tokens.)"""
    import torch
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    beams = [((), 0.0)]
    with torch.inference_mode():
        for _ in range(length):
            rows = torch.stack(
                [
                    cum + hf(torch.tensor([prompt + list(tokens)])).logits[0, -1].log_softmax(-1)
                    for tokens, cum in beams
                ]
            )  # [beams, vocab]: each extension's cumulative logprob
            best = rows.flatten().topk(width)
            vocab = rows.shape[1]
            beams = [
                (beams[i // vocab][0] + (i % vocab,), value)
                for i, value in zip(best.indices.tolist(), best.values.tolist(), strict=True)
            ]
    return beams


@aio
async def test_beams_are_a_reference_search_over_hf(server, client, tiny_model_dir):
    """Against an independent search (`reference_beams`: HF's model, the definition of beam
    search over the whole vocabulary), width 3 and 4 over 5 tokens: the same beams, best
    first, with the same cumulative logprobs; the route answers them too."""
    engine = server.engine
    for width in (3, 4):
        expected = reference_beams(tiny_model_dir, PROMPT, width, 5)
        beams = await beam_search(
            engine, PROMPT, width, 5, engine.eos_token_ids, length_penalty=0.0, ignore_eos=True
        )
        assert [b.tokens for b in beams] == [tokens for tokens, _ in expected]
        for beam, (_, cum) in zip(beams, expected, strict=True):
            assert math.isclose(beam.cum_logprob, cum, abs_tol=1e-3), (beam, cum)
    answer = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        n=width,
        extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.0},
    )
    texts = await engine.run_tokenizer(
        lambda tok: [tok.decode(list(tokens)) for tokens, _ in expected], 1
    )
    assert [c.text for c in answer.choices] == texts


@aio
async def test_a_beam_an_eos_ends_is_set_aside(server):
    """The best first token made an EOS (the search's `eos_ids`): its beam ends there, "stop",
    its score its one logprob; no beam goes on past it; include_stop keeps it in the tokens."""
    engine = server.engine
    (best, *_) = await beam_search(engine, PROMPT, 2, 1, (), ignore_eos=True)
    eos = best.tokens[0]
    ended = await beam_search(engine, PROMPT, 2, 3, {eos}, length_penalty=0.0)
    stopped = [b for b in ended if b.finish_reason == "stop"]
    assert [(b.tokens, b.stop_reason) for b in stopped] == [((), eos)], ended
    assert (
        math.isclose(stopped[0].cum_logprob, best.cum_logprob, abs_tol=1e-6)
        and stopped[0] == ended[0]
    )
    assert all(eos not in b.tokens for b in ended)
    kept = await beam_search(engine, PROMPT, 2, 3, {eos}, length_penalty=0.0, include_stop=True)
    assert [b.tokens for b in kept if b.finish_reason == "stop"] == [(eos,)]


@aio
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_p": 0.5}, "top_p"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 11}, "n"),
        ({"echo": True}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 250}, "prompt"),  # + the prompt: past max_model_len (the engine's check)
    ],
)
async def test_what_a_search_would_not_honour_is_refused(client, extra, param):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(
            **{k: body.pop(k) for k in ("model", "prompt")}, extra_body=body
        )
    assert info.value.body["param"] == param, info.value.body


@aio
async def test_length_penalty_without_beams_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"length_penalty": 2.0}
        )
    assert info.value.body["param"] == "length_penalty"


MESSAGES = [{"role": "user", "content": "Name three colours."}]


@aio
async def test_chat_beams_are_the_rendered_prompts_beams(server, client):
    """On chat the beams of the rendered prompt (vLLM's /tokenize of the messages) come back as
    the choices' messages, best first, as the completion route answers that prompt; one beam
    is greedy decoding."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.url + "/tokenize", json={"messages": MESSAGES}) as r,
    ):
        prompt = (await r.json())["tokens"]
    beams = {"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.0}
    chat = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=3, extra_body=beams
    )
    plain = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, n=3, extra_body=beams
    )
    assert [c.message.content for c in chat.choices] == [c.text for c in plain.choices]
    assert len({c.text for c in plain.choices}) == 3 and [c.index for c in chat.choices] == [
        0,
        1,
        2,
    ]
    assert {c.finish_reason for c in chat.choices} == {"length"} and all(
        c.message.role == "assistant" for c in chat.choices
    )
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(prompt), 15)
    greedy = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    one = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    assert [c.message.content for c in one.choices] == [greedy.choices[0].message.content]


@aio
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"logprobs": True}, "logprobs"),
        ({"top_p": 0.5}, "top_p"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
        ({"max_completion_tokens": 250}, "messages"),  # + the prompt: past max_model_len
    ],
)
async def test_what_a_chat_search_would_not_honour_is_refused(client, extra, param):
    body = {"use_beam_search": True, "max_tokens": 4, **extra}
    if "max_completion_tokens" in extra:
        del body["max_tokens"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=body)
    assert info.value.body["param"] == param, info.value.body
    ok = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        logprobs=False,
        extra_body={"use_beam_search": True},
    )
    assert len(ok.choices) == 1, "logprobs false asks for none: a search takes it"
