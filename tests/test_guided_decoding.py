"""Guided decoding on rank 0 (engine/rank/grammar_mask.py, engine/rank/sampler.py): llguidance's
masks keep guided rows on their grammar beside unguided ones, on a made-up vocabulary and on
Qwen3.5's real one; a request past its bounds (lexer states, mask time) fails alone and is
reported once; and SamplingParams take one constraint, in shapes they check themselves."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from llguidance import LLTokenizer, TokenizerWrapper

from deltaserve.engine.guided.grammar import constraint_grammar
from deltaserve.engine.rank.grammar_mask import LANE_REQUESTS, GuideMatchers, load_tokenizer
from deltaserve.engine.rank.sampler import Sampler
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.tokenizer import load_tokenizer as load_hf_tokenizer
from deltaserve.ipc.messages import GuideLimits, SamplingSpec

VOCAB = [None, b"a", b"b", b"ab", b"c", b"{", b"}", b'"', b"1", b"12", b"x"]  # token 0: EOS
EOS = 0
WIDTH = 16  # the logits' width: tokens 11.. are padding rows
LIMITS = GuideLimits(max_lexer_states=10_000, max_mask_ms=5_000.0)


class _Made:
    """TokenizerWrapper's view of VOCAB (encoding: longest token first)."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [b or b"" for b in VOCAB] + [b""] * (WIDTH - len(VOCAB))
    special_token_ids = [EOS, *range(len(VOCAB), WIDTH)]

    def __call__(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            t = max(
                (t for t, b in enumerate(VOCAB) if b and data.startswith(b, i)),
                key=lambda t: len(VOCAB[t]),
                default=None,
            )
            if t is None:  # a byte no token spells: left out
                i += 1
                continue
            out.append(t)
            i += len(VOCAB[t])
        return out


def _tokenizer(end_ids: tuple[int, ...]) -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(_Made()), n_vocab=WIDTH, eos_token=list(end_ids))


def _sampler() -> Sampler:
    return Sampler(_tokenizer)


def _regex(pattern: str, limits: GuideLimits = LIMITS, **extra) -> SamplingSpec:
    return SamplingSpec(
        guide_grammar=constraint_grammar("regex", pattern, None),
        guide_end_ids=(EOS,),
        guide_limits=limits,
        **{"seed": 0, **extra},
    )


def _logits(favour: dict[int, float], width: int = WIDTH) -> torch.Tensor:
    """One row: token 10 ("x", never allowed) far ahead of all, then the `favour`ed ones."""
    row = torch.zeros(1, width)
    row[0, 10] = 20.0
    for token, value in favour.items():
        row[0, token] = value
    return row


def _walk(spec: SamplingSpec, rows: list[torch.Tensor], device: str = "cpu") -> list[int]:
    """Request 1's tokens, one per row, batched behind an unguided greedy request 2 whose token
    (the row's argmax) must not change; request 1's logprobs stay raw."""
    sampler = _sampler()
    sampler.add(1, spec)
    sampler.add(2, SamplingSpec(seed=0))
    tokens = []
    for row in rows:
        logits = torch.cat([row, row]).to(device)
        launch = sampler.launch([2, 1], logits)
        assert launch.failed == {}
        other, sample = sampler.finish(launch)
        assert other.token_id == int(row.argmax())
        assert sample.logprob == pytest.approx(
            float(logits[1].log_softmax(-1)[sample.token_id]), abs=1e-5
        )
        tokens.append(sample.token_id)
    return tokens


