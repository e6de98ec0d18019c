"""MTP speculative decoding end to end (engine/speculation.py, engine/rank/speculative.py):
real rank processes at TP 1 and 2 (gloo), prefix caching on, against the same engine without
speculation. The checkpoint's head is built from the target's own layers (make_model's
"agree"), so that its drafts are often accepted and sometimes rejected: every equality below
also checks the DeltaNet, conv and KV rollback of the rejected positions."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from engine_helpers import assert_ledger_is_every_ranks, collect, drain, engine_config, ids_of

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.events import TokenEvent
from deltaserve.engine.request import Request
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.speculative_config import SpeculativeConfig, parse_speculative_config
from deltaserve.http.metrics import render_metrics
from deltaserve.tools.make_model import make_model

NUM_DRAFTS = 3
PROMPTS = [list(range(100 + 11 * i, 150 + 13 * i)) for i in range(3)]  # 50 to 76 tokens
VOCAB_SIZE = 248320  # make_model's tiny preset
TP1_DRAFT_VOCAB = 160_000  # the head drafts among these first ids only
TP2_DRAFT_VOCAB = 130_000  # all of rank 0's shard (124160 ids) and the start of rank 1's


@pytest.fixture(scope="module")
def agree_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny, fp32, with an MTP head that agrees with the target often (not always)."""
    return make_model(tmp_path_factory.mktemp("agree"), preset="tiny", dtype="fp32", mtp="agree")


def greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


