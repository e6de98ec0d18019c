"""Through the real engine (rank process, CPU, tiny model): the waiting queue's bound after an
abort, and vLLM's sampling parameters that act on the rank (min_tokens, logit_bias), in the
stop checks (include_stop_str_in_output) and the detokenizer (skip_special_tokens), also over
HTTP with the openai client (the server runs on the same engine).

One engine with a single state slot, so a long request holds it and others wait; its steps
are pipelined (the default), so the rank's own count of samples is what min_tokens uses.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import FinishedEvent, QueueFullError, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.listen import start_server
from deltaserve.http.server import ServerConfig, build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_QUEUED = 2
PROMPT = "The quick brown fox jumps over the lazy dog."
VOCAB = 248320
IM_START = 248045  # a special token that is no EOS
HOLD = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)  # keeps the one slot busy


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_kv_blocks=32,
        block_size=16,
        max_queued_requests=MAX_QUEUED,
    )
    engine = await AsyncEngine.start(config)
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(engine):
    runner, _ = await start_server(build_app(engine, ServerConfig("tiny")), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    yield client
    await client.close()
    await runner.cleanup()


@pytest.fixture(scope="module")
def eos(engine) -> int:
    return min(engine.eos_token_ids)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(engine, eos) -> list[int]:
    """The greedy tokens of PROMPT, EOS or not: none of the first few is an EOS or IM_START."""
    tokens, _ = await run(
        engine, PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    ids = [t.token_id for t in tokens]
    assert not set(ids[:6]) & {*engine.eos_token_ids, IM_START}, ids
    return ids


async def run(
    engine: AsyncEngine, prompt, params: SamplingParams
) -> tuple[list[TokenEvent], FinishedEvent]:
    events = await asyncio.wait_for(_all(engine.generate(prompt, params)), 60)
    assert isinstance(events[-1], FinishedEvent), events[-1]
    return events[:-1], events[-1]


async def _all(stream) -> list:
    return [e async for e in stream]


async def wait_load(engine: AsyncEngine, running: int, waiting: int) -> None:
    for _ in range(500):
        load = engine.load()
        if (load.running, load.waiting) == (running, waiting):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"load never reached running={running} waiting={waiting}: {engine.load()}")


class TestQueueBound:
    async def test_a_place_freed_by_an_abort_is_usable_at_once(self, engine):
        """Aborting a waiting choice, or closing its stream, frees its place in the queue at
        once: `num_queued` counted it until the next tick drained the cancellation, so a
        submission right after the abort was refused with QueueFullError. A running choice
        aborted frees no queue place, and a place is never handed out twice."""
        holder = engine.generate(PROMPT, HOLD, request_id="holder")
        assert isinstance(await holder.__anext__(), TokenEvent)  # admitted: it holds the slot
        waiting = [engine.generate(PROMPT, HOLD, request_id=f"w{i}") for i in range(MAX_QUEUED)]
        with pytest.raises(QueueFullError):
            engine.generate(PROMPT, HOLD)
        await engine.abort("w0")
        await engine.abort("w0")  # twice: still one place
        again = engine.generate(PROMPT, HOLD, request_id="again")  # the freed place, at once
        with pytest.raises(QueueFullError):
            engine.generate(PROMPT, HOLD)
        await waiting[1].aclose()  # a client that walks away frees its place too
        closed = engine.generate(PROMPT, HOLD, request_id="closed")
        with pytest.raises(QueueFullError):
            engine.generate(PROMPT, HOLD)
        await engine.abort("holder")  # running: its slot frees, the queue bound does not move
        with pytest.raises(QueueFullError):
            engine.generate(PROMPT, HOLD)
        await wait_load(engine, running=1, waiting=1)  # "again" took the slot, "closed" waits
        for name in ("again", "closed"):
            await engine.abort(name)
        for stream in (holder, waiting[0], again, closed):
            events = await asyncio.wait_for(_all(stream), 60)
            assert isinstance(events[-1], FinishedEvent) and events[-1].reason == "abort"
        await wait_load(engine, running=0, waiting=0)


class TestMinTokensAndLogitBias:
    async def test_min_tokens_delays_an_eos_that_would_come_first(self, engine, eos, reference):
        """An EOS biased far ahead is sampled at once, or, with min_tokens k, as token k + 1:
        before it the rank masks it (greedy: the unbiased tokens; random: never the EOS), so
        the request stops there with "stop" (ignore_eos is false)."""
        biased = {eos: 100.0}
        tokens, fin = await run(
            engine, PROMPT, SamplingParams(max_tokens=8, temperature=0.0, logit_bias=biased)
        )
        assert [t.token_id for t in tokens] == [eos] and (fin.reason, fin.output_tokens) == (
            "stop",
            1,
        )
        params = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=biased, min_tokens=4)
        tokens, fin = await run(engine, PROMPT, params)
        assert [t.token_id for t in tokens] == reference[:4] + [eos]
        assert (fin.reason, fin.output_tokens) == ("stop", 5)
        assert "".join(t.text for t in tokens) + fin.text == engine.tokenizer.decode(reference[:4])
        params = SamplingParams(
            max_tokens=8, temperature=1.0, seed=3, logit_bias=biased, min_tokens=3
        )
        tokens, fin = await run(engine, PROMPT, params)
        ids = [t.token_id for t in tokens]
        assert eos not in ids[:3] and ids[3:] == [eos] and fin.reason == "stop", ids
        assert [t.token_id for t in (await run(engine, PROMPT, params))[0]] == ids  # seeded

    async def test_stop_token_ids_masked_too(self, engine, reference):
        """A request's own stop ids are masked as EOS is: with the second greedy token as a
        stop id the request runs past it to min_tokens."""
        stop = reference[1]
        params = SamplingParams(
            max_tokens=6, temperature=0.0, stop_token_ids=[stop], ignore_eos=True
        )
        tokens, fin = await run(engine, PROMPT, params)
        assert len(tokens) == 2 and fin.reason == "stop"
        params = SamplingParams(
            max_tokens=6,
            temperature=0.0,
            stop_token_ids=[stop],
            ignore_eos=True,
            min_tokens=3,
            logit_bias={stop: 100.0},
        )
        tokens, fin = await run(engine, PROMPT, params)
        ids = [t.token_id for t in tokens]
        assert stop not in ids[:3] and ids[3:] == [stop] and fin.reason == "stop", ids

    async def test_logit_bias_steers_and_out_of_vocabulary_ids_are_refused(self, engine, reference):
        target = reference[5]
        for extra in (dict(temperature=0.0), dict(temperature=1.0, seed=9)):
            params = SamplingParams(
                max_tokens=4, ignore_eos=True, logit_bias={target: 100.0}, **extra
            )
            tokens, _ = await run(engine, PROMPT, params)
            assert [t.token_id for t in tokens] == [target] * 4
        with pytest.raises(ValueError, match=rf"logit_bias has token ids \[{VOCAB}, {VOCAB + 7}\]"):
            engine.generate(
                PROMPT, SamplingParams(logit_bias={5: 1.0, VOCAB: 1.0, VOCAB + 7: -1.0})
            )

    async def test_include_stop_str_keeps_a_stop_token_text(self, engine, reference):
        """As vLLM's detokenizer: the stop token's text is left out, unless
        include_stop_str_in_output."""
        decode = engine.tokenizer.decode
        for include, n in ((False, 2), (True, 3)):
            params = SamplingParams(
                max_tokens=6,
                temperature=0.0,
                stop_token_ids=[reference[2]],
                include_stop_str_in_output=include,
            )
            tokens, fin = await run(engine, PROMPT, params)
            assert "".join(t.text for t in tokens) + fin.text == decode(reference[:n])


class TestOverHttp:
    """The fields as an OpenAI client sends them: first-class (logit_bias) or in extra_body."""

    async def test_min_tokens_and_logit_bias_on_both_endpoints(
        self, client, engine, eos, reference
    ):
        bias = {str(eos): 100}
        out = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logit_bias=bias,
            extra_body={"min_tokens": 4},
        )
        choice = out.choices[0]
        assert (choice.finish_reason, out.usage.completion_tokens) == ("stop", 5)
        assert choice.text == engine.tokenizer.decode(reference[:4])
        messages = [{"role": "user", "content": "hi"}]
        chat = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            logit_bias=bias,
            extra_body={"min_tokens": 2},
        )
        assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("stop", 3)
        chat = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, logit_bias=bias
        )
        assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("stop", 1)

    async def test_special_tokens_kept_when_asked(self, client):
        """skip_special_tokens=false keeps a special token's text; spaces_between_special_tokens
        changes nothing with this (fast) tokenizer, as in vLLM."""
        texts = []
        for extra in (
            {},
            {"skip_special_tokens": False},
            {"skip_special_tokens": False, "spaces_between_special_tokens": False},
        ):
            out = await client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=3,
                temperature=0,
                logit_bias={str(IM_START): 100},
                extra_body=extra,
            )
            texts.append(out.choices[0].text)
        assert texts == ["", "<|im_start|>" * 3, "<|im_start|>" * 3]

    async def test_include_stop_str_in_output(self, client, engine, reference):
        text = engine.tokenizer.decode(reference)
        stop = text[3:7]
        kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
        plain = (
            await client.completions.create(**kwargs, extra_body={"ignore_eos": True})
        ).choices[0]
        kept = (
            await client.completions.create(
                **kwargs, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
            )
        ).choices[0]
        assert (plain.text, plain.finish_reason) == (text[: text.index(stop)], "stop")
        assert (kept.text, kept.finish_reason) == (text[: text.index(stop) + len(stop)], "stop")

    @pytest.mark.parametrize(
        "body, param, words",
        [
            ({"logit_bias": {str(VOCAB + 1): 5}}, "logit_bias", f"[{VOCAB + 1}]"),
            ({"logit_bias": {"abc": 5}}, "logit_bias", "not a token id"),
            ({"max_tokens": 3, "extra_body": {"min_tokens": 4}}, "min_tokens", "max_tokens=3"),
        ],
    )
    async def test_refused_naming_the_field(self, client, body, param, words):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(
                model="tiny", prompt=PROMPT, **{"max_tokens": 4, **body}
            )
        error = info.value.response.json()["error"]
        assert error["param"] == param and words in error["message"], error


class TestAllowedAndBadWords:
    """allowed_token_ids and bad_words act on the rank: greedy and seeded random tokens."""

    async def test_allowed_token_ids_only(self, engine, reference):
        allowed = sorted({reference[3], reference[4]})
        assert reference[0] not in allowed  # the argmax of the first step is barred
        for extra in (dict(temperature=0.0), dict(temperature=1.0, seed=4)):
            params = SamplingParams(
                max_tokens=5, ignore_eos=True, allowed_token_ids=allowed, **extra
            )
            ids = [t.token_id for t in (await run(engine, PROMPT, params))[0]]
            assert set(ids) <= set(allowed) and len(ids) == 5, ids
        with pytest.raises(ValueError, match=rf"^allowed_token_ids has token ids \[{VOCAB}\]"):
            engine.generate(PROMPT, SamplingParams(allowed_token_ids=[1, VOCAB]))

    async def test_bad_words_never_appear(self, engine, reference):
        """A two-token word: its first token still comes, its second not after it; a one-token
        word biased far ahead (random sampling) never comes."""
        decode = engine.tokenizer.decode
        encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        pair = decode(reference[1:3])
        assert SamplingParams(bad_words=[pair]).tokenize_bad_words(encode).bad_words_token_ids == (
            tuple(reference[1:3]),
        )
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, bad_words=[pair])
        ids = [t.token_id for t in (await run(engine, PROMPT, params))[0]]
        assert ids[:2] == reference[:2] and ids[2] != reference[2], ids
        target = reference[3]
        assert (target,) in SamplingParams(bad_words=[decode([target])]).tokenize_bad_words(
            encode
        ).bad_words_token_ids
        params = SamplingParams(
            max_tokens=6,
            temperature=1.0,
            seed=9,
            ignore_eos=True,
            logit_bias={target: 100.0},
            bad_words=[decode([target])],
        )
        ids = [t.token_id for t in (await run(engine, PROMPT, params))[0]]
        assert target not in ids and len(ids) == 6, ids


class TestExtrasOverHttp:
    """echo, stream_options.continuous_usage_stats, truncate_prompt_tokens, allowed_token_ids
    and bad_words as the openai client sends them (vLLM's extras in extra_body)."""

    async def test_echo(self, client, engine):
        kwargs = dict(model="tiny", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        plain = (await client.completions.create(prompt=PROMPT, **kwargs)).choices[0].text
        out = await client.completions.create(prompt=PROMPT, echo=True, n=2, **kwargs)
        assert [c.text for c in out.choices] == [PROMPT + plain] * 2
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        out = await client.completions.create(prompt=ids, echo=True, **kwargs)  # token ids: decoded
        assert out.choices[0].text == engine.tokenizer.decode(ids) + plain
        chunks = [
            c
            async for c in await client.completions.create(
                prompt=PROMPT, echo=True, stream=True, **kwargs
            )
        ]
        texts = [c.choices[0].text for c in chunks]
        assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + plain

    async def test_continuous_usage_stats(self, client):
        """Every chunk carries the usage so far (the chat's role chunk none of the output),
        then the final usage chunk; without include_usage none (vLLM's should_include_usage)."""
        options = {"include_usage": True, "continuous_usage_stats": True}
        stream = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        *choice_chunks, last = chunks
        prompt = last.usage.prompt_tokens
        assert last.choices == [] and last.usage.completion_tokens == 4 and prompt > 0
        counts = [c.usage.completion_tokens for c in choice_chunks]
        assert counts == sorted(counts) and counts[-1] == 4, counts
        assert all(
            c.usage.prompt_tokens == prompt
            and c.usage.total_tokens == prompt + c.usage.completion_tokens
            for c in choice_chunks
        )
        messages = [{"role": "user", "content": "hi"}]
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options=options,
        )
        chunks = [c async for c in stream]
        assert (
            chunks[0].choices[0].delta.role == "assistant"
            and chunks[0].usage.completion_tokens == 0
        )
        assert all(c.usage is not None for c in chunks)
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"continuous_usage_stats": True},
        )
        assert all([c.usage is None async for c in stream])

    async def test_truncate_prompt_tokens(self, client, engine):
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        kwargs = dict(model="tiny", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        tail = await client.completions.create(prompt=ids[-4:], **kwargs)
        for prompt in (PROMPT, ids):
            out = await client.completions.create(
                prompt=prompt,
                **{**kwargs, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 4}},
            )
            assert (out.choices[0].text, out.usage.prompt_tokens) == (tail.choices[0].text, 4)
        out = await client.completions.create(
            prompt=ids,
            echo=True,
            **{**kwargs, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 4}},
        )
        assert out.choices[0].text == engine.tokenizer.decode(ids[-4:]) + tail.choices[0].text
        out = await client.completions.create(
            prompt=ids, extra_body={"truncate_prompt_tokens": -1}, model="tiny", max_tokens=3
        )
        assert out.usage.prompt_tokens == len(ids)
        messages = [{"role": "user", "content": PROMPT}]
        chat = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_body={"truncate_prompt_tokens": 5}
        )
        assert chat.usage.prompt_tokens == 5
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(
                prompt=ids, extra_body={"truncate_prompt_tokens": 254}, model="tiny", max_tokens=3
            )
        error = info.value.response.json()["error"]
        assert error["param"] == "truncate_prompt_tokens" and "= 253" in error["message"], error

    async def test_allowed_token_ids_and_bad_words(self, client, engine, reference):
        allowed = [reference[3], reference[4]]
        out = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
        )
        assert set(engine.tokenizer.encode(out.choices[0].text, add_special_tokens=False)) <= set(
            allowed
        )
        word = engine.tokenizer.decode(reference[1:3])
        out = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            extra_body={"bad_words": [word], "ignore_eos": True},
        )
        assert word not in out.choices[0].text and out.usage.completion_tokens == 4
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"allowed_token_ids": [reference[3]]},
        )
        assert chat.choices[0].message.content == engine.tokenizer.decode([reference[3]] * 2)
        for extra, param, words in (
            ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids", f"[{VOCAB}]"),
            ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
            ({"bad_words": [" "]}, "bad_words", "at least one token"),
        ):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=2, extra_body=extra
                )
            error = info.value.response.json()["error"]
            assert error["param"] == param and words in error["message"], error
