"""Sampler rules (engine/rank/sampler.py) and SamplingParams validation, on plain tensors."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from deltaserve.engine.rank.sampler import Sampler
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.ipc.messages import SamplingSpec

VOCAB = 50
# the chi-square distribution's 0.999 quantile by degrees of freedom (1..7)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _logits(seed: int, rows: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3.0


def _draw(spec: SamplingSpec, logits_rows: list[torch.Tensor], companions: int = 0) -> list[int]:
    """Sample request 7 once per given logits row, with `companions` other random requests
    placed before it in the batch; returns request 7's tokens."""
    sampler = Sampler()
    sampler.add(7, spec)
    for c in range(companions):
        sampler.add(100 + c, SamplingSpec(seed=1000 + c, temperature=1.3, top_p=0.8))
    out = []
    for step, row in enumerate(logits_rows):
        ids = [100 + c for c in range(companions)] + [7]
        batch = torch.cat([_logits(9000 + step * 31 + c) for c in range(companions)] + [row[None]])
        samples = sampler.sample(ids, batch)
        assert [s.request_id for s in samples] == ids
        out.append(samples[-1].token_id)
    return out


class TestSampler:
    def test_launch_waits_for_the_previous_finish(self):
        """A launch counts the samples of the one before in its seeds and penalties, so a
        second launch before the first is finished is refused, not silently mis-seeded."""
        sampler = Sampler()
        sampler.add(0, SamplingSpec(seed=1, temperature=1.0, presence_penalty=0.5))
        first = sampler.launch([0], _logits(0))
        with pytest.raises(RuntimeError, match="before the previous launch was finished"):
            sampler.launch([0], _logits(1))
        [sample] = sampler.finish(first)
        assert sampler.finish(sampler.launch([0], _logits(1)))[0].request_id == 0
        assert sample.request_id == 0

    def test_each_token_goes_to_its_slot(self):
        """With slots, every row's token lands in its slot's last_tokens (the next pipelined
        step's input): greedy rows' argmax, and rows that are drawn or penalised away from it."""
        sampler = Sampler()
        specs = [
            SamplingSpec(seed=0, temperature=0.0),
            SamplingSpec(seed=1, temperature=1.5),
            SamplingSpec(seed=2, temperature=0.0, repetition_penalty=50.0),
        ]
        for r, spec in enumerate(specs):
            sampler.add(r, spec)
        logits = _logits(3, rows=3)
        top = int(logits[2].argmax())
        sampler.observe(2, [top], is_prompt=True)  # the penalty pushes row 2 off its argmax
        last_tokens = torch.full((6,), -1, dtype=torch.int64)
        samples = sampler.finish(sampler.launch([0, 1, 2], logits, [4, 0, 2], last_tokens))
        assert last_tokens[[4, 0, 2]].tolist() == [s.token_id for s in samples]
        assert samples[2].token_id != top and last_tokens[[1, 3, 5]].tolist() == [-1, -1, -1]

    def test_greedy_is_argmax_and_logprobs_are_raw(self):
        """Greedy rows take the argmax; logprobs are log_softmax of the raw logits and the
        alternatives come best first, as many as asked."""
        sampler = Sampler()
        for r in range(4):
            sampler.add(r, SamplingSpec(seed=r, temperature=0.0, num_logprobs=r * 2))
        logits = _logits(0, rows=4)
        samples = sampler.sample([0, 1, 2, 3], logits)
        raw = torch.log_softmax(logits, dim=-1)
        for r, s in enumerate(samples):
            assert s.token_id == int(logits[r].argmax())
            assert s.logprob == pytest.approx(float(raw[r, s.token_id]), abs=1e-6)
            assert len(s.top_logprobs) == r * 2
            values = [v for _, v in s.top_logprobs]
            assert values == sorted(values, reverse=True)
            for tok, v in s.top_logprobs:
                assert v == pytest.approx(float(raw[r, tok]), abs=1e-6)
            if s.top_logprobs:
                assert s.top_logprobs[0][0] == s.token_id

    def test_seeded_sampling_reproducible_and_batch_independent(self):
        spec = SamplingSpec(seed=1234, temperature=0.9, top_k=20, top_p=0.95)
        rows = [_logits(50 + i)[0] for i in range(12)]
        alone = _draw(spec, rows)
        assert _draw(spec, rows) == alone
        assert _draw(spec, rows, companions=3) == alone
        other_seed = _draw(SamplingSpec(seed=1235, temperature=0.9, top_k=20, top_p=0.95), rows)
        assert other_seed != alone  # 12 draws over a flat-ish distribution: a seed matters

    def test_tied_logits_give_the_same_tokens_alone_and_in_a_batch(self):
        """Exact ties among a top-k row's candidates (bf16-valued logits have many): a top-p
        companion widens the batch's candidate fetch, and torch.topk orders tied tokens
        differently at another width, so the row's noise met other tokens. Ties are now ranked
        by token id. (A tie exactly at the k-th place is left to topk: kept out of this test.)"""
        spec = SamplingSpec(seed=77, temperature=1.0, top_k=20)
        rows = []
        for i in range(40):
            row = _logits(700 + i)[0]
            order = row.argsort(descending=True)
            for a, b in (
                (0, 1),
                (2, 5),
                (6, 7),
                (7, 8),
                (10, 14),
                (15, 17),
            ):  # all above the 19th place
                row[order[b]] = row[order[a]]
            rows.append(row)
        alone = _draw(spec, rows)
        assert _draw(spec, rows, companions=2) == alone

    def test_tiny_repetition_penalty_picks_the_seen_token_not_nan(self):
        """repetition_penalty is any value > 0: at 1e-300 a seen token's positive logit goes
        past the largest float; it is held there, so the token wins (inf made NaN: token 0)."""
        row = _logits(41)[0]
        seen = int(row.argsort()[-5])  # positive, and not the best
        sampler = Sampler()
        sampler.add(7, SamplingSpec(seed=3, temperature=1.0, repetition_penalty=1e-300))
        sampler.observe(7, [seen], is_prompt=True)
        [sample] = sampler.sample([7], row[None])
        assert sample.token_id == seen and math.isfinite(sample.logprob)

    def test_top_k_one_is_greedy(self):
        rows = [_logits(300 + i)[0] for i in range(8)]
        assert _draw(SamplingSpec(seed=5, temperature=1.5, top_k=1), rows) == [
            int(r.argmax()) for r in rows
        ]

    def test_temperature_sampling_matches_softmax(self):
        """Chi-square of 4000 seeded draws against softmax(logits / T); fixed seeds, so the
        statistic is deterministic; the bound is the 0.999 quantile for 7 degrees of freedom."""
        logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2]])
        temperature = 0.8
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        sampler = Sampler()
        sampler.add(0, SamplingSpec(seed=42, temperature=temperature))
        n = 4000
        counts = torch.zeros(8)
        for _ in range(n):
            counts[sampler.sample([0], logits)[0].token_id] += 1
        chi2 = float((((counts - n * expected) ** 2) / (n * expected)).sum())
        assert chi2 < 24.3, (chi2, counts.tolist(), (n * expected).tolist())

    @pytest.mark.parametrize(
        "spec",
        [
            SamplingSpec(seed=21, temperature=1.0, top_k=3),
            SamplingSpec(seed=22, temperature=0.7, top_p=0.8),
            SamplingSpec(seed=23, temperature=1.2, min_p=0.2),
            SamplingSpec(seed=24, temperature=1.0, top_k=5, top_p=0.6),
            SamplingSpec(seed=25, temperature=0.9, min_p=0.05, top_k=6, top_p=0.9),
        ],
        ids=["top_k", "top_p", "min_p", "top_k_top_p", "all_three"],
    )
    def test_filtered_sampling_matches_the_filtered_softmax(self, spec):
        """Chi-square of 4000 seeded draws against the distribution vLLM's rules define,
        computed here from their definitions: softmax(logits / T); min-p keeps p >= min_p x
        max p; top-k the k most probable; top-p, on what is left renormalised, each token
        while the mass of the better ones is < top_p; then renormalised. Nothing outside
        that support is drawn; the bound is the 0.999 quantile for its degrees of freedom."""
        logits = [1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2]
        weights = [math.exp(v / spec.temperature) for v in logits]
        best_first = sorted(range(len(logits)), key=lambda t: -weights[t])
        keep = set(best_first)
        if spec.min_p > 0:
            keep = {t for t in keep if weights[t] >= spec.min_p * max(weights)}
        if spec.top_k > 0:
            keep &= set(best_first[: spec.top_k])
        if spec.top_p < 1:
            total, mass, nucleus = sum(weights[t] for t in keep), 0.0, set()
            for t in (t for t in best_first if t in keep):
                if mass / total < spec.top_p:
                    nucleus.add(t)
                mass += weights[t]
            keep = nucleus
        total = sum(weights[t] for t in keep)
        expected = [weights[t] / total if t in keep else 0.0 for t in range(len(logits))]
        sampler = Sampler()
        sampler.add(0, spec)
        n = 4000
        counts = [0] * len(logits)
        for _ in range(n):
            counts[sampler.sample([0], torch.tensor([logits]))[0].token_id] += 1
        assert {t for t, c in enumerate(counts) if c} == keep, (counts, expected)
        chi2 = sum((counts[t] - n * expected[t]) ** 2 / (n * expected[t]) for t in keep)
        assert 2 <= len(keep) <= 7, keep  # every case keeps a real choice, and cuts something
        assert chi2 < CHI2_999[len(keep) - 1], (chi2, counts, [n * e for e in expected])

    def test_filters_restrict_support(self):
        """top_k, top_p and min_p never let a token outside their set through."""
        logits = torch.tensor([[3.0, 2.9, 2.0, 1.0, 0.0, -1.0]])
        probs = torch.softmax(logits[0], dim=-1)  # ~[.41,.37,.15,.06,.02,.01]
        cases = {
            SamplingSpec(seed=1, temperature=1.0, top_k=2): {0, 1},
            SamplingSpec(seed=2, temperature=1.0, top_p=0.7): {0, 1},
            SamplingSpec(seed=3, temperature=1.0, top_p=0.8): {0, 1, 2},
            SamplingSpec(seed=4, temperature=1.0, min_p=0.3): {0, 1, 2},
            SamplingSpec(seed=5, temperature=1.0, min_p=0.5): {0, 1},
        }
        assert float(probs[:2].sum()) < 0.8 < float(probs[:3].sum())
        for spec, allowed in cases.items():
            sampler = Sampler()
            sampler.add(0, spec)
            seen = {sampler.sample([0], logits)[0].token_id for _ in range(300)}
            assert seen == allowed, (spec, seen)

    def test_top_p_nucleus_wider_than_the_candidates(self):
        """A flat distribution whose nucleus holds thousands of tokens (past the 1024 first
        looked at) matches vLLM's sort-based rule exactly."""
        vocab, p = 5000, 0.5
        logits = torch.linspace(1.0, 0.0, vocab)[
            torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
        ]
        ascending, order = logits.sort()
        drop = ascending.softmax(0).cumsum(0) <= 1 - p
        nucleus = set(order[~drop].tolist())
        assert len(nucleus) > 1500
        sampler = Sampler()
        sampler.add(0, SamplingSpec(seed=11, temperature=1.0, top_p=p))
        drawn = [sampler.sample([0], logits[None])[0].token_id for _ in range(300)]
        assert set(drawn) <= nucleus
        rank = {t: r for r, t in enumerate(logits.argsort(descending=True).tolist())}
        assert max(rank[t] for t in drawn) > 1024

    def test_batched_rows_equal_the_row_by_row_rule(self):
        """The random rows sampled together give each request exactly the token `_draw`
        gives it alone from the same seed: every filter mix, a nucleus past the first 1024
        candidates, several steps (the seed advances per token)."""
        from deltaserve.engine.rank.sampler import _draw, token_seed

        vocab = 3000
        specs = [
            SamplingSpec(seed=1, temperature=0.7),
            SamplingSpec(seed=2, temperature=1.0, top_k=5),
            SamplingSpec(seed=3, temperature=1.3, top_p=0.9),
            SamplingSpec(seed=4, temperature=1.0, top_k=40, top_p=0.5),
            SamplingSpec(seed=5, temperature=1.0, min_p=0.05),
            SamplingSpec(seed=6, temperature=0.9, min_p=0.02, top_k=1500),
            SamplingSpec(seed=7, temperature=50.0, top_p=0.95),  # flat: the nucleus passes 1024
            SamplingSpec(seed=8, temperature=1.0, top_k=vocab + 5),  # no real cut
        ]
        sampler = Sampler()
        for i, spec in enumerate(specs):
            sampler.add(i, spec)
        for step in range(3):
            logits = _logits(500 + step, rows=len(specs), vocab=vocab)
            got = [s.token_id for s in sampler.sample(list(range(len(specs))), logits)]
            want = []
            for spec, row in zip(specs, logits, strict=True):
                generator = torch.Generator().manual_seed(token_seed(spec.seed, step))
                want.append(int(_draw(row / spec.temperature, spec, generator)))
            assert got == want, step

    def test_penalties(self):
        """Repetition hits prompt and output tokens; presence/frequency only output tokens."""
        logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])

        def greedy_after(spec: SamplingSpec, prompt: list[int], output: list[int]) -> int:
            sampler = Sampler()
            sampler.add(0, spec)
            sampler.observe(0, prompt, is_prompt=True)
            sampler.observe(0, output, is_prompt=False)
            return sampler.sample([0], logits)[0].token_id

        base = dict(seed=0, temperature=0.0)
        assert greedy_after(SamplingSpec(**base), [0], []) == 0
        assert greedy_after(SamplingSpec(**base, repetition_penalty=2.0), [0], []) == 1
        assert greedy_after(SamplingSpec(**base, repetition_penalty=2.0), [], [0]) == 1
        assert greedy_after(SamplingSpec(**base, repetition_penalty=1.1), [0], []) == 0
        assert greedy_after(SamplingSpec(**base, presence_penalty=1.0), [0, 0, 0], []) == 0
        assert greedy_after(SamplingSpec(**base, presence_penalty=1.0), [], [0]) == 1
        assert greedy_after(SamplingSpec(**base, frequency_penalty=0.3), [], [0]) == 0
        assert greedy_after(SamplingSpec(**base, frequency_penalty=0.3), [], [0, 0]) == 1
        assert greedy_after(SamplingSpec(**base, frequency_penalty=-2.0), [], [3, 3, 3]) == 3
        # A sampled token counts as output history by itself.
        sampler = Sampler()
        sampler.add(0, SamplingSpec(**base, frequency_penalty=0.6))
        assert [sampler.sample([0], logits)[0].token_id for _ in range(2)] == [0, 1]

    def test_min_tokens_masks_stop_ids_greedy_and_random(self):
        """Until min_tokens tokens were sampled, the stop ids (EOS and stop_token_ids, as the
        engine sends them) are -inf on the rank, for greedy and random rows alike; the rows
        draw then exactly what they draw from the masked logits, and from the raw ones after
        (the seed is per output index), whatever else is in the batch."""
        from deltaserve.engine.rank.sampler import _draw, token_seed

        stops = (4, 9)
        specs = [
            SamplingSpec(seed=0, temperature=0.0, min_tokens=3, stop_token_ids=stops),
            SamplingSpec(seed=5, temperature=0.8, top_k=6, min_tokens=3, stop_token_ids=stops),
            SamplingSpec(seed=6, temperature=1.0, logit_bias=((2, 5.0),)),
        ]
        sampler = Sampler()
        for r, spec in enumerate(specs):
            sampler.add(r, spec)
        for step in range(5):
            logits = _logits(80 + step, rows=3)
            logits[:2, 9] = 40.0  # a stop id far ahead: taken as soon as it may be
            got = [s.token_id for s in sampler.sample([0, 1, 2], logits)]
            masked = logits.clone()
            if step < 3:
                masked[:2, list(stops)] = float("-inf")
            generator = torch.Generator().manual_seed(token_seed(specs[1].seed, step))
            drawn = int(_draw(masked[1] / specs[1].temperature, specs[1], generator))
            assert got[:2] == [int(masked[0].argmax()), drawn], step
            assert (got[0] in stops, got[1] in stops) == (step >= 3, step >= 3), (step, got)

    def test_min_tokens_mask_holds_under_a_repetition_penalty(self):
        """A tiny repetition penalty makes a seen stop id's logit by far the best; masked (after
        the penalties, which leaves it -inf as vLLM's order does) it is not sampled until
        min_tokens tokens were."""
        sampler = Sampler()
        sampler.add(
            0,
            SamplingSpec(
                seed=1, temperature=0.0, repetition_penalty=1e-30, min_tokens=2, stop_token_ids=(3,)
            ),
        )
        sampler.observe(0, [3], is_prompt=True)
        logits = torch.tensor([[1.0, 0.5, 0.0, 2.0, -1.0]])
        assert [sampler.sample([0], logits)[0].token_id for _ in range(3)] == [0, 0, 3]

    def test_logit_bias_is_added_before_penalties_and_temperature(self):
        """As vLLM: the bias is added to the logits, then the penalties act on the sum (a
        repetition penalty halves a biased positive logit), then temperature scales it: a
        biased request draws exactly what an unbiased one draws from the biased logits, and its
        logprobs stay those of the raw logits."""
        logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
        sampler = Sampler()
        sampler.add(0, SamplingSpec(seed=0, temperature=0.0, logit_bias=((2, 4.0),)))
        sampler.add(
            1, SamplingSpec(seed=0, temperature=0.0, logit_bias=((2, 4.0),), repetition_penalty=2.0)
        )
        sampler.observe(1, [2], is_prompt=True)
        first, second = sampler.sample([0, 1], logits.expand(2, -1))
        assert (first.token_id, second.token_id) == (2, 0)  # 4 > 3; (0 + 4) / 2 = 2 < 3
        assert first.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]), abs=1e-6)

        bias = ((1, -100.0), (7, 2.5), (30, 1.25), (49, 100.0 / 3))
        rows = [_logits(600 + i)[0] for i in range(10)]
        biased_rows = []
        for row in rows:
            row = row.clone()
            for t, b in bias:
                row[t] += b
            biased_rows.append(row)
        for extra in (dict(temperature=0.7), dict(temperature=1.3, top_p=0.9, min_p=0.01)):
            with_bias = _draw(SamplingSpec(seed=21, logit_bias=bias, **extra), rows, companions=2)
            assert with_bias == _draw(SamplingSpec(seed=21, **extra), biased_rows)
            assert 1 not in with_bias

    def test_biased_rows_follow_their_requests_through_a_changing_batch(self):
        """The bias index is kept while the batch keeps its layout and rebuilt when it changes
        (rows reordered, one request gone): each request's tokens stay its own."""
        specs = {
            3: SamplingSpec(seed=0, temperature=0.0, logit_bias=((11, 30.0),)),
            4: SamplingSpec(seed=0, temperature=0.0, logit_bias=((12, 30.0), (13, 31.0))),
            5: SamplingSpec(seed=0, temperature=0.0),
        }
        sampler = Sampler()
        for r, spec in specs.items():
            sampler.add(r, spec)
        want = {3: 11, 4: 13}
        for order in ([3, 4, 5], [3, 4, 5], [5, 4, 3], [4], [3, 5]):
            logits = _logits(len(order), rows=len(order))
            got = {s.request_id: s.token_id for s in sampler.sample(order, logits)}
            for row, r in enumerate(order):
                assert got[r] == want.get(r, int(logits[row].argmax())), (order, r)

    def test_token_ids_outside_the_vocabulary_are_refused(self):
        sampler = Sampler()
        with pytest.raises(ValueError, match="negative token id"):
            sampler.add(0, SamplingSpec(seed=0, logit_bias=((-1, 1.0),)))
        sampler.add(1, SamplingSpec(seed=0, logit_bias=((VOCAB, 1.0),)))
        with pytest.raises(ValueError, match=f"token id {VOCAB} .* outside the vocabulary"):
            sampler.sample([1], _logits(0))

    def test_unknown_request_and_shape_errors(self):
        sampler = Sampler()
        sampler.add(1, SamplingSpec(seed=0))
        with pytest.raises(ValueError, match="request 2"):
            sampler.sample([2], _logits(0))
        with pytest.raises(ValueError, match="shape"):
            sampler.sample([1], _logits(0, rows=2))
        with pytest.raises(ValueError, match="already"):
            sampler.add(1, SamplingSpec(seed=0))
        sampler.remove(1)
        sampler.remove(1)
        assert 1 not in sampler


