"""Prefix caching end to end on the tiny model (engine/prefix_cache.py): real rank processes,
CPU at TP=1 and TP=2, and CUDA where there is one.

What must hold: a prompt that begins with a saved one starts where it ends (`cached_tokens`)
and gives the tokens and logprobs of a whole prefill (the in-process reference); a prefix
shared by two prompts is saved where they part, so a third starts there; the choices of one
call share one prefill; saved prefixes
are evicted, least recently used first, when a request needs their blocks; and the ledger's
count of free blocks is every rank's, whatever the saved prefixes and requests share.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from engine_helpers import (
    PLACEMENTS,
    assert_ledger_is_every_ranks,
    engine_config,
    reference_tokens,
    start_placed,
)

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.capacity import CapacityLedger
from deltaserve.engine.events import FinishedEvent, TokenEvent
from deltaserve.engine.prefix_cache import PrefixCache, PromptPlan
from deltaserve.engine.request import Request
from deltaserve.engine.sampling_params import SamplingParams

module_loop = pytest.mark.asyncio(loop_scope="module")

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
BLOCKS = 40  # few enough that three saved 200-token prompts leave no room for a fourth
BASE = list(range(5, 45))  # 40 tokens: 2.5 blocks of 16


@pytest_asyncio.fixture(scope="module", loop_scope="module", **PLACEMENTS)
async def engine(request, tiny_model_dir):
    # on CUDA the tiny fp32 model runs its prompts eagerly (flash takes half precision): prompt
    # graphs that start from saved prefixes are checked in tests/test_gpu_path.py
    engine = await start_placed(
        request.param,
        tiny_model_dir,
        num_kv_blocks=BLOCKS,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        prefix_cache_states=3,
    )
    yield engine
    await engine.shutdown()


async def run(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams = PARAMS
) -> tuple[list[TokenEvent], FinishedEvent]:
    events = [e async for e in engine.generate(prompt, params)]
    assert isinstance(events[-1], FinishedEvent), events[-1]
    return events[:-1], events[-1]


def assert_as_whole_prefill(
    engine: AsyncEngine, model_dir, prompt: list[int], tokens: list[TokenEvent]
) -> None:
    """The CPU's one forward over the whole prompt (CUDA: its kernels' rounding, fla's tf32)."""
    reference = reference_tokens(model_dir, prompt, PARAMS.max_tokens, num_logprobs=1)
    assert [t.token_id for t in tokens] == [s.token_id for s in reference]
    for got, want in zip(tokens, reference, strict=True):
        assert got.logprob == pytest.approx(
            want.logprob, abs=5e-2 if engine.config.device == "cuda" else 1e-4
        )


@module_loop
async def test_a_conversation_and_a_shared_prefix_start_from_saved_states(engine, tiny_model_dir):
    await engine.flush_cache()  # from no saved state, whatever the module's tests before saved
    metrics = engine.metrics
    queries, hits = metrics.prefix_cache_queries_total, metrics.prefix_cache_hits_total
    turn2 = [*BASE, 50, 51, 52, 53, 54]
    shared = [BASE[:35] + tail for tail in ([60, 61, 62], [70, 71, 72, 73], [80] * 9)]
    # the first prompt is saved where it ends; the second begins with it; the third parts from
    # them after 35 tokens: saved after its 2 full blocks that were seen before (32); the
    # fourth and fifth start there
    prompts = [BASE, turn2, *shared]
    cached = []
    for prompt in prompts:
        tokens, finished = await run(engine, prompt)
        assert_as_whole_prefill(engine, tiny_model_dir, prompt, tokens)
        cached.append(finished.cached_tokens)
    assert cached == [0, 40, 0, 32, 32]
    assert metrics.prefix_cache_queries_total - queries == sum(map(len, prompts))
    assert metrics.prefix_cache_hits_total - hits == 104
    assert await assert_ledger_is_every_ranks(engine) > 0


