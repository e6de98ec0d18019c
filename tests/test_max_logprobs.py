"""--max-logprobs (vLLM's): the bound on logprobs, top_logprobs and prompt_logprobs, the same
at the HTTP layer, the engine and the ranks' plan check; -1 is the whole vocabulary."""

from __future__ import annotations

import openai
import pytest
from serve_helpers import in_process_server, wait_idle

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.server import ServerConfig

USER = [{"role": "user", "content": "Hello"}]


async def test_raised_bound_on_every_route(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir), max_model_len=256, max_num_seqs=2, max_logprobs=30
    )
    async with in_process_server(config, ServerConfig("m")) as s:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        # greedy: a sampled token outside the top 30 would come as a 31st entry (OpenAI's shape)
        out = await client.completions.create(
            model="m",
            prompt="Hello there",
            max_tokens=3,
            logprobs=30,
            temperature=0,
            extra_body={"prompt_logprobs": 30, "ignore_eos": True},
        )
        assert [len(top) for top in out.choices[0].logprobs.top_logprobs] == [30] * 3
        prompt_logprobs = out.choices[0].model_dump()["prompt_logprobs"]
        assert all(len(entry) >= 30 for entry in prompt_logprobs[1:]), prompt_logprobs
        chat = await client.chat.completions.create(
            model="m",
            messages=USER,
            max_tokens=2,
            logprobs=True,
            top_logprobs=30,
            extra_body={"ignore_eos": True},
        )
        assert [len(token.top_logprobs) for token in chat.choices[0].logprobs.content] == [30, 30]
        refused = [
            (
                "logprobs",
                client.completions.create(model="m", prompt="x", max_tokens=1, logprobs=31),
            ),
            (
                "prompt_logprobs",
                client.completions.create(
                    model="m", prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 31}
                ),
            ),
            (
                "top_logprobs",
                client.chat.completions.create(
                    model="m", messages=USER, max_tokens=1, logprobs=True, top_logprobs=31
                ),
            ),
        ]
        for field, call in refused:
            with pytest.raises(openai.BadRequestError) as info:
                await call
            error = info.value.response.json()["error"]
            assert (
                error["param"] == field and f"{field} must be in 0..30, got 31" in error["message"]
            ), error
        with pytest.raises(
            ValueError, match=r"prompt_logprobs must be in 0..30, got 31 \(--max-logprobs\)"
        ):
            s.engine.generate([1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=31))
        await wait_idle(s.engine)


async def test_the_whole_vocabulary(tiny_model_dir):
    """-1: as many as the vocabulary holds; 100 alternatives come back, best first."""
    config = EngineConfig(
        model=str(tiny_model_dir), max_model_len=128, max_num_seqs=1, max_logprobs=-1
    )
    async with await AsyncEngine.start(config) as engine:
        assert engine.max_logprobs == engine.model_config.vocab_size
        events = [
            e async for e in engine.generate([1, 2, 3], SamplingParams(max_tokens=1, logprobs=100))
        ]
        token = next(e for e in events if isinstance(e, TokenEvent))
        alternatives = [logprob for _, logprob in token.top_logprobs]
        assert len(alternatives) == 100 and alternatives == sorted(alternatives, reverse=True)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= -1"):
        EngineConfig(model=str(tiny_model_dir), max_logprobs=-2)
