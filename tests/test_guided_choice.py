"""guided_choice (vLLM's structured_outputs.choice) through a real engine and server (rank
process, CPU, tiny model) with the openai client; the rank's mask itself: test_guided_decoding.py."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio
from serve_helpers import in_process_server, wait_idle

from deltaserve.engine.config import EngineConfig
from deltaserve.http.server import ServerConfig

# ---- through the engine and the server ------------------------------------------------------

aio = pytest.mark.asyncio(loop_scope="module")
PROMPT = "The quick brown fox jumps over the lazy dog."
CHOICES = ["positive", "negative", "The quick brown fox"]  # one, one and four tokens


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, max_num_seqs=4)
    async with in_process_server(config, ServerConfig("tiny")) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    yield client
    await client.close()


@aio
class TestOverHttp:
    @pytest_asyncio.fixture(autouse=True, loop_scope="module")
    async def leaves_the_engine_idle(self, server):
        yield
        await wait_idle(server.engine, timeout_s=30)

    async def test_greedy_and_seeded_outputs_are_choices(self, server, client):
        """Both spellings, both endpoints; the model left alone says none of them. Each output
        ends at its choice with "stop": an EOS, the only token the rank allows there."""
        free = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert free.choices[0].text not in CHOICES
        spellings = ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}})
        for extra in spellings:
            for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3, n=6)):
                out = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                                      extra_body=extra, **sampling)  # fmt: skip
                texts = [c.text for c in out.choices]
                assert set(texts) <= set(CHOICES) and {c.finish_reason for c in out.choices} == {"stop"}, out
                chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                            max_tokens=24, extra_body=extra, **sampling)  # fmt: skip
                assert {c.message.content for c in chat.choices} <= set(CHOICES), chat
                assert {c.finish_reason for c in chat.choices} == {"stop"}

    async def test_choices_that_extend_others(self, server, client):
        """"1" is the start of "12": after it the rank offers the EOS ids too, and either ending
        comes; ignore_eos keeps neither going (the EOS is the choice's end)."""
        choices = ["1", "12"]
        for ignore_eos in (False, True):
            out = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=2.0, seed=0,
                                                  n=16, extra_body={"guided_choice": choices, "ignore_eos": ignore_eos})  # fmt: skip
            assert {c.text for c in out.choices} == set(choices), out
            assert {c.finish_reason for c in out.choices} == {"stop"}

    async def test_stream_logprobs_and_length(self, server, client):
        extra = {"structured_outputs": {"choice": CHOICES}}
        stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=5,
                                                 logprobs=2, stream=True, extra_body=extra)  # fmt: skip
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks)
        assert text in CHOICES and chunks[-1].choices[0].finish_reason == "stop"
        spelled = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert "".join(spelled[:-1]) == text and spelled[-1] in ("<|endoftext|>", "<|im_end|>")  # then the EOS
        messages = [{"role": "user", "content": PROMPT}]
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                      stream=True, extra_body=extra)  # fmt: skip
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) in CHOICES
        assert chunks[-1].choices[0].finish_reason == "stop"
        out = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                              extra_body={"guided_choice": ["The quick brown fox"]})  # fmt: skip
        assert "The quick brown fox".startswith(out.choices[0].text) and out.choices[0].finish_reason == "length"

    @pytest.mark.parametrize("extra, param, words", [
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"structured_outputs": {"choice": ["yes", 1]}}, "structured_outputs.choice", "[1] must be a non-empty string"),
        ({"structured_outputs": {"choice": ["yes"], "regex": "y+"}}, "structured_outputs.choice", "one kind"),
        ({"structured_outputs": {}}, "structured_outputs", "needs one constraint"),
        ({"structured_outputs": {"choice": ["yes"]}, "guided_choice": ["yes"]}, "guided_choice", "not both"),
        ({"guided_choice": ["yes"], "logit_bias": {"5": 1}}, "guided_choice", "combined with logit_bias"),
        ({"guided_choice": [str(i) for i in range(257)]}, "guided_choice", "at most 256"),
    ])  # fmt: skip
    async def test_refused(self, client, extra, param, words):
        for create in (client.completions.create, client.chat.completions.create):
            prompt = {"prompt": PROMPT} if create == client.completions.create else {"messages": [{"role": "user", "content": "hi"}]}
            with pytest.raises(openai.BadRequestError) as info:
                await create(model="tiny", max_tokens=2, extra_body=extra, **prompt)
            error = info.value.response.json()["error"]
            assert error["param"] == param and words in error["message"], error
