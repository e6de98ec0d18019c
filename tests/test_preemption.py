"""Admission by present need and preemption by recompute, end to end: real rank processes on
the CPU, the HTTP server driven by the official `openai` client.

The workload is the common case that whole-lifetime reservation served one at a time: chat
requests without max_tokens at a max_model_len far beyond the KV cache, so that each one's
default max_tokens is the rest of the cache. Admitted by what they need now, several run at
once; as they grow the youngest are preempted and recomputed, and every choice's tokens,
logprobs, finish reason and usage must still be what it gets run alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from engine_helpers import PlanLog, collect, drain, ids_of
from serve_helpers import get, serving, wait_idle

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.events import ErrorEvent, FinishedEvent, Lifecycle
from deltaserve.engine.rank.executor import Executor, ExecutorConfig, StepError
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http.server_config import ServerConfig
from deltaserve.ipc.faults import FaultPlan
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

module_loop = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
BLOCK_SIZE = 4
NUM_BLOCKS = 16  # 64 positions: one request's default lifetime is the whole cache
NUM_CHATS = 16  # each lifetime the whole cache: enough to keep it full (32 took twice the time)
LIFETIME = NUM_BLOCKS * BLOCK_SIZE
# a recomputed request's positions ran as prompt chunks, not one by one: the same fp32 math
# summed in another order (measured: mean 9e-6, p99 6e-5, max 7e-4 over 32 chats' 1,534 tokens)
LOGPROB_TOLERANCE = 2e-3
LOGPROB_MEAN_GAP = 5e-5
WORKLOAD_TIMEOUT_S = 900  # a workload on 2 shared cores
# ~650 steps of the tiny model each: well within pytest's 300 s on 2 idle cores, not on busy ones
heavy = pytest.mark.timeout(WORKLOAD_TIMEOUT_S)


def config(model: Path, **overrides) -> EngineConfig:
    base = dict(
        model=str(model),
        max_model_len=8192,  # far beyond the cache: a chat's max_tokens is the rest of it
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_queued_requests=64,
        kv_watermark=0.0,
        startup_timeout_s=90.0,
    )
    return EngineConfig(**{**base, **overrides})


def chat(i: int) -> dict:
    """Chat i of the workload: no max_tokens; even ones greedy, odd ones seeded (two of them
    with n = 2: seeded children), every token's logprob and best alternative asked for, and
    two the prompt's logprobs (vLLM's extra)."""
    body = dict(
        model=MODEL,
        messages=[{"role": "user", "content": f"Note {i}: say something about {i * 7 % 13}."}],
        logprobs=True,
        top_logprobs=1,
    )
    if i in (2, 7):
        body["extra_body"] = {"prompt_logprobs": 1}
    if i % 2:
        body.update(temperature=0.8, seed=1000 + i, n=2 if i in (5, 11) else 1)
    else:
        body.update(temperature=0.0)
    return body


def choices(response) -> list[tuple]:
    """Per choice: finish reason, token ids, logprobs, best alternatives (ids as the server
    names them with --return-tokens-as-token-ids)."""
    return [
        (
            c.finish_reason,
            [t.token for t in c.logprobs.content],
            [t.logprob for t in c.logprobs.content],
            [[a.token for a in t.top_logprobs] for t in c.logprobs.content],
        )
        for c in response.choices
    ]


def assert_same_as_alone(got, alone) -> list[float]:
    """The same usage, and per choice the same finish reason, token ids and alternatives, and
    logprobs within LOGPROB_TOLERANCE; returns every token's logprob gap."""
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        alone.usage.prompt_tokens,
        alone.usage.completion_tokens,
    )
    gaps = []
    for mine, theirs in zip(choices(got), choices(alone), strict=True):
        assert mine[0] == theirs[0] and mine[1] == theirs[1] and mine[3] == theirs[3]
        assert mine[2] == pytest.approx(theirs[2], abs=LOGPROB_TOLERANCE)
        gaps += [abs(a - b) for a, b in zip(mine[2], theirs[2], strict=True)]
    mine, theirs = (r.model_dump().get("prompt_logprobs") for r in (got, alone))
    assert (mine is None) == (theirs is None)
    for position, (a, b) in enumerate(zip(mine or (), theirs or (), strict=True)):
        assert (a is None) == (b is None) and (a is None or a.keys() == b.keys()), position
        for token in a or ():
            # a rank deep in the vocabulary's tail counts near-tied logits that a 1e-5 change
            # reorders (prompt chunks ran in other batches: 152,626 against 152,624 seen)
            assert a[token]["rank"] == pytest.approx(b[token]["rank"], rel=1e-4)
            assert a[token]["logprob"] == pytest.approx(b[token]["logprob"], abs=1e-4)
    return gaps