class TestSamplingParams:
    @pytest.mark.parametrize(
        "field,value",
        [
            ("max_tokens", 0),
            ("max_tokens", 1.5),
            ("temperature", -0.1),
            ("temperature", math.nan),
            ("temperature", math.inf),
            ("top_p", 0.0),
            ("top_p", 1.01),
            ("top_k", -2),
            ("min_p", 1.5),
            ("presence_penalty", 2.5),
            ("frequency_penalty", -2.1),
            ("repetition_penalty", 0.0),
            ("seed", -(2**63) - 1),
            ("seed", 2**63),
            ("logprobs", -1),
            ("logprobs", 2.0),
            ("prompt_logprobs", -1),
            ("n", 0),
            ("n", 17),
            ("stop", ("",)),
            ("stop", "abc"),
            ("stop_token_ids", (-3,)),
            ("ignore_eos", 1),
            ("min_tokens", -1),
            ("min_tokens", 17),  # past max_tokens (16), as vLLM refuses it
            ("logit_bias", {-1: 1.0}),
            ("logit_bias", {1: 100.5}),
            ("logit_bias", {1: math.nan}),
            ("logit_bias", {True: 1.0}),
            ("logit_bias", "5"),
            ("logit_bias", ((1, 1.0), (1, 2.0))),
            ("include_stop_str_in_output", 1),
            ("skip_special_tokens", "no"),
        ],
    )
    def test_bad_values_name_the_field(self, field, value):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})

    def test_lists_become_tuples_and_spec(self):
        p = SamplingParams(stop=["a", "bc"], stop_token_ids=[5], logprobs=3, temperature=0)
        assert p.stop == ("a", "bc") and p.stop_token_ids == (5,)
        assert p.is_greedy
        spec = p.to_spec(seed=9)
        assert spec.seed == 9 and spec.num_logprobs == 3 and spec.temperature == 0.0

    def test_min_tokens_and_logit_bias_reach_the_spec(self):
        """The rank masks the EOS ids and the stop ids while min_tokens lasts (sent only with
        min_tokens); the bias goes as (id, bias) pairs in id order."""
        p = SamplingParams(
            max_tokens=8, min_tokens=8, stop_token_ids=[7, 2], logit_bias={9: -1, 3: 2.5}
        )
        assert p.logit_bias == ((3, 2.5), (9, -1.0))
        spec = p.to_spec(seed=1, eos_token_ids=frozenset({5, 2}))
        assert (spec.min_tokens, spec.stop_token_ids) == (8, (2, 5, 7))
        assert spec.logit_bias == ((3, 2.5), (9, -1.0))
        plain = SamplingParams(stop_token_ids=[7]).to_spec(seed=1, eos_token_ids={5})
        assert (plain.min_tokens, plain.stop_token_ids, plain.logit_bias) == (0, (), ())
        assert SamplingParams(min_tokens=3).to_spec(seed=1).min_tokens == 0  # nothing to mask


