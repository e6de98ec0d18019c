"""Speculative decoding's verify on rank 0 (engine/rank/speculative.py's rule over the
sampler's `launch_speculative`): the emitted tokens follow the target's distribution exactly
(a chi-square bound over thousands of draws on a small vocabulary), and a seeded request
emits exactly the tokens it emits without speculation, whatever the drafts."""

from __future__ import annotations

import torch

from deltaserve.engine.rank.sampler import Sampler
from deltaserve.ipc.messages import SamplingSpec

VOCAB = 6
DEPTH = 3  # positions a request emits: a verify of DEPTH - 1 drafts, then plain steps
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # 0.999 quantiles by df


def position_logits() -> torch.Tensor:
    """[DEPTH, VOCAB]: each output position's logits (the same whatever came before)."""
    return torch.tensor(
        [
            [2.0, 1.5, 0.3, -0.5, 0.0, -2.0],
            [0.2, 1.8, 1.7, -1.0, 0.5, 0.1],
            [-0.3, 0.4, 0.1, 1.2, 1.0, -0.2],
        ]
    )


def emit(sampler: Sampler, ids: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Each request's DEPTH tokens: one verify step of its drafts (kept while the samples
    equal them, then the sample of the first row that differs), the rest sampled one step at
    a time, as the engine's next steps would."""
    logits = position_logits()
    rows = torch.cat([logits[: len(d) + 1] for d in drafts])
    samples = sampler.finish_rows(sampler.launch_speculative(ids, drafts, rows))
    out, first = [], 0
    for rid, wanted in zip(ids, drafts, strict=True):
        mine = samples[first : first + len(wanted) + 1]
        first += len(wanted) + 1
        taken = 0
        while taken < len(wanted) and mine[taken].token_id == wanted[taken]:
            taken += 1
        tokens = [s.token_id for s in mine[: taken + 1]]
        for token in tokens:
            sampler.record(rid, token)
        out.append(tokens)
    while any(len(tokens) < DEPTH for tokens in out):
        pending = [i for i, tokens in enumerate(out) if len(tokens) < DEPTH]
        rows = torch.stack([logits[len(out[i])] for i in pending])
        for i, sample in zip(pending, sampler.sample([ids[i] for i in pending], rows), strict=True):
            out[i].append(sample.token_id)
    return out


def plain(spec: SamplingSpec) -> list[int]:
    """The request's DEPTH tokens without speculation, one step each."""
    sampler = Sampler()
    sampler.add(0, spec)
    logits = position_logits()
    return [sampler.sample([0], logits[j][None])[0].token_id for j in range(DEPTH)]


def target(temperature: float, top_k: int) -> torch.Tensor:
    """[DEPTH, VOCAB]: each position's distribution after temperature and top-k."""
    scaled = position_logits() / temperature
    kth = scaled.topk(top_k, dim=-1).values[:, -1:]
    return scaled.masked_fill(scaled < kth, float("-inf")).softmax(dim=-1)


def test_emitted_tokens_follow_the_target_distribution():
    """4000 requests, each with its own seed, verifying 2 drafts that are often right: every
    position's emitted tokens pass a chi-square test against the target's distribution
    (the drafts change which rows are kept, never what is emitted)."""
    temperature, top_k, n = 0.9, 5, 4000
    sampler = Sampler()
    ids = list(range(n))
    for rid in ids:
        sampler.add(rid, SamplingSpec(seed=10_000 + rid, temperature=temperature, top_k=top_k))
    drafts = [[0, 1] if rid % 3 else [1, 2] for rid in ids]  # mostly each row's likeliest
    tokens = torch.tensor(emit(sampler, ids, drafts))
    want = target(temperature, top_k)
    accepted_first = sum(t[0] == d[0] for t, d in zip(tokens.tolist(), drafts, strict=True))
    assert 0.2 * n < accepted_first < 0.8 * n  # drafts both taken and rejected
    for position in range(DEPTH):
        seen = torch.bincount(tokens[:, position], minlength=VOCAB).double()
        expected = want[position].double() * n
        support = expected > 0
        assert seen[~support].sum() == 0, position  # nothing top-k removed
        chi2 = ((seen - expected)[support] ** 2 / expected[support]).sum().item()
        assert chi2 < CHI2_999[int(support.sum()) - 1], (position, chi2, seen, expected)


def test_a_seeded_request_emits_what_it_emits_without_speculation():
    """Every sampling parameter counted as the output grows (seed per output index,
    penalties, logit bias, min-p, top-p): right drafts, wrong drafts, no drafts, all emit the
    plain run's tokens."""
    specs = [
        SamplingSpec(seed=s, temperature=1.1, top_p=0.9, min_p=0.05, presence_penalty=0.8)
        for s in range(40)
    ] + [
        SamplingSpec(seed=s, temperature=0.7, frequency_penalty=1.5, logit_bias=((3, 2.0),))
        for s in range(40)
    ]
    specs.append(SamplingSpec(seed=0, repetition_penalty=1.3))  # greedy
    for i, spec in enumerate(specs):
        want = plain(spec)
        for drafts in (want[:2], want[:1], [want[0], (want[1] + 1) % VOCAB], [(want[0] + 1) % 6]):
            sampler = Sampler()
            sampler.add(i, spec)
            assert emit(sampler, [i], [drafts])[0] == want, (spec, drafts)
