"""guided_choice (vLLM's structured_outputs.choice): the rank's mask on crafted logits, then
through a real engine and server (rank process, CPU, tiny model) with the openai client."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio
import torch
from serve_helpers import in_process_server, wait_idle

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.rank.sampler import Sampler
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.server import ServerConfig
from deltaserve.ipc.messages import SamplingSpec

VOCAB = 50
EOS = 0


def _logits(favour: dict[int, float]) -> torch.Tensor:
    """One row: token 9 far ahead of all, then the `favour`ed tokens, the rest at 0."""
    row = torch.zeros(1, VOCAB)
    row[0, 9] = 20.0
    for token, value in favour.items():
        row[0, token] = value
    return row


def _walk(spec: SamplingSpec, rows: list[torch.Tensor]) -> list[int]:
    """Request 1's tokens, one per row, batched behind an unmasked greedy request 2 whose
    token (the row's argmax) must not change."""
    sampler = Sampler()
    sampler.add(1, spec)
    sampler.add(2, SamplingSpec(seed=0))
    tokens = []
    for row in rows:
        logits = torch.cat([row, row])
        other, sample = sampler.sample([2, 1], logits)
        assert other.token_id == int(row.argmax())
        assert sample.logprob == pytest.approx(float(logits[1].log_softmax(-1)[sample.token_id]), abs=1e-5)
        tokens.append(sample.token_id)
    return tokens


class TestRankMask:
    def test_greedy_follows_the_choices_against_the_logits(self):
        """Token 9 leads every row, yet the output walks a choice: the shared first token, then
        the best of the two continuations, then its rest; past a whole choice nothing is masked
        (the engine has ended the request; a pipelined step's sample is dropped)."""
        spec = SamplingSpec(seed=0, choices=((3, 4), (3, 5, 6)))
        rows = [_logits({}), _logits({4: 1.0, 5: 2.0}), _logits({7: 5.0}), _logits({})]
        assert _walk(spec, rows) == [3, 5, 6, 9]
        assert _walk(spec, [_logits({}), _logits({4: 2.0, 5: 1.0}), _logits({})]) == [3, 4, 9]

    def test_a_whole_choice_that_another_extends_offers_the_end_ids(self):
        spec = SamplingSpec(seed=0, choices=((3,), (3, 4)), choice_end_ids=(EOS,))
        assert _walk(spec, [_logits({}), _logits({EOS: 3.0, 4: 1.0})]) == [3, EOS]
        assert _walk(spec, [_logits({}), _logits({EOS: 1.0, 4: 3.0})]) == [3, 4]
        no_end = SamplingSpec(seed=0, choices=((3,), (3, 4)))
        assert _walk(no_end, [_logits({}), _logits({EOS: 3.0, 4: 1.0})]) == [3, 4]

    def test_random_rows_stay_on_the_choices(self):
        """Seeded random sampling, each row's own generator: every output is a choice, and
        each choice comes up."""
        choices = ((1, 2), (1, 3, 4), (5,))
        seen = set()
        for seed in range(40):
            spec = SamplingSpec(seed=seed, temperature=1.5, top_p=0.9, choices=choices)
            g = torch.Generator().manual_seed(seed)
            rows = [torch.randn(1, VOCAB, generator=g) for _ in range(3)]
            out = _walk(spec, rows)
            path = next(c for c in choices if tuple(out[: len(c)]) == c)
            seen.add(path)
        assert seen == set(choices)


class TestParams:
    ENCODE = {"yes": [7], "yes sir": [7, 8], "no": [9]}.__getitem__

    def test_tokens_spec_and_end(self):
        params = SamplingParams(guided_choice=["yes", "no", "yes"]).tokenize_guided_choice(self.ENCODE)
        assert params.guided_choice == ("yes", "no") and params.guided_choice_token_ids == ((7,), (9,))
        spec = params.to_spec(1, eos_token_ids={EOS, 11})
        assert spec.choices == ((7,), (9,)) and spec.choice_end_ids == ()  # no choice extends another
        assert params.ends_choice((7,)) and not params.ends_choice((8,))
        prefix = SamplingParams(guided_choice=["yes", "yes sir"]).tokenize_guided_choice(self.ENCODE)
        assert prefix.to_spec(1, eos_token_ids={11, EOS}).choice_end_ids == (EOS, 11)
        assert not prefix.ends_choice((7,)) and prefix.ends_choice((7, 8))
        with pytest.raises(ValueError, match="must be tokenized first"):
            SamplingParams(guided_choice=["yes"]).to_spec(1)

    @pytest.mark.parametrize("extra, words", [
        (dict(guided_choice="yes"), "list of non-empty strings"),
        (dict(guided_choice=["yes", ""]), "list of non-empty strings"),
        (dict(guided_choice=[str(i) for i in range(65)]), "at most 64"),
        (dict(guided_choice=["yes"], logit_bias={7: 1.0}), "combined with logit_bias"),
        (dict(guided_choice=["yes"], allowed_token_ids=[7]), "combined with allowed_token_ids"),
        (dict(guided_choice=["yes"], bad_words=["no"]), "combined with bad_words"),
        (dict(guided_choice=["yes"], min_tokens=1), "combined with min_tokens"),
    ])  # fmt: skip
    def test_refused(self, extra, words):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**extra)


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