CUDA = torch.cuda.is_available()
# the interpreter: set for the whole session
KERNELS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(
    not KERNELS or importlib.util.find_spec("triton") is None,
    reason="Triton kernels need triton and a GPU, or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize(
    "rows,vocab,programs",
    [
        (3, 5001, 3),
        (3, 5001, 1024),
        pytest.param(
            1, 248320, 1024, marks=pytest.mark.skipif(not CUDA, reason="real shapes: CUDA")
        ),
        pytest.param(
            64, 248320, 1024, marks=pytest.mark.skipif(not CUDA, reason="real shapes: CUDA")
        ),
    ],
)
def test_logsumexp_argmax_kernel(rows, vocab, programs):
    """The sampler's one read of the logits (kernels/logit_stats.py): logsumexp as torch's,
    the argmax exactly, the first of tied maxima included: ties planted in one block, in two
    blocks of one part (3 programs: one part of 5 blocks per row), in two parts (1024
    programs: a part per block); a row whose first block is all -inf (a masked vocabulary)."""
    from deltaserve.kernels import logit_stats

    logits = torch.randn(rows, vocab, device="cuda" if CUDA else "cpu") * 4
    logits[0, vocab - 7] = logits[0, 3] = logits[0].max() + 1.0  # the first of two, far apart
    if rows > 1:
        logits[1, 1500] = logits[1, 1501] = logits[1].max() + 1.0  # two in one block
        logits[1, :1024] = float("-inf")  # a part that starts with a masked block (was NaN)
        logits[2, 2100] = logits[2, 100] = logits[2].max() + 1.0  # blocks 0 and 2
    slots = torch.randperm(rows + 2, device=logits.device)[:rows]  # the rows' slots, out of order
    last_tokens = torch.full((rows + 2,), -5, dtype=torch.int64, device=logits.device)
    lse, arg, greedy = logit_stats.logsumexp_argmax_triton(
        logits, programs, slots, last_tokens, block=1024
    )
    want_lse, want_arg, _ = logit_stats.logsumexp_argmax_reference(logits)
    assert torch.equal(arg, want_arg), f"argmax {arg.tolist()[:8]} != {want_arg.tolist()[:8]}"
    assert arg[0].item() == 3
    assert torch.allclose(lse, want_lse, rtol=1e-6, atol=1e-5), (lse - want_lse).abs().max()
    # the greedy samples as the sampler packs them: the argmax, its logit less this lse
    want_greedy = torch.stack(
        (arg.double(), (logits.gather(1, arg[:, None])[:, 0] - lse).double()), dim=1
    )
    assert torch.equal(greedy, want_greedy), (greedy - want_greedy).abs().max()
    assert torch.equal(last_tokens[slots], arg) and (last_tokens == -5).sum() == 2, (
        "argmax not in its slot alone"
    )
    # prompt logprobs' read: the same, and each target's logit and rank (1 + the larger logits)
    targets = torch.randint(0, vocab, (rows,), device=logits.device)
    targets[0] = 3  # the row's best: rank 1
    t_lse, t_arg, t_logit, t_rank = logit_stats.target_stats(logits, targets, block=1024)
    want_logit = logits.gather(1, targets[:, None])[:, 0]
    # its own parts
    assert torch.allclose(t_lse, want_lse, rtol=1e-6, atol=1e-5), (t_lse - want_lse).abs().max()
    assert torch.equal(t_arg, arg) and torch.equal(t_logit, want_logit)
    assert torch.equal(t_rank, (logits > want_logit[:, None]).sum(dim=-1) + 1) and t_rank[0] == 1, (
        t_rank
    )
    spiked = logits.clone()
    spiked[-1, 7] = float("inf")  # logsumexp +inf, as torch's (it was NaN)
    spiked_lse, spiked_arg, _ = logit_stats.logsumexp_argmax_triton(spiked, programs, block=1024)
    assert (
        spiked_lse[-1] == float("inf")
        and spiked_arg[-1] == 7
        and torch.equal(spiked_lse[:-1], lse[:-1])
    )