@contextlib.asynccontextmanager
async def chat_client(engine: AsyncEngine) -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    """The official client on the engine served in-process, token ids in its logprobs, and no
    retry; its timeout is the whole workload's."""
    async with serving(engine, ServerConfig(MODEL, return_tokens_as_token_ids=True)) as server:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WORKLOAD_TIMEOUT_S
        )
        try:
            yield client, server.url
        finally:
            await client.close()


class Transitions:
    """The scheduler's lifecycle transitions, as a monitor gets them."""

    def __init__(self, engine: AsyncEngine) -> None:
        # (transition, request id, its preemptions so far, positions computed, prompt length)
        self.events: list[tuple[str, int, int, int, int]] = []
        engine.scheduler.lifecycle_listeners.append(self.add)

    def add(self, event: Lifecycle) -> None:
        r = event.request
        if r is not None:
            self.events.append(
                (event.transition, r.request_id, r.num_preemptions, r.num_computed, r.prompt_len)
            )

    def count(self, transition: str) -> int:
        return sum(e[0] == transition for e in self.events)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def alone(tiny_model_dir):
    """Each chat of the workload as it comes out never preempted, by chat index: all of them
    together in an engine whose cache holds every lifetime (the same default max_tokens), and
    two of them alone there too, which must come out the same (a request's tokens do not
    depend on its companions: tests/test_engine.py)."""
    roomy = config(
        tiny_model_dir,
        max_model_len=LIFETIME,
        num_kv_blocks=NUM_CHATS * 2 * NUM_BLOCKS,
        max_num_seqs=NUM_CHATS + 2,
        reserve_lifetime=True,
    )
    engine = await AsyncEngine.start(roomy)
    try:
        async with chat_client(engine) as (client, _):
            out = await asyncio.gather(
                *(client.chat.completions.create(**chat(i)) for i in range(NUM_CHATS))
            )
            for i in (0, 5):
                assert_same_as_alone(out[i], await client.chat.completions.create(**chat(i)))
        assert engine.metrics.num_preemptions_total == 0
        assert all(out[i].model_dump().get("prompt_logprobs") for i in (2, 7))
        # each choice's lifetime is the whole cache
        assert {
            r.usage.prompt_tokens + r.usage.completion_tokens // len(r.choices) for r in out
        } == {LIFETIME}
        yield dict(enumerate(out))
    finally:
        await engine.shutdown()


@heavy
@module_loop
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recompute", "prefix_cached"])
async def test_lifetimes_that_do_not_fit_run_together_and_come_out_as_alone(
    tiny_model_dir, alone, prefix_caching
):
    """16 chats whose lifetimes are each the whole cache: several run at once (one at a time
    under full reservation), the youngest are preempted as the cache fills, and every choice
    comes out as it did alone: token ids, logprobs, alternatives, finish reason, usage, with
    prefix caching too (a cache this full keeps few states: tests/test_prefix_cache.py shows a
    recompute starting where it stopped). Afterwards nothing is held but the saved prefixes'
    blocks, on every rank as in the ledger."""
    engine = await AsyncEngine.start(config(tiny_model_dir, enable_prefix_caching=prefix_caching))
    try:
        plans, transitions = PlanLog(engine), Transitions(engine)
        async with chat_client(engine) as (client, url):
            together = await asyncio.gather(
                *(client.chat.completions.create(**chat(i)) for i in range(NUM_CHATS))
            )
            _, metrics = await get(url + "/metrics")
        gaps = [
            gap for i, got in enumerate(together) for gap in assert_same_as_alone(got, alone[i])
        ]
        assert sum(gaps) / len(gaps) < LOGPROB_MEAN_GAP
        preemptions = engine.metrics.num_preemptions_total
        assert preemptions > 0 and transitions.count("preempted") == preemptions
        assert f'vllm:num_preemptions_total{{model_name="{MODEL}"}} {preemptions}' in metrics
        assert max(p.num_decodes for p in plans.plans) >= 2  # full reservation: 1 at a time
        readmitted = [e for e in transitions.events if e[0] == "admitted" and e[2] > 0]
        assert len(readmitted) == preemptions  # each came back once per preemption
        await wait_idle(engine, prefixes=prefix_caching)
    finally:
        await engine.shutdown()