def _tokens(server, text: str) -> int:
    return len(server.engine.tokenizer.encode(text, add_special_tokens=False))


@aio
class TestOverHttp:
    @pytest_asyncio.fixture(autouse=True, loop_scope="module")
    async def leaves_the_engine_idle(self, server):
        yield
        await wait_idle(server.engine, timeout_s=30)

    async def test_greedy_and_seeded_outputs_are_choices(self, server, client):
        """Both spellings, both endpoints; the model left alone says none of them. Each output
        ends at its choice with "stop", its usage the choice's tokens (no EOS sampled)."""
        free = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert free.choices[0].text not in CHOICES
        spellings = ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}})
        for extra in spellings:
            for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3, n=6)):
                out = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                                      extra_body=extra, **sampling)  # fmt: skip
                texts = [c.text for c in out.choices]
                assert set(texts) <= set(CHOICES) and {c.finish_reason for c in out.choices} == {"stop"}, out
                assert out.usage.completion_tokens == sum(_tokens(server, t) for t in texts)
                chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                            max_tokens=8, extra_body=extra, **sampling)  # fmt: skip
                assert {c.message.content for c in chat.choices} <= set(CHOICES), chat
                assert {c.finish_reason for c in chat.choices} == {"stop"}

    async def test_choices_that_extend_others(self, server, client):
        """"1" is the start of "12": after it the rank offers the EOS ids too, and either ending
        comes (this model mostly ends); ignore_eos keeps neither going."""
        choices = ["1", "12"]
        assert _tokens(server, "1") == 1 and _tokens(server, "12") == 2
        for ignore_eos in (False, True):
            out = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=2.0, seed=0,
                                                  n=16, extra_body={"guided_choice": choices, "ignore_eos": ignore_eos})  # fmt: skip
            assert {c.text for c in out.choices} == set(choices), out
            assert {c.finish_reason for c in out.choices} == {"stop"}
            assert out.usage.completion_tokens == 2 * 16  # "1" and an EOS, or "12"

    async def test_stream_logprobs_and_length(self, server, client):
        extra = {"structured_outputs": {"choice": CHOICES}}
        stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5,
                                                 logprobs=2, stream=True, extra_body=extra)  # fmt: skip
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks)
        assert text in CHOICES and chunks[-1].choices[0].finish_reason == "stop"
        assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == _tokens(server, text)
        messages = [{"role": "user", "content": PROMPT}]
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                      stream=True, extra_body=extra)  # fmt: skip
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) in CHOICES
        assert chunks[-1].choices[0].finish_reason == "stop"
        out = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                              extra_body={"guided_choice": ["The quick brown fox"]})  # fmt: skip
        assert (out.choices[0].text, out.choices[0].finish_reason) == ("The quick", "length")

    @pytest.mark.parametrize("extra, param, words", [
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"structured_outputs": {"choice": ["yes", 1]}}, "structured_outputs.choice", "[1] must be a non-empty string"),
        ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs.json", "no grammar engine"),
        ({"structured_outputs": {"choice": ["yes"], "regex": "y+"}}, "structured_outputs.regex", "no grammar engine"),
        ({"structured_outputs": {}}, "structured_outputs", "needs one constraint"),
        ({"structured_outputs": {"choice": ["yes"]}, "guided_choice": ["yes"]}, "guided_choice", "not both"),
        ({"guided_choice": ["yes"], "logit_bias": {"5": 1}}, "guided_choice", "combined with logit_bias"),
        ({"guided_choice": ["yes", "<|im_end|>"]}, "guided_choice", "end-of-sequence"),
        ({"guided_choice": [str(i) for i in range(65)]}, "guided_choice", "at most 64"),
    ])  # fmt: skip
    async def test_refused(self, client, extra, param, words):
        for create in (client.completions.create, client.chat.completions.create):
            prompt = {"prompt": PROMPT} if create == client.completions.create else {"messages": [{"role": "user", "content": "hi"}]}
            with pytest.raises(openai.BadRequestError) as info:
                await create(model="tiny", max_tokens=2, extra_body=extra, **prompt)
            error = info.value.response.json()["error"]
            assert error["param"] == param and words in error["message"], error