class TestSampler:
    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_greedy_follows_the_pattern_against_the_logits(self, device):
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no GPU")
        spec = _regex("(?:ab|c)+")
        # "ab" as one token or two; at a match the EOS competes with going on
        rows = [_logits({3: 2.0, 1: 1.0}), _logits({EOS: 1.0, 4: 2.0}), _logits({EOS: 3.0})]
        assert _walk(spec, rows, device) == [3, 4, EOS]
        rows = [_logits({1: 2.0}), _logits({2: 0.5, 4: 3.0}), _logits({})]
        assert _walk(spec, rows, device) == [1, 2, EOS]

    def test_logit_bias_chooses_among_the_allowed_only(self):
        """A bias moves the choice between the pattern's tokens ("c" over "ab" here) and can
        never lift one the pattern does not allow (token 10, "x", biased far ahead)."""
        spec = _regex("(?:ab|c)+", logit_bias=((4, 5.0), (10, 100.0)))
        rows = [_logits({3: 2.0}), _logits({3: 2.0}), _logits({EOS: 9.0})]
        assert _walk(spec, rows) == [4, 4, EOS]

    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_thinking_budget_forces_the_end_of_thinking(self, device):
        """With a budget of 2, the third token is think_end_id whatever the logits (token 10
        far ahead); after it nothing is forced. Its end sampled early, none is forced."""
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no GPU")
        spec = SamplingSpec(seed=0, think_budget=2, think_end_id=4)
        assert _walk(spec, [_logits({}) for _ in range(5)], device) == [10, 10, 4, 10, 10]
        rows = [_logits({4: 30.0}), *(_logits({}) for _ in range(4))]
        assert _walk(spec, rows, device) == [4, 10, 10, 10, 10]
        random = SamplingSpec(seed=3, temperature=1.0, think_budget=0, think_end_id=7)
        g = torch.Generator().manual_seed(0)
        assert _walk(random, [torch.randn(1, 16, generator=g) for _ in range(3)])[0] == 7

    def test_a_complete_output_offers_only_the_end(self):
        assert _walk(_regex("12?"), [_logits({9: 1.0}), _logits({8: 5.0})]) == [9, EOS]

    def test_random_rows_stay_on_the_pattern(self):
        """Seeded random sampling over random logits: every output of each seed matches."""
        pattern = r'\{"(?:a|b)*"\}'
        seen = set()
        for seed in range(30):
            spec = _regex(pattern, temperature=1.5, top_p=0.95, seed=seed)
            g = torch.Generator().manual_seed(seed)
            out = _walk(spec, [torch.randn(1, 16, generator=g) for _ in range(12)])
            text = b"".join(VOCAB[t] for t in out[: out.index(EOS)] if t) if EOS in out else None
            assert text is None or re.fullmatch(pattern, text.decode()), out
            if text is not None:
                seen.add(text)
        assert len(seen) > 3

    def test_a_grammar_is_built_once_per_lane_and_refused_without_a_vocabulary(self):
        """Requests of one grammar copy one template: the second builds nothing. Past
        LANE_REQUESTS on each, the grammar gets another lane (a template of its own)."""
        built = []

        def counting(end_ids):
            built.append(end_ids)
            return _tokenizer(end_ids)

        guides = GuideMatchers(counting)
        grammar = constraint_grammar("regex", "a+", None)
        guides.add(1, grammar, (EOS,), LIMITS)
        guides.add(2, grammar, (EOS,), LIMITS)
        assert built == [(EOS,)] and len(guides._grammars) == 1
        for rid in range(3, 3 + LANE_REQUESTS):
            guides.add(rid, grammar, (EOS,), LIMITS)
        lanes = next(iter(guides._grammars.values())).lanes
        assert [lane.live for lane in lanes] == [LANE_REQUESTS, 2]
        masks = guides.masks(list(range(1, 3 + LANE_REQUESTS)), WIDTH)  # both lanes filled
        assert (masks == masks[0]).all() and guides.take_failures(list(range(1, 7))) == {}
        with pytest.raises(ValueError, match="tokenizer"):
            Sampler().add(1, _regex("a+"))


class TestBounds:
    """A request past its own bounds fails alone: reported once, with its sample; the other
    rows of the step are sampled as ever, and the grammar's template is dropped."""

    def _step(self, sampler: Sampler, favour: dict[int, float]) -> tuple[list[int], dict]:
        row = _logits(favour)
        launch = sampler.launch([2, 1], torch.cat([row, row]))
        samples = sampler.finish(launch)
        return [s.token_id for s in samples], launch.failed

    def test_lexer_states(self):
        """`(?:a|b)*a(?:a|b){12}`'s DFA doubles its states per byte: 40 of them are soon past."""
        sampler = _sampler()
        sampler.add(1, _regex("(?:a|b)*a(?:a|b){12}", GuideLimits(40, 5_000.0)))
        sampler.add(2, SamplingSpec(seed=0))
        failed = {}
        for _ in range(30):
            tokens, failed = self._step(sampler, {1: 2.0, 2: 1.9})
            assert tokens[0] == 10  # the unguided row: its own argmax, always
            if failed:
                break
        assert list(failed) == [1] and "too many states" in failed[1], failed
        assert self._step(sampler, {1: 2.0})[1] == {}  # reported once
        assert all(not known.lanes for known in sampler._guides._grammars.values())

    def test_mask_time(self):
        """A mask that takes longer than max_mask_ms ends its request (a bound of 1 us: any)."""
        sampler = _sampler()
        sampler.add(1, _regex("(?:ab|c)+", GuideLimits(10_000, 0.001)))
        sampler.add(2, SamplingSpec(seed=0))
        tokens, failed = self._step(sampler, {3: 2.0})
        assert tokens[0] == 10 and "max_mask_ms" in failed[1], failed

    def test_a_grammar_that_does_not_build_fails_at_its_first_sample(self):
        sampler = _sampler()
        sampler.add(
            1,
            SamplingSpec(
                seed=0, guide_grammar="start: (", guide_end_ids=(EOS,), guide_limits=LIMITS
            ),
        )
        sampler.add(2, SamplingSpec(seed=0))
        _, failed = self._step(sampler, {})
        assert "does not build" in failed[1]

    def test_a_vocabulary_that_cannot_be_read_fails_each_request_alone(self):
        """Read once: each guided request then fails at its first sample, none raises."""
        reads = []

        def unreadable(end_ids):
            reads.append(end_ids)
            raise OSError("no tokenizer.json")

        sampler = Sampler(unreadable)
        sampler.add(1, _regex("a+"))
        sampler.add(3, _regex("b+"))
        sampler.add(2, SamplingSpec(seed=0))
        row = _logits({})
        launch = sampler.launch([2, 1, 3], torch.cat([row, row, row]))
        sampler.finish(launch)
        assert set(launch.failed) == {1, 3} and "no tokenizer.json" in launch.failed[1]
        assert reads == [(EOS,)]