@module_loop
async def test_concurrent_prompts_share_one_saved_prefix(engine, tiny_model_dir):
    await run(engine, [*BASE, 7, 7])  # saved where it ends: 42
    prompts = [[*BASE, 7, 7, 100 + i, 101 + i] for i in range(4)]
    results = await asyncio.gather(*(run(engine, p) for p in prompts))
    for prompt, (tokens, finished) in zip(prompts, results, strict=True):
        assert finished.cached_tokens == 42
        assert_as_whole_prefill(engine, tiny_model_dir, prompt, tokens)
    await assert_ledger_is_every_ranks(engine)


@module_loop
async def test_the_choices_of_one_call_share_its_prefill(engine, tiny_model_dir):
    """n choices: choice 0 prefills and saves one position short of the prompt's end, the
    others wait for it and start there; every answer is a whole prefill's (greedy: alike)."""
    prompt = [300 + i for i in range(37)]
    params = SamplingParams(
        max_tokens=PARAMS.max_tokens, temperature=0.0, logprobs=1, ignore_eos=True, n=3
    )
    events = [e async for e in engine.generate(prompt, params)]
    finished = sorted((e for e in events if isinstance(e, FinishedEvent)), key=lambda e: e.index)
    assert [f.cached_tokens for f in finished] == [0, 36, 36]
    for index in range(3):
        tokens = [e for e in events if isinstance(e, TokenEvent) and e.index == index]
        assert_as_whole_prefill(engine, tiny_model_dir, prompt, tokens)
    await assert_ledger_is_every_ranks(engine)


@module_loop
async def test_saved_prefixes_give_way_to_a_request_that_needs_their_blocks(engine, tiny_model_dir):
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    long = [[1000 * k + i for i in range(200)] for k in range(1, 5)]  # 200 tokens: 13 blocks each
    for prompt in long[:3]:
        await run(engine, prompt, params)
    held = await assert_ledger_is_every_ranks(engine)
    assert BLOCKS - held < 13  # saved prefixes hold what the next request needs
    tokens, finished = await run(engine, long[3] + [9], PARAMS)
    assert_as_whole_prefill(engine, tiny_model_dir, long[3] + [9], tokens)
    await assert_ledger_is_every_ranks(engine)
    _, newest = await run(engine, long[3] + [9, 5], params)
    assert newest.cached_tokens == 201
    await assert_ledger_is_every_ranks(engine)