@heavy
@module_loop
async def test_an_abort_of_a_preempted_request_ends_it_at_once(tiny_model_dir):
    """A request cancelled while it waits preempted ends at once with an abort and the tokens
    it had (those of its solo run); nothing of it stays on any rank."""
    engine = await AsyncEngine.start(config(tiny_model_dir))
    try:
        victims: list[int] = []

        def cancel_first_victim(event: Lifecycle) -> None:
            if event.transition == "preempted" and not victims:
                victims.append(event.request.request_id)
                engine.scheduler.cancel((event.request.request_id,))

        engine.scheduler.lifecycle_listeners.append(cancel_first_victim)
        prompts = [[100 + i, 7, 8, 9, 10, 11] for i in range(8)]
        greedy = SamplingParams(
            max_tokens=engine.longest_sequence - 6, ignore_eos=True, temperature=0
        )
        streams = [engine.generate(p, greedy) for p in prompts]
        results = await asyncio.gather(*(collect(s, WORKLOAD_TIMEOUT_S) for s in streams))
        [victim] = [i for i, s in enumerate(streams) if s.request_ids[0] in victims]
        tokens, end = results[victim]
        assert end.reason == "abort" and 0 < end.output_tokens == len(tokens) < greedy.max_tokens
        assert all(results[i][1].reason == "length" for i in range(8) if i != victim)
        solo, _ = await collect(engine.generate(prompts[victim], greedy), WORKLOAD_TIMEOUT_S)
        assert ids_of(tokens) == ids_of(solo)[: len(tokens)]
        await wait_idle(engine)
    finally:
        await engine.shutdown()


GUIDES = {
    "guided_json": '{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}',
    "guided_regex": "[a-z ]{5,30}[.]",
    "stop_regex": ("x[0-9]",),
}


@module_loop
async def test_guided_requests_preempted_come_out_as_alone(tiny_model_dir):
    """Requests under a JSON schema, a regex or a stop regex, greedy and seeded: preempted and
    recomputed, their guides go on from the tokens already sampled (not rewound, not fed the
    recompute's prompt), and each comes out as it does alone."""
    kinds = list(GUIDES.items())
    params = [
        SamplingParams(
            max_tokens=40, temperature=0.9 * (i % 2), seed=7 + i, **dict([kinds[i % len(kinds)]])
        )
        for i in range(6)
    ]
    prompts = [[500 + 3 * i + j for j in range(20)] for i in range(len(params))]
    outputs = []
    for blocks in (256, 30):  # room for every lifetime, then for about two
        engine = await AsyncEngine.start(config(tiny_model_dir, num_kv_blocks=blocks))
        try:
            prepared = [await engine.prepare(p) for p in params]
            streams = [engine.generate(p, sp) for p, sp in zip(prompts, prepared, strict=True)]
            if blocks == 256:
                runs = [await collect(s, WORKLOAD_TIMEOUT_S) for s in streams]  # one at a time
            else:
                runs = await asyncio.gather(*(collect(s, WORKLOAD_TIMEOUT_S) for s in streams))
                assert engine.metrics.num_preemptions_total > 0
            outputs.append([(ids_of(tokens), end.reason) for tokens, end in runs])
            await wait_idle(engine)
        finally:
            await engine.shutdown()
    assert outputs[1] == outputs[0]
    assert {reason for _, reason in outputs[0]} == {"stop", "length"}


