"""vLLM's small extras, on plain values (no engine): allowed_token_ids, bad_words,
truncate_prompt_tokens, stream_options.continuous_usage_stats, echo and prompt_logprobs as the
request parser takes them, SamplingParams freezes and tokenizes them, the rank's Sampler masks
with them, and the formatters write them. Through the real engine and server:
tests/test_engine_sampling.py and tests/test_http_prompt_logprobs.py."""

from __future__ import annotations

import msgspec
import pytest
import torch

from deltaserve.engine.events import FinishedEvent
from deltaserve.engine.rank.sampler import Sampler
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.errors import ApiError
from deltaserve.http.protocol import parse_chat_request, parse_completion_request, truncate_prompt
from deltaserve.http.responses import ChatFormatter, ChoiceState, CompletionFormatter
from deltaserve.ipc.messages import SamplingSpec

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def refused(parse, body: dict, param: str, words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    assert words in info.value.message, info.value.message


class TestParse:
    def test_fields_reach_the_request_and_params(self):
        body = {
            "prompt": "x",
            "allowed_token_ids": [7, 3, 7],
            "bad_words": ["no", " way"],
            "truncate_prompt_tokens": 5,
            "echo": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        r = parse_completion_request(body)
        assert (r.echo, r.truncate_prompt_tokens, r.include_usage, r.continuous_usage) == (
            True,
            5,
            True,
            True,
        )
        p = r.sampling
        assert (p.allowed_token_ids, p.bad_words) == ((3, 7), ("no", " way"))
        c = parse_chat_request(
            {
                **CHAT,
                "truncate_prompt_tokens": -1,
                "allowed_token_ids": [1],
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            }
        )
        assert (c.truncate_prompt_tokens, c.sampling.allowed_token_ids) == (-1, (1,))
        # as vLLM's should_include_usage: continuous stats only with include_usage
        assert (c.include_usage, c.continuous_usage) == (False, False)

    @pytest.mark.parametrize(
        "extra, param, words",
        [
            ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
            ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids", "allowed_token_ids[1]"),
            ({"allowed_token_ids": 5}, "allowed_token_ids", "list"),
            ({"bad_words": "no"}, "bad_words", "list of strings"),
            ({"bad_words": ["ok", 3]}, "bad_words", "bad_words[1]"),
            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1 or -1"),
            ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ">= 1 or -1"),
            ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens", "integer"),
            ({"echo": 1}, "echo", "boolean"),
        ],
    )
    def test_refused_naming_the_field(self, extra, param, words):
        refused(parse_completion_request, {"prompt": "x", **extra}, param, words)

    def test_prompt_logprobs_as_vllm(self):
        """Given, they reach the params; else echo with logprobs asks the prompt's at the logprobs
        count (vLLM's to_sampling_params); a stream takes 0 and echo's."""

        def asked(**body):
            return parse_completion_request({"prompt": "x", **body}).sampling.prompt_logprobs

        assert (asked(echo=True, logprobs=3), asked(echo=True, logprobs=3, prompt_logprobs=0)) == (
            3,
            0,
        )
        assert (asked(logprobs=3), asked(echo=True), asked(prompt_logprobs=2.0)) == (None, None, 2)
        assert (
            asked(stream=True, prompt_logprobs=0),
            asked(stream=True, echo=True, logprobs=1),
        ) == (0, 1)
        assert parse_chat_request({**CHAT, "prompt_logprobs": 20}).sampling.prompt_logprobs == 20

    def test_chat_has_no_echo(self):
        refused(parse_chat_request, {**CHAT, "echo": True}, "echo", "unknown")

    def test_truncate_prompt_keeps_the_last_tokens(self):
        ids = list(range(10))
        assert truncate_prompt(ids, None, 4, 64) == ids
        assert truncate_prompt(ids, 3, 4, 64) == [7, 8, 9]
        assert truncate_prompt(ids, 30, 4, 64) == ids
        # newer vLLM: max_model_len - max_tokens
        assert truncate_prompt(ids, -1, 56, 64) == list(range(2, 10))
        assert truncate_prompt(ids, -1, None, 64) == ids
        with pytest.raises(ApiError) as info:
            truncate_prompt(ids, 61, 4, 64)
        assert (
            info.value.param == "truncate_prompt_tokens"
            and "max_model_len - max_tokens = 60" in info.value.message
        )
        with pytest.raises(ApiError, match="max_model_len - max_tokens = 0"):
            truncate_prompt(ids, -1, 64, 64)


def fake_encode(text: str) -> list[int]:
    """One token per word; a word after a space is another token than at the start (as BPE
    vocabularies do), except "x"; "" is no token."""
    ids = []
    for k, word in enumerate(text.split(" ")):
        if word:
            ids.append(ord(word[0]) + (0 if k == 0 or word == "x" else 1000))
    return ids


class TestSamplingParams:
    def test_allowed_token_ids_frozen_and_checked(self):
        assert SamplingParams(allowed_token_ids=[9, 2, 9]).allowed_token_ids == (2, 9)
        for bad, words in (([], "empty"), ([1, -1], "token ids in"), ("12", "list")):
            with pytest.raises(ValueError, match=f"^allowed_token_ids .*{words}"):
                SamplingParams(allowed_token_ids=bad)

    def test_bad_words_tokenized_as_vllm(self):
        """Each word alone and after a space; the spaced form only when it starts with another
        token and has as many (vLLM's update_from_tokenizer); words deduplicated in order."""
        p = SamplingParams(bad_words=["ab", " cd ef", "x", "ab"]).tokenize_bad_words(fake_encode)
        assert p.bad_words == ("ab", " cd ef", "x")
        assert p.bad_words_token_ids == ((97,), (1097,), (99, 1101), (1099, 1101), (120,))
        spec = p.to_spec(seed=1)
        assert spec.bad_words == p.bad_words_token_ids and spec.allowed_token_ids == ()
        with pytest.raises(
            ValueError, match="^bad_words entry ' ' must tokenize to at least one token"
        ):
            SamplingParams(bad_words=[" "]).tokenize_bad_words(fake_encode)
        with pytest.raises(ValueError, match="^bad_words must be tokenized"):
            SamplingParams(bad_words=["ab"]).to_spec(seed=1)
        with pytest.raises(ValueError, match="^bad_words give more than 128"):
            SamplingParams(bad_words=[f"w{i} y" for i in range(65)]).tokenize_bad_words(fake_encode)

    def test_allowed_reach_the_spec(self):
        assert SamplingParams(allowed_token_ids=[4, 1]).to_spec(seed=0).allowed_token_ids == (1, 4)
        assert SamplingSpec(seed=0).allowed_token_ids == () and SamplingSpec(seed=0).bad_words == ()


class _Strings:
    def text(self, token_id: int) -> str:
        return f"<{token_id}>"


class _Token:
    def __init__(self, token_id: int, text: str) -> None:
        self.token_id, self.text, self.logprob, self.top_logprobs = token_id, text, -1.0, []


class TestFormatters:
    def test_echo_prefixes_each_choice_once(self):
        """Choice p*n+i starts with prompt p's text, sent with its first event even when that
        event has no text yet; the body's text is the prompt and the output."""
        f = CompletionFormatter("id", "m", _Strings(), logprobs=False)
        f.echo(["P0", "P1"], n=2)
        states = [ChoiceState() for _ in range(4)]
        assert f.token(3, _Token(5, ""), states[3])["choices"][0]["text"] == "P1"
        assert f.token(3, _Token(6, "b"), states[3])["choices"][0]["text"] == "b"
        assert (
            f.finish(0, FinishedEvent(0, "stop", 0, 0, "z"), states[0])["choices"][0]["text"]
            == "P0z"
        )
        assert "".join(states[3].text) == "P1b"

    def test_continuous_usage_on_every_chunk(self):
        """vLLM's continuous_usage_stats: each choice chunk carries the prompt's tokens and the
        choice's tokens so far; the chat's role chunk 0 of them."""
        f = CompletionFormatter("id", "m", _Strings(), logprobs=False, continuous_usage=True)
        state = ChoiceState(prompt_tokens=7)
        f.token(0, _Token(5, ""), state)  # no text: no chunk, still counted
        chunk = f.token(0, _Token(6, "a"), state)
        assert chunk["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
        chat = ChatFormatter("id", "m", _Strings(), logprobs=False, continuous_usage=True)
        assert chat.start(0, ChoiceState(prompt_tokens=3))["usage"]["completion_tokens"] == 0
        assert "usage" not in CompletionFormatter("id", "m", _Strings(), False).token(
            0, _Token(6, "a"), ChoiceState()
        )


class TestMasksOnTheRank:
    """allowed_token_ids and bad_words in the rank's Sampler, on plain logits: masks applied
    after the bias and penalties (as vLLM's before them: a masked logit stays -inf), the
    logprobs of the raw distribution."""

    def test_allowed_token_ids_hold_greedy_and_random(self):
        logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(0)) * 3
        top = int(logits[0].argmax())
        allowed = ((top + 1) % 40, (top + 7) % 40)
        best = max(allowed, key=lambda t: float(logits[0, t]))
        sampler = Sampler()
        sampler.add(1, SamplingSpec(seed=0, allowed_token_ids=tuple(sorted(allowed))))
        sampler.add(
            2,
            SamplingSpec(
                seed=5,
                temperature=1.5,
                allowed_token_ids=tuple(sorted(allowed)),
                logit_bias=((top, 100.0),),
            ),
        )
        drawn = set()
        for _ in range(30):
            greedy, random = sampler.sample([1, 2], logits.repeat(2, 1))
            assert greedy.token_id == best != top
            assert greedy.logprob == pytest.approx(float(logits[0].log_softmax(-1)[best]), abs=1e-5)
            drawn.add(random.token_id)
        assert drawn == set(allowed)  # both, never the biased argmax

    def test_bad_words_forbid_the_last_token_after_the_prefix(self):
        """The rows of `steps` have argmax 5, 6, 7, 3 (each time 9 second): a word ending in 3
        turns the fourth token to 9 only after its whole prefix; (3,) always bars 3, even
        biased; the prompt is no prefix (vLLM matches output tokens only)."""
        steps = torch.zeros(4, 10)
        for k, t in enumerate((5, 6, 7, 3)):
            steps[k, t], steps[k, 9] = 4.0, 3.0

        def tokens(spec: SamplingSpec, prompt: list[int] = ()) -> list[int]:
            sampler = Sampler()
            sampler.add(0, spec)
            sampler.observe(0, list(prompt), is_prompt=True)
            return [sampler.sample([0], steps[k : k + 1])[0].token_id for k in range(4)]

        assert tokens(SamplingSpec(seed=0)) == [5, 6, 7, 3]
        assert tokens(SamplingSpec(seed=0, bad_words=((7, 3),))) == [5, 6, 7, 9]
        assert tokens(SamplingSpec(seed=0, bad_words=((5, 6, 7, 3),))) == [5, 6, 7, 9]
        assert tokens(SamplingSpec(seed=0, bad_words=((6, 3), (8, 7, 3), (5, 6, 6, 3)))) == [
            5,
            6,
            7,
            3,
        ]
        assert tokens(SamplingSpec(seed=0, bad_words=((3,),), logit_bias=((3, 100.0),))) == [
            5,
            6,
            7,
            9,
        ]
        assert tokens(SamplingSpec(seed=0, bad_words=((4, 5),)), prompt=[4]) == [5, 6, 7, 3]
        wide = SamplingSpec(seed=0, temperature=1.0, bad_words=((5,), (5, 3)))
        assert [tokens(msgspec.structs.replace(wide, seed=s))[0] for s in range(20)].count(5) == 0