@module_loop
async def test_the_next_turn_starts_where_a_generation_ended(engine, tiny_model_dir):
    """A generation's state is kept as the ranks drop it: the next turn of the conversation
    (its prompt, its output, more) starts there. Ended by its length, the state covers all but
    the last token (its step fed the one before): alone, dropped by a command of its own; beside
    a longer one, by that one's pipelined step. Ended by a stop token, it covers that token too
    where a pipelined step behind fed it: the CPU's steps are slow enough that one always is;
    a GPU's tiny steps may end before the host sends the next (39 for 40 on an H100)."""

    def conversation(salt: int, n: int = 37) -> list[int]:
        return [salt + i for i in range(n)]

    async def next_turn(prompt: list[int], tokens: list[TokenEvent], cached: int) -> None:
        turn2 = [*prompt, *(t.token_id for t in tokens), 9, 9]
        tokens2, finished = await run(engine, turn2)
        assert finished.cached_tokens == cached
        assert_as_whole_prefill(engine, tiny_model_dir, turn2, tokens2)

    alone = conversation(500)
    tokens, finished = await run(engine, alone)
    assert finished.reason == "length"
    await next_turn(alone, tokens, len(alone) + 3)

    stopped = conversation(600)
    greedy = [s.token_id for s in reference_tokens(tiny_model_dir, stopped, 6)]
    k = next(k for k in range(2, 6) if greedy[k] not in greedy[:k])
    params = SamplingParams(
        max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True, stop_token_ids=[greedy[k]]
    )
    tokens, finished = await run(engine, stopped, params)
    assert (finished.reason, [t.token_id for t in tokens]) == ("stop", greedy[: k + 1])
    saved = max(
        p.num_tokens
        for p in engine.scheduler.prefix.saved_prefixes()
        if p.prompt[: len(stopped)] == tuple(stopped)
    )
    fed_behind = {1} if engine.config.device == "cpu" else {0, 1}  # the stop token's step
    assert saved - (len(stopped) + k) in fed_behind
    await next_turn(stopped, tokens, saved)

    short, longer = conversation(700), conversation(800, 20)
    (tokens, _), _ = await asyncio.gather(
        run(engine, short, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
        run(engine, longer, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    )
    await next_turn(short, tokens, len(short) + 2)
    await assert_ledger_is_every_ranks(engine)


def test_a_prefix_an_admitted_request_waits_for_is_never_evicted():
    """Pinned from admission until its first chunk is sent: eviction for room, or for a
    save's state slot, passes it by."""
    ledger = CapacityLedger(num_slots=4, num_blocks=8, block_size=4)
    cache = PrefixCache(num_prefixes=1, ledger=ledger)
    first = Request(1, 0, tuple(range(8)), SamplingParams(max_tokens=1), 0, 0.0)
    plan = cache.plan(first)
    cache.admit(first, plan, first.lifetime_tokens)
    assert cache.save(first, 8) == 0  # where its prompt ends: blocks 0-1 held for the prefix
    ledger.release(1)
    cache.forget(1)
    second = Request(2, 0, tuple(range(10)), SamplingParams(max_tokens=1), 0, 0.0)
    plan = cache.plan(second)
    assert plan.start is not None and plan.start.num_tokens == 8
    cache.admit(second, plan, second.lifetime_tokens)  # pins prefix 0; shares its 2 blocks
    # 21 positions: 6 blocks
    third = Request(3, 0, (99,) * 12, SamplingParams(max_tokens=9), 0, 0.0)
    # 8 - 2 - 1 free: only the pinned prefix to evict
    assert not cache.make_room(cache.plan(third), third.lifetime_tokens)
    assert cache.save(second, 10) == -1  # the one state slot is pinned too
    assert cache.start_of(2) == 0  # its first chunk is sent: unpinned
    assert cache.save(second, 10) == 0 and cache.take_evicted() == [0]  # evicted and reused at once
    assert cache.take_evicted() == []


@module_loop
async def test_served_usage_and_metrics_count_the_cached_tokens(tiny_model_dir):
    """--enable-prefix-caching --enable-prompt-tokens-details through the official client:
    usage.prompt_tokens_details.cached_tokens (absent where nothing was cached, as vLLM's),
    /metrics' vllm:prefix_cache_{queries,hits}_total, and a chat's second turn."""
    openai = pytest.importorskip("openai")
    from serve_helpers import get, in_process_server, metric_samples

    from deltaserve.http.server_config import ServerConfig

    config = engine_config(tiny_model_dir, enable_prefix_caching=True, prefix_cache_states=2)
    async with in_process_server(
        config, ServerConfig("tiny", enable_prompt_tokens_details=True)
    ) as server:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60
        )
        first = await client.completions.create(
            model="tiny", prompt=BASE, max_tokens=2, temperature=0
        )
        second = await client.completions.create(
            model="tiny", prompt=[*BASE, 9, 9], max_tokens=2, temperature=0
        )
        assert first.usage.prompt_tokens_details is None
        assert second.usage.prompt_tokens_details.cached_tokens == len(BASE)
        status, text = await get(server.url + "/metrics")
        assert status == 200
        samples = metric_samples(text, "tiny")
        assert samples["vllm:prefix_cache_queries_total"] == 82
        assert samples["vllm:prefix_cache_hits_total"] == 40
        # a chat's next turn: its answer, re-tokenized from its text, is cached too (all but
        # its last token, which no step fed)
        messages = [{"role": "user", "content": "Tell me a story about a cat."}]
        turn = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0
        )
        messages += [
            {"role": "assistant", "content": turn.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]
        after = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0
        )
        assert (
            after.usage.prompt_tokens_details.cached_tokens
            == turn.usage.prompt_tokens + turn.usage.completion_tokens - 1
        )
        await client.close()