@module_loop
async def test_a_rank_death_in_a_preemption_fails_closed_once_per_owner(tiny_model_dir):
    """Rank 1 of two dies as the ranks carry out the first preemption (the first DropRequests:
    nothing ended before it): every owner, the victims included, gets exactly one terminal
    event, an error, and the engine is dead."""
    fault = FaultPlan(rank=1, kind="die_after_release", at_drop=1)
    engine = await AsyncEngine.start(config(tiny_model_dir, tp_size=2, fault=fault))
    try:
        longest = engine.longest_sequence
        prompts = [[100 + i, 7, 8, 9, 10, 11] for i in range(8)]
        streams = [
            engine.generate(p, SamplingParams(max_tokens=longest - len(p), ignore_eos=True))
            for p in prompts
        ]
        ends = []
        for stream in streams:
            events = await asyncio.wait_for(drain(stream), WORKLOAD_TIMEOUT_S)
            terminal = [e for e in events if isinstance(e, FinishedEvent | ErrorEvent)]
            assert len(terminal) == 1 and events[-1] is terminal[0], events[-3:]
            ends.append(terminal[0])
        assert all(isinstance(e, ErrorEvent) for e in ends), ends
        assert engine.is_dead and "rank 1" in engine.dead_reason
        assert engine.metrics.num_preemptions_total == 0  # the preemption never completed
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module")
def executor(tiny_model_dir):
    """One rank's executor in this process: blocks of 4 positions."""
    return Executor(
        ExecutorConfig(str(tiny_model_dir), max_num_seqs=4, num_kv_blocks=16, block_size=4)
    )


def test_a_rank_adds_exactly_the_blocks_an_item_says(executor):
    """An item past its request's blocks carries `grow`: the rank adds that many and refuses
    an item that would run past its blocks, or that grows by more than it needs, changing
    nothing."""
    spec = SamplingSpec(seed=3)
    [first] = executor.run_step([StepItem(1, 0, [5, 6, 7, 8, 9], True, NewRequest(5, spec))])
    token, used = first.token_id, executor.snapshot().blocks_used
    assert used == 2
    for start in (5, 6, 7):
        [sample] = executor.run_step([StepItem(1, start, [token], True)])
        token = sample.token_id
    for grow, message in ((0, "runs through position 8 with 2 blocks"), (2, "and 2 more")):
        with pytest.raises(StepError, match=message):
            executor.run_step([StepItem(1, 8, [token], True, grow=grow)])
        assert executor.snapshot().blocks_used == used
    executor.run_step([StepItem(1, 8, [token], True, grow=1)])
    assert executor.snapshot().blocks_used == 3
    executor.drop([1])
    assert executor.snapshot().blocks_used == 0


def test_a_recomputed_request_samples_on_as_it_would_have(executor):
    """Seeded sampling with penalties and a bad word: a request admitted again with its
    prompt and first outputs as its prefill, those outputs named in `output_ids`, samples the
    tokens and logprobs the first run sampled next (the same seed index, penalty counts and
    bad-word history)."""
    spec = SamplingSpec(
        seed=11,
        temperature=1.0,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        num_logprobs=2,
        bad_words=((7, 9),),
    )
    prompt = [5, 6, 7, 8, 9, 10]
    samples = executor.run_step([StepItem(1, 0, prompt, True, NewRequest(16, spec))])
    for start in range(6, 11):
        samples += executor.run_step([StepItem(1, start, [samples[-1].token_id], True)])
    executor.drop([1])
    outputs = [s.token_id for s in samples]
    resumed = NewRequest(16, spec, output_ids=tuple(outputs[:3]))
    again = executor.run_step([StepItem(2, 0, prompt + outputs[:3], True, resumed)])
    for start in range(9, 11):
        again += executor.run_step([StepItem(2, start, [again[-1].token_id], True)])
    executor.drop([2])
    assert [s.token_id for s in again] == outputs[3:]
    for got, want in zip(again, samples[3:], strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]


def test_the_admission_benchmark_runs_both_policies(tiny_model_dir, tmp_path):
    """tools/bench_admission.py's CPU form: whole-lifetime reservation runs as many chats at
    once as lifetimes fit the cache (2 here), admission by present need as many as slots."""
    import json

    from deltaserve.tools import bench_admission

    out = tmp_path / "admission.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--max-model-len", "512"]
    argv += ["--num-kv-blocks", "64", "--max-num-seqs", "6", "--num-requests", "6"]
    argv += ["--input-len", "20", "--output-len", "6", "--out", str(out)]
    assert bench_admission.main(argv) == 0
    modes = json.loads(out.read_text())["modes"]
    assert modes["lifetime"]["max_concurrency"] == 2 and modes["present"]["max_concurrency"] == 6
    assert modes["lifetime"]["output_tokens"] == modes["present"]["output_tokens"] > 0