def test_masks_on_the_real_vocabulary(tiny_model_dir):
    """Qwen3.5's 248k tokens read from tokenizer.json: along a JSON document tokenized as the
    engine does, each next token is in the mask, the EOS ids never are until the end, and at
    the end only they are. llguidance reads every added token of the form <...> as special:
    `<tool_call>` is no text inside a string (its characters are, in other tokens)."""
    hf = load_hf_tokenizer(tiny_model_dir)
    end_ids = (hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>"))
    vocab = 248320
    guides = GuideMatchers(lambda e: load_tokenizer(str(tiny_model_dir), vocab, e))
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
    }
    guides.add(1, constraint_grammar("json", json.dumps(schema), None), end_ids, LIMITS)
    doc = '{"city": "Grüße, 世界 <b>", "n": -12}'
    tool_call = hf.convert_tokens_to_ids("<tool_call>")
    for token in hf.encode(doc, add_special_tokens=False):
        mask = np.unpackbits(guides.masks([1], vocab).view(np.uint8), bitorder="little")
        assert mask[token] and not any(mask[t] for t in end_ids), hf.decode([token])
        assert not mask[tool_call]
        guides.consume(1, token)
    mask = np.unpackbits(guides.masks([1], vocab).view(np.uint8), bitorder="little")
    assert np.flatnonzero(mask).tolist() == sorted(end_ids)
    assert guides.take_failures([1]) == {}


class TestParams:
    def test_one_constraint_in_its_kind(self):
        assert SamplingParams(guided_choice=["yes", "no", "yes"]).guided_choice == ("yes", "no")
        assert SamplingParams(guided_choice=["a.b"]).constraint() == (
            "guided_choice",
            "choice",
            '["a.b"]',
            None,
        )
        assert SamplingParams(guided_regex="[0-9]+").constraint().text == "[0-9]+"
        obj = SamplingParams(guided_json_object=True, guided_whitespace=" ?").constraint()
        assert obj == ("guided_json_object", "json_object", "", " ?")
        assert SamplingParams().constraint() is None and SamplingParams().is_prepared

    def test_generate_needs_the_compiled_grammar(self):
        params = SamplingParams(guided_regex="x", stop_regex=["y"])
        assert not params.is_prepared
        with pytest.raises(ValueError, match="engine.prepare"):
            params.to_spec(1, eos_token_ids={5})
        spec = SamplingParams(guided_regex="x", guide_grammar="G", guide_limits=LIMITS).to_spec(
            1, eos_token_ids={5, 3}
        )
        assert (spec.guide_grammar, spec.guide_end_ids, spec.guide_limits) == ("G", (3, 5), LIMITS)
        assert SamplingParams().to_spec(1, eos_token_ids={5}).guide_end_ids == ()

    @pytest.mark.parametrize(
        "extra, words",
        [
            (dict(guided_choice="yes"), "list of non-empty strings"),
            (dict(guided_choice=["yes", ""]), "list of non-empty strings"),
            (dict(guided_choice=[str(i) for i in range(257)]), "at most 256"),
            (dict(guided_choice=["yes"], guided_regex="y"), "not guided_choice and guided_regex"),
            (dict(guided_regex=5), "guided_regex must be a string"),
            (dict(guided_regex="a", guided_whitespace=" "), "guided_whitespace applies"),
            (dict(guided_choice=["yes"], allowed_token_ids=[7]), "combined with allowed_token_ids"),
            (dict(guided_choice=["yes"], bad_words=["no"]), "combined with bad_words"),
            (dict(guided_regex="a", min_tokens=1), "combined with min_tokens"),
            (dict(guided_regex="a", thinking_budget=3), "combined with thinking_budget"),
            (dict(thinking_budget=-1), "thinking_budget must be an integer >= 0"),
            (dict(stop_regex=[""]), "stop_regex must hold non-empty strings"),
        ],
    )
    def test_refused(self, extra, words):
        with pytest.raises(ValueError, match=re.escape(words)):
            SamplingParams(**extra)

    def test_a_schema_nested_past_the_encoder_is_refused_by_name(self):
        deep: dict = {}
        for _ in range(5000):
            deep = {"items": deep}
        with pytest.raises(ValueError, match="guided_json is nested too deep"):
            SamplingParams(guided_json=deep)

    def test_thinking_budget_reaches_the_spec_with_its_end_token(self):
        params = SamplingParams(thinking_budget=5)
        with pytest.raises(ValueError, match="resolve_thinking_end"):
            params.to_spec(1)
        with pytest.raises(ValueError, match="lacks"):
            params.resolve_thinking_end(None)
        spec = params.resolve_thinking_end(42).to_spec(1)
        assert (spec.think_budget, spec.think_end_id) == (5, 42)
        assert SamplingParams().to_spec(1).think_budget == -1