def test_shared_prefixes_are_split_once_and_outlive_whole_prompts():
    """Prompts admitted together that part from a seen prompt at the same place: one of them
    splits there. The shared prefix it saves is evicted after whole prompts, and never by a
    whole prompt's save."""
    ledger = CapacityLedger(num_slots=4, num_blocks=64, block_size=4)
    cache = PrefixCache(num_prefixes=2, ledger=ledger)
    params = SamplingParams(max_tokens=1)
    requests = [Request(i, 0, (*range(8), 50 + i, 60 + i), params, 0, 0.0) for i in range(4)]

    def admit(request: Request) -> PromptPlan:
        plan = cache.plan(request)
        cache.admit(request, plan, request.lifetime_tokens)
        return plan

    admit(requests[0])  # shows blocks 0-1; saved whole (10 tokens)
    assert cache.saves([(requests[0], 10)]) == {0: 0}
    splits = [admit(r).split_at for r in requests[1:3]]
    assert splits == [8, 0]  # the second one admitted with it does not split too
    # request 1's split and request 2's whole prompt in one step: the split takes the free id,
    # request 2 evicts request 0's whole prompt
    assert cache.saves([(requests[1], 8), (requests[2], 10)]) == {
        1: 1,
        2: 0,
    } and cache.take_evicted() == [0]
    # evicts request 2's whole prompt, not the split
    assert cache.saves([(requests[1], 10)]) == {1: 0}
    assert cache.take_evicted() == [0]
    assert cache.plan(requests[3]).start.num_tokens == 8


def test_a_generation_is_saved_where_it_ends_and_the_same_positions_once():
    """The state kept at a generation's end is keyed as the next turn's prompt hashes (its
    output's blocks chained onto its prompt's); the same positions saved again, at a prompt's
    end or a generation's, take no second state slot; a cancelled generation is not saved."""
    ledger = CapacityLedger(num_slots=4, num_blocks=64, block_size=4)
    cache = PrefixCache(num_prefixes=4, ledger=ledger)

    def generate(request_id: int, prompt: tuple[int, ...], output: list[int]) -> Request:
        """Admitted, its prompt saved, `output` sampled; the ranks fed all but the last."""
        request = Request(request_id, 0, prompt, SamplingParams(max_tokens=8), 0, 0.0)
        cache.admit(request, cache.plan(request), request.lifetime_tokens)
        request.admit()
        request.mark_sent(len(prompt))
        request.advance(len(prompt))
        cache.save(request, len(prompt))
        for token in output:
            request.append_token(token, 0.0)
            if token != output[-1]:
                request.mark_sent(request.num_tokens)
                request.advance(1)
        return request

    def end(request: Request, reason: str = "length") -> list:
        request.finish(reason)
        saves = cache.saves_at_end([request])
        ledger.release(request.request_id)
        cache.forget(request.request_id)
        return saves

    prompt = tuple(range(10))
    first = generate(1, prompt, [20, 21, 22, 23, 24])  # fed 20 to 23: 14 positions
    [save] = end(first)
    assert (save.request_id, save.num_tokens) == (1, 14) and len(cache) == 2
    turn2 = Request(2, 0, (*prompt, 20, 21, 22, 23, 24, 9), SamplingParams(max_tokens=1), 0, 0.0)
    assert cache.plan(turn2).start.num_tokens == 14
    again = generate(3, prompt, [20, 21, 22, 23, 24])
    assert end(again) == [] and len(cache) == 2  # its prompt's save and its end's are held already
    assert end(generate(4, prompt, [20, 21, 22, 30]), "abort") == [] and len(cache) == 2
    # other positions
    assert [s.num_tokens for s in end(generate(5, prompt, [20, 21, 22, 30]))] == [13]
    assert len(cache) == 3


