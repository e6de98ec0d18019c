"""MTP speculative decoding beside issue 51's memory management and issue 54's KV-cache events:
real rank processes on the CPU, the same requests with and without speculation.

- preemption by recompute of requests that speculate: their drafts and the head's rows go with
  them, and each recomputed request's greedy tokens are still those it gets alone without MTP;
- bf16 DeltaNet states and an FP8 KV cache (the head's KV layer quantized as the target's):
  greedy output as without speculation, with the same cache dtypes;
- KV-cache events: every block announced holds only tokens the requests emitted (a draft's
  position is never saved, so never published).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_helpers import assert_ledger_is_every_ranks, collect, engine_config, ids_of

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.kv_events import BlockEvents
from deltaserve.engine.kv_events_schema import BlockStored
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.tools.make_model import make_model

SPECULATIVE = SpeculativeConfig(num_speculative_tokens=3)
PROMPTS = [list(range(100 + 11 * i, 112 + 13 * i)) for i in range(3)]  # 12 to 16 tokens


@pytest.fixture(scope="module")
def agree_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny, fp32, with an MTP head that agrees with the target often (not always)."""
    return make_model(tmp_path_factory.mktemp("agree"), preset="tiny", dtype="fp32", mtp="agree")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def outputs(engine: AsyncEngine, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Each request's greedy token ids, all submitted at once."""
    results = await asyncio.gather(
        *(collect(engine.generate(prompt, greedy(n))) for prompt, n in requests)
    )
    return [ids_of(tokens) for tokens, _ in results]


def assert_drafts_taken_and_refused(engine: AsyncEngine) -> None:
    """Speculation ran, and both kept and rejected drafts (else nothing was rolled back)."""
    drafted = engine.metrics.spec_decode_num_draft_tokens_total
    accepted = engine.metrics.spec_decode_num_accepted_tokens_total
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.timeout(300)
async def test_preempted_speculating_requests_come_out_as_without_mtp(agree_model_dir):
    """Three requests whose lifetimes (8 blocks each) overfill a 16-block cache: admitted by
    present need, the youngest are preempted while they speculate and recomputed (from a
    saved prefix where one is kept); the greedy tokens equal an engine's without MTP whose
    cache holds them all."""
    requests = [(prompt, 20) for prompt in PROMPTS[:3]]
    roomy = dict(device="cpu", num_kv_blocks=64, block_size=4)
    async with await AsyncEngine.start(engine_config(agree_model_dir, **roomy)) as plain:
        reference = await outputs(plain, requests)
        assert plain.metrics.num_preemptions_total == 0
    tight = dict(roomy, num_kv_blocks=16, enable_prefix_caching=True, kv_watermark=0.0)
    async with await AsyncEngine.start(
        engine_config(agree_model_dir, speculative_config=SPECULATIVE, **tight)
    ) as engine:
        got = await outputs(engine, requests)
        assert engine.metrics.num_preemptions_total > 0
        assert_drafts_taken_and_refused(engine)
        await assert_ledger_is_every_ranks(engine)
    assert got == reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fields",
    [
        {"mamba_ssm_cache_dtype": "bfloat16"},
        {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    ],
    ids=["bf16_states", "fp8_kv"],
)
async def test_greedy_output_with_mtp_equals_output_without_in_the_cache_dtypes(
    agree_model_dir, fields
):
    """The rollback's states in the state cache's dtype, the head's keys in the KV cache's:
    the same greedy tokens as without speculation, with the same cache dtypes."""
    requests = [(prompt, 12) for prompt in PROMPTS]
    config = dict(device="cpu", **fields)
    async with await AsyncEngine.start(engine_config(agree_model_dir, **config)) as plain:
        reference = await outputs(plain, requests)
    async with await AsyncEngine.start(
        engine_config(agree_model_dir, speculative_config=SPECULATIVE, **config)
    ) as engine:
        got = await outputs(engine, requests)
        assert_drafts_taken_and_refused(engine)
    assert got == reference


@pytest.mark.timeout(300)
async def test_kv_events_announce_only_emitted_tokens(agree_model_dir):
    """With MTP and prefix caching, the blocks announced (the prefix cache's saves, at prompt
    ends and generation ends) hold only prompt tokens and tokens the requests emitted: a
    block with a draft's position in it is never stored. Some announced block holds output
    tokens (a generation end was saved)."""
    config = dict(device="cpu", block_size=4, enable_prefix_caching=True)
    async with await AsyncEngine.start(
        engine_config(agree_model_dir, speculative_config=SPECULATIVE, **config)
    ) as engine:
        stored: dict[int, tuple[int, ...]] = {}  # block hash -> the tokens through its end

        def sink(_: float, events: list) -> None:
            for event in events:
                if isinstance(event, BlockStored):
                    tokens = stored[event.parent_block_hash] if event.parent_block_hash else ()
                    for i, block_hash in enumerate(event.block_hashes):
                        tokens += tuple(event.token_ids[4 * i : 4 * (i + 1)])
                        stored[block_hash] = tokens

        engine.scheduler.prefix.events = BlockEvents(4, sink)
        requests = [(prompt, 13) for prompt in PROMPTS[:2]]
        first = await outputs(engine, requests)
        turn = [*PROMPTS[0], *first[0], 7, 8]  # a next turn, from the first's saved end
        second = await outputs(engine, [(turn, 6)])
        await asyncio.sleep(0)  # the last pass's batch
        assert_drafts_taken_and_refused(engine)
    prompts = [prompt for prompt, _ in requests] + [turn]
    emitted = [(*prompt, *out) for prompt, out in zip(prompts, first + second, strict=True)]
    assert stored
    for tokens in stored.values():
        assert any(full[: len(tokens)] == tokens for full in emitted), tokens
    assert any(
        len(tokens) > len(PROMPTS[0]) and tokens[:12] == tuple(PROMPTS[0][:12])
        for tokens in stored.values()
    ), "no generation end was announced"