async def run_all(engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Each request's (token ids, text, finish reason, cached tokens), all submitted at once."""
    results = await asyncio.gather(*(collect(engine.generate(p, s)) for p, s in requests))
    return [
        (ids_of(tokens), "".join(t.text for t in tokens) + fin.text, fin.reason, fin.cached_tokens)
        for tokens, fin in results
    ]


async def scenario(engine: AsyncEngine, reference: list | None) -> list:
    """The same requests on an engine, in the same order: a batch, a next turn from a saved
    prefix, max_tokens and stop ids / strings that land inside a run of drafts, an abort. The
    stops are taken from `reference` (the engine without speculation), or its own first pass."""
    batch = await run_all(engine, [(p, greedy(24)) for p in PROMPTS])
    first = batch[0][0] if reference is None else reference[0][0][0]
    text = batch[0][1] if reference is None else reference[0][0][1]
    turn = PROMPTS[0] + first + [7, 8, 9]  # the first prompt's saved prefix, then more
    again = await run_all(engine, [(turn, greedy(16)), (PROMPTS[1], greedy(24))])
    limits = await run_all(engine, [(PROMPTS[0], greedy(n)) for n in (1, 2, 5, 7)])
    stop_ids = await run_all(engine, [(PROMPTS[0], greedy(24, stop_token_ids=(first[6],)))])
    stop_text = text[len(text) // 3 : len(text) // 3 + 3]
    stops = await run_all(engine, [(PROMPTS[0], greedy(24, stop=(stop_text,)))])
    stream = engine.generate(PROMPTS[2], greedy(200))
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 4:
            break
    await stream.aclose()
    after = await run_all(engine, [(PROMPTS[2], greedy(12))])
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, logprobs=2)
    tokens, _ = await collect(engine.generate(PROMPTS[1], replace(seeded, ignore_eos=True)))
    sampled = [(t.token_id, round(t.logprob, 3), [a for a, _ in t.top_logprobs]) for t in tokens]
    pair = SamplingParams(max_tokens=10, temperature=1.5, seed=3, n=2, ignore_eos=True)
    events = await asyncio.wait_for(drain(engine.generate(PROMPTS[2][:40], pair)), 60)
    choices = sorted((e.index, e.token_id) for e in events if isinstance(e, TokenEvent))
    choice = await engine.prepare(greedy(12, guided_choice=("hello world", "goodbye moon")))
    guided = await run_all(engine, [(PROMPTS[0], choice)])
    return [batch, again, limits, stop_ids, stops, after, sampled, choices, guided]


def recording(drafted: list[int]):
    """A proposer (`Speculation.force`) that keeps the head's drafts, noting them."""

    def propose(request: Request, index: int, drafts: list[int]) -> list[int]:
        drafted.extend(drafts)
        return drafts

    return propose


@pytest.mark.timeout(600)  # two engines and a dozen requests each: ~90 s on 2 idle cores
@pytest.mark.parametrize(
    ("tp_size", "draft_vocab_size"),
    [(1, TP1_DRAFT_VOCAB), (2, TP2_DRAFT_VOCAB)],
    ids=["tp1", "tp2"],
)
async def test_greedy_output_with_mtp_equals_output_without(
    agree_model_dir, tp_size, draft_vocab_size
):
    """Token for token and text for text, with drafts both accepted and rejected; nothing
    leaks; the counters are vLLM's. The head drafts among the first ids only (many of the
    target's tokens are outside them; at TP 2 they reach into the second rank's vocabulary
    shard); other tests (test_speculative_memory.py) draft over the whole vocabulary."""
    config = dict(device="cpu", tp_size=tp_size, enable_prefix_caching=True)
    async with await AsyncEngine.start(engine_config(agree_model_dir, **config)) as plain:
        reference = await scenario(plain, None)
        await assert_ledger_is_every_ranks(plain)
    speculative = SpeculativeConfig(
        num_speculative_tokens=NUM_DRAFTS, draft_vocab_size=draft_vocab_size
    )
    drafted: list[int] = []
    async with await AsyncEngine.start(
        engine_config(agree_model_dir, speculative_config=speculative, **config)
    ) as engine:
        engine.scheduler.spec.force(None, recording(drafted))  # the adaptive policy, as served
        got = await scenario(engine, reference)
        await assert_ledger_is_every_ranks(engine)
        metrics, load = engine.metrics, engine.load()
        exposition = render_metrics(engine, "m")[0].decode()
    for name, want, have in zip(
        [
            "batch",
            "next turn",
            "max_tokens",
            "stop ids",
            "stop string",
            "after an abort",
            "seeded random, logprobs",
            "n=2",
            "guided",
        ],
        reference,
        got,
        strict=True,
    ):
        assert have == want, name
    batch, again, limits = reference[:3]
    assert [len(r[0]) for r in limits] == [1, 2, 5, 7]
    assert all(r[0] == batch[0][0][: len(r[0])] for r in limits)
    assert again[0][3] > 0, "the next turn started from a saved prefix"
    assert reference[3][0][2] == "stop" and reference[4][0][2] == "stop"
    assert len(reference[7]) == 20  # both choices' tokens
    assert reference[8][0][1] in ("hello world", "goodbye moon")
    drafted_total, accepted = (
        metrics.spec_decode_num_draft_tokens_total,
        (metrics.spec_decode_num_accepted_tokens_total),
    )
    assert 0 < accepted < drafted_total, (accepted, drafted_total)  # some taken, some not
    assert (
        metrics.spec_decode_num_drafts_total
        <= drafted_total
        <= (NUM_DRAFTS * metrics.spec_decode_num_drafts_total)
    )
    per_position = metrics.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_position.values()) == accepted
    assert [per_position.get(i, 0) for i in range(NUM_DRAFTS)] == sorted(
        per_position.values(), reverse=True
    )  # a position is reached only through the ones before it
    assert load.spec_decode_num_accepted_tokens_total == accepted
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}.0' in (
        exposition
    )
    assert (
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} '
        f"{per_position.get(0, 0)}.0" in exposition
    )
    assert load.spec_decode_accepted_per_position == [
        per_position.get(i, 0) for i in range(NUM_DRAFTS)
    ]
    assert len(drafted) >= drafted_total  # the head's, of which the verified
    assert max(drafted) < draft_vocab_size
    assert any(t >= draft_vocab_size for t in batch[0][0]), "the limit must bite"
    if tp_size > 1:
        assert max(drafted) >= VOCAB_SIZE // tp_size, "some drafts come from the second shard"


def test_speculative_config_is_parsed_as_vllm_spells_it():
    config = parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 2}')
    assert config == SpeculativeConfig("mtp", 2)
    for bad, field in [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "mtp", "model": "other/drafter"}', "model"),
        ('{"method": "mtp", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
        ("[1]", "speculative_config"),
    ]:
        with pytest.raises(ValueError, match=field):
            parse_speculative_config(bad)


async def test_a_checkpoint_without_an_mtp_head_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        await AsyncEngine.start(
            engine_config(tiny_model_dir, device="cpu", speculative_config=SpeculativeConfig())
        )