def test_after_a_flush_no_old_state_is_reused_or_saved():
    """New weights (a flush) beside admitted requests, as in a "keep" pause: the prefix one of
    them waits to start from stays for it, but no later prompt finds it; the states those
    requests go on to make, partly the old weights', are saved neither at their prompt's end
    nor at their generation's."""
    ledger = CapacityLedger(num_slots=4, num_blocks=32, block_size=4)
    cache = PrefixCache(num_prefixes=2, ledger=ledger)
    params = SamplingParams(max_tokens=4)
    first = Request(1, 0, tuple(range(8)), params, 0, 0.0)
    cache.admit(first, cache.plan(first), first.lifetime_tokens)
    assert cache.save(first, 8) == 0
    ledger.release(1)
    cache.forget(1)
    frozen = Request(2, 0, tuple(range(10)), params, 0, 0.0)
    plan = cache.plan(frozen)
    assert plan.start.prefix_id == 0
    cache.admit(frozen, plan, frozen.lifetime_tokens)
    frozen.admit(8)
    cache.flush()
    assert cache.take_evicted() == [] and len(cache) == 1  # pinned: kept for the request
    assert cache.plan(Request(3, 0, tuple(range(12)), params, 0, 0.0)).start is None
    assert cache.start_of(2) == 0
    frozen.mark_sent(10)
    frozen.advance(2)
    assert cache.save(frozen, 10) == -1
    for token in (50, 51, 52):
        frozen.append_token(token, 0.0)
        frozen.mark_sent(frozen.num_tokens)
        frozen.advance(1)
    frozen.finish("stop")
    assert cache.saves_at_end([frozen]) == [] and len(cache) == 1


def test_a_preempted_request_is_saved_where_it_stopped_and_starts_there_again():
    """Preempted with prefix caching, a request's state is kept over the positions the ranks
    ran (its prompt and all but its newest token); its recompute, whose prefill is its prompt
    and output, starts there and runs the one position left. While it waits, that prefix is
    evicted after every other, and forgotten with it if it is cancelled."""
    ledger = CapacityLedger(num_slots=4, num_blocks=32, block_size=4)
    cache = PrefixCache(num_prefixes=4, ledger=ledger)
    params = SamplingParams(max_tokens=16)
    other = Request(1, 0, (90, 91, 92, 93, 94), params, 0, 0.0)
    cache.admit(other, cache.plan(other), other.prefill_len)
    assert cache.save(other, 5) == 0  # a whole prompt's save, least recently used
    request = Request(2, 0, tuple(range(6)), params, 0, 0.0)
    cache.admit(request, cache.plan(request), request.prefill_len)
    request.admit()
    request.mark_sent(6)
    request.advance(6)
    assert cache.save(request, 6) == 1  # its prompt, where its prefill ended
    for token in (40, 41, 42, 43):
        request.append_token(token, 0.0)
        request.mark_sent(request.num_tokens)
        request.advance(1)
        ledger.grow(2, ledger.growth(2, request.num_tokens))
    request.append_token(44, 0.0)  # sampled, not yet fed: 10 positions ran
    save = cache.save_where_it_stands(request, ())
    assert (save.request_id, save.prefix, save.num_tokens) == (2, 2, 10)
    ledger.release(2)
    cache.forget(2)
    request.preempt()
    cache.await_resume(request)
    assert [p.prefix_id for p in cache._victims()] == [0, 1, 2]  # awaited: last
    plan = cache.plan(request)
    assert plan.start.prefix_id == 2 and plan.start.num_tokens == 10 == request.prefill_len - 1
    cache.admit(request, plan, request.prefill_len)
    request.admit(plan.start.num_tokens)
    assert request.input_tokens(10, 1) == [44] and request.num_cached == 0
    assert [p.prefix_id for p in cache._victims()] == [0, 1]  # pinned until its chunk is sent
    cache.forget(2)
    assert [p.prefix_id for p in cache._victims()] == [0, 1, 2]
