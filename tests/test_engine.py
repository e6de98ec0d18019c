"""AsyncEngine end to end on the tiny model: real rank processes, CPU, TP=1 and TP=2.

One engine per configuration is shared by the module's tests (none of them kills it); each
test leaves it idle with nothing held on any rank.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from engine_helpers import (
    PlanLog,
    assert_idle_and_empty,
    collect,
    drain,
    engine_config,
    ids_of,
    reference_tokens,
)

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.events import (
    EngineDeadError,
    FinishedEvent,
    QueueFullError,
    TokenEvent,
)
from deltaserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    # > 64 tokens: crosses the DeltaNet chunk, and is chunked by the 32-token step budget
    " ".join(f"item{i} costs {i * 7 % 13} coins;" for i in range(14)),
]
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len(out[-1]) > 64
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir):
    engine = await AsyncEngine.start(engine_config(tiny_model_dir))
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(engine, prompts):
    """Greedy tokens of each prompt run alone (batch of one)."""
    out = []
    for p in prompts:
        tokens, fin = await collect(engine.generate(p, GREEDY))
        assert fin.reason == "length" and len(tokens) == MAX_TOKENS
        out.append(tokens)
    return out


class TestGreedy:
    async def test_alone_twice_is_bit_identical(self, engine, prompts, reference):
        for p, ref in zip(prompts, reference, strict=True):
            tokens, _ = await collect(engine.generate(p, GREEDY))
            assert [(t.token_id, t.logprob, t.top_logprobs) for t in tokens] == [
                (t.token_id, t.logprob, t.top_logprobs) for t in ref
            ]
        await assert_idle_and_empty(engine)

    async def test_batched_equals_alone(self, engine, prompts, reference):
        log = PlanLog(engine)
        try:
            streams = [engine.generate(p, GREEDY) for p in prompts]
            results = await asyncio.gather(*(collect(s) for s in streams))
        finally:
            log.close()
        assert max(len(p.chunks) for p in log.plans) == len(prompts)  # they did share steps
        for (tokens, fin), ref, p in zip(results, reference, prompts, strict=True):
            assert ids_of(tokens) == ids_of(ref)
            for a, b in zip(tokens, ref, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert (fin.reason, fin.prompt_tokens, fin.output_tokens) == (
                "length",
                len(p),
                MAX_TOKENS,
            )
        await assert_idle_and_empty(engine)

    async def test_last_token_and_finish_arrive_after_the_drop(self, engine, prompts):
        """Completion commit boundary: when the last token (and the FinishedEvent) reach
        the caller, no rank holds the request any more."""
        stream = engine.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0))
        rid = stream.request_ids[0]
        seen = 0
        async for event in stream:
            seen += isinstance(event, TokenEvent)
            if seen == 4:
                held = {r for snap in await engine.rank_snapshots() for r in snap.request_ids}
                assert rid not in held
        assert seen == 4 and isinstance(event, FinishedEvent)

    async def test_matches_the_plain_path(self, tiny_model_dir, prompts, reference):
        """The engine agrees with the plain path (one executor, no control plane)."""
        for p, ref in zip(prompts[1:3], reference[1:3], strict=True):
            samples = await asyncio.to_thread(reference_tokens, tiny_model_dir, p, MAX_TOKENS)
            assert [s.token_id for s in samples] == ids_of(ref)
            for s, t in zip(samples, ref, strict=True):
                assert s.logprob == pytest.approx(t.logprob, abs=1e-4)


class TestSampling:
    async def test_concurrent_mixed_sampling_is_reproducible_per_seed(
        self, engine, prompts, reference
    ):
        seeded = SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.9,
            top_p=0.95,
            top_k=200,
            seed=77,
            repetition_penalty=1.1,
            frequency_penalty=0.3,
        )

        async def run(order: list[int]) -> dict[int, list[int]]:
            kinds = {
                0: (prompts[0], GREEDY),
                1: (prompts[1], seeded),
                2: (prompts[2], seeded),
                3: (prompts[3], GREEDY),
            }
            streams = {k: engine.generate(kinds[k][0], kinds[k][1]) for k in order}
            got = await asyncio.gather(*(collect(s) for s in streams.values()))
            return {k: ids_of(t) for k, (t, _) in zip(streams, got, strict=True)}

        first = await run([0, 1, 2, 3])
        second = await run([2, 3, 1, 0])
        assert first == second
        assert first[0] == ids_of(reference[0]) and first[3] == ids_of(reference[3])
        alone, _ = await collect(engine.generate(prompts[1], seeded))
        assert ids_of(alone) == first[1]
        other, _ = await collect(engine.generate(prompts[1], dataclasses.replace(seeded, seed=78)))
        assert ids_of(other) != first[1]
        await assert_idle_and_empty(engine)

    async def test_n_choices_are_seeded_children(self, engine, prompts):
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3)
        stream = engine.generate(prompts[0], params)
        assert len(set(stream.request_ids)) == 3
        events = await asyncio.wait_for(drain(stream), 60)
        by_index = {
            i: [e.token_id for e in events if isinstance(e, TokenEvent) and e.index == i]
            for i in range(3)
        }
        finals = [e for e in events if isinstance(e, FinishedEvent)]
        assert sorted(f.index for f in finals) == [0, 1, 2]
        for i in range(3):
            single = SamplingParams(max_tokens=6, temperature=1.0, seed=5 + i)
            tokens, _ = await collect(engine.generate(prompts[0], single))
            assert ids_of(tokens) == by_index[i]
        assert by_index[0] != by_index[1]


class TestPipelining:
    async def test_pipelined_steps_change_no_event(
        self, engine, tiny_model_dir, prompts, reference
    ):
        """A concurrent mix (greedy, seeded sampling with a penalty and logprobs, a stop token,
        a stop string, max_tokens 1 and 2, n=2; more choices than slots, so admissions break
        the pipeline) gives the same tokens, texts and ends per choice whether each step waits
        for the one before to be committed or is sent while it runs; the pipelined engine
        pipelines."""
        ref2 = ids_of(reference[2])
        j = next(i for i in range(2, len(ref2)) if ref2[i] not in ref2[:i])
        stop = next(t.text for t in reference[0][3:] if t.text.strip())
        cases = [
            (prompts[0], GREEDY),
            (
                prompts[1],
                SamplingParams(
                    max_tokens=12,
                    temperature=0.9,
                    top_p=0.95,
                    seed=3,
                    presence_penalty=0.5,
                    logprobs=3,
                ),
            ),
            (
                prompts[2],
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=(ref2[j],)),
            ),
            (prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=(stop,))),
            (prompts[3], SamplingParams(max_tokens=2, temperature=0)),
            (prompts[0], SamplingParams(max_tokens=1, temperature=0)),
            (prompts[1], SamplingParams(max_tokens=9, temperature=1.0, seed=8, n=2)),
        ]

        async def run(eng: AsyncEngine) -> list[dict]:
            """Each case's events by choice index (choices of one request may interleave
            differently: a choice's end waits for its drop)."""

            async def one(prompt, params) -> dict:
                by_index: dict = {}
                async for e in eng.generate(prompt, params):
                    by_index.setdefault(e.index, []).append(e)
                return by_index

            return await asyncio.wait_for(
                asyncio.gather(*(one(p, params) for p, params in cases)), 120
            )

        def strip_logprobs(runs: list[dict]) -> list:
            return [
                {
                    i: [
                        (e.token_id, e.text, [t for t, _ in e.top_logprobs])
                        if isinstance(e, TokenEvent)
                        else e
                        for e in events
                    ]
                    for i, events in choices.items()
                }
                for choices in runs
            ]

        def max_logprob_gap(a: list[dict], b: list[dict]) -> float:
            """Logprobs differ by fp32 noise: the two engines batch the requests differently."""
            gaps = [
                abs(x.logprob - y.logprob)
                for ca, cb in zip(a, b, strict=True)
                for i in ca
                for x, y in zip(ca[i][:-1], cb[i][:-1], strict=True)
            ]
            return max(gaps)

        before = engine.metrics.pipelined_steps_total
        pipelined = await run(engine)
        assert engine.metrics.pipelined_steps_total - before >= 5
        sync = await AsyncEngine.start(engine_config(tiny_model_dir, async_scheduling=False))
        try:
            unpipelined = await run(sync)
            assert strip_logprobs(unpipelined) == strip_logprobs(pipelined)
            assert max_logprob_gap(unpipelined, pipelined) < 1e-3
            assert sync.metrics.pipelined_steps_total == 0 and sync.metrics.steps_total > 10
            await assert_idle_and_empty(sync)
        finally:
            await sync.shutdown()
        # the ranks queue each follower before reading the samples of the step ahead (CUDA's
        # default; tests/test_ipc_control_plane.py checks that they do)
        overlapping = await AsyncEngine.start(engine_config(tiny_model_dir, overlap_steps=True))
        try:
            overlapped = await run(overlapping)
            assert strip_logprobs(overlapped) == strip_logprobs(pipelined)
            assert max_logprob_gap(overlapped, pipelined) < 1e-3
            assert overlapping.metrics.pipelined_steps_total >= 5
            await assert_idle_and_empty(overlapping)
        finally:
            await overlapping.shutdown()
        finals = [events[-1] for choice in pipelined for events in choice.values()]
        assert sorted(f.reason for f in finals) == ["length"] * 6 + ["stop"] * 2
        await assert_idle_and_empty(engine)

    @pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the ranks overlap steps on CUDA by default"
    )
    async def test_cuda_overlapped_steps_give_the_same_tokens(self, tiny_model_dir, prompts):
        """On CUDA each rank queues a pipelined step before it reads the samples of the step
        ahead (the device takes the follower's tokens from the slots' last samples, seeds and
        penalties count them before its sampling): greedy, seeded top-p with a penalty and
        seeded top-k decode the tokens of ranks that finish every step first."""
        cases = [
            GREEDY,
            SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=3, presence_penalty=0.5
            ),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=20, seed=8),
        ]

        async def run(overlap: bool | None) -> list[list[int]]:
            config = engine_config(
                tiny_model_dir,
                device="cuda",
                dtype="float32",
                num_kv_blocks=None,
                max_num_seqs=16,
                max_num_batched_tokens=512,
                max_queued_requests=16,
                overlap_steps=overlap,
            )
            async with await AsyncEngine.start(config) as eng:
                results = await asyncio.gather(
                    *(collect(eng.generate(p, c)) for p in prompts for c in cases)
                )
                assert eng.metrics.pipelined_steps_total >= 5
            return [ids_of(tokens) for tokens, _ in results]

        assert await run(None) == await run(False)


class TestStopping:
    async def test_stop_string_across_token_boundary(self, engine, prompts):
        tokens, fin = await collect(
            engine.generate(prompts[1], SamplingParams(max_tokens=24, temperature=0))
        )
        texts = [t.text for t in tokens]
        full = "".join(texts) + fin.text
        # A stop string made of the end of one token's text and the start of the next.
        k = next(
            i
            for i in range(2, len(texts) - 1)
            if len(texts[i]) >= 2
            and len(texts[i + 1]) >= 2
            and full.find(texts[i][-2:] + texts[i + 1][:2])
            == len("".join(texts[:i])) + len(texts[i]) - 2
        )
        stop = texts[k][-2:] + texts[k + 1][:2]
        params = SamplingParams(max_tokens=24, temperature=0, stop=("never-appears", stop))
        stopped, fin2 = await collect(engine.generate(prompts[1], params))
        assert (fin2.reason, fin2.stop_reason, fin.stop_reason) == (
            "stop",
            stop,
            None,
        )  # vLLM's stop_reason
        assert "".join(t.text for t in stopped) + fin2.text == full[: full.index(stop)]
        assert ids_of(stopped) == ids_of(tokens[: k + 2])  # ended on the token completing the stop
        assert fin2.output_tokens == k + 2
        await assert_idle_and_empty(engine)

    async def test_stop_token_ids_and_length(self, engine, prompts, reference):
        ref = ids_of(reference[2])
        j = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
        tokens, fin = await collect(
            engine.generate(
                prompts[2],
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=(ref[j],)),
            )
        )
        assert ids_of(tokens) == ref[: j + 1] and tokens[-1].text == ""
        assert (fin.reason, fin.output_tokens, fin.stop_reason) == ("stop", j + 1, ref[j])
        tokens, fin = await collect(
            engine.generate(prompts[2], SamplingParams(max_tokens=3, temperature=0))
        )
        assert ids_of(tokens) == ref[:3] and (fin.reason, fin.output_tokens, fin.stop_reason) == (
            "length",
            3,
            None,
        )
        await assert_idle_and_empty(engine)


class TestRefusals:
    async def test_impossible_requests_are_refused_naming_the_numbers(self, engine, prompts):
        with pytest.raises(ValueError, match=r"= 257 exceeds max_model_len 256"):
            engine.generate(prompts[0], SamplingParams(max_tokens=257 - len(prompts[0])))
        with pytest.raises(ValueError, match="ids must be integers in"):
            engine.generate([1, 2, 248320], GREEDY)
        with pytest.raises(ValueError, match="empty"):
            engine.generate([], GREEDY)
        with pytest.raises(ValueError, match="stop_token_ids"):
            engine.generate([1], SamplingParams(stop_token_ids=(10**7,)))
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=0)
        with pytest.raises(
            ValueError, match=r"n \(9\) exceeds max_queued_requests \(8\)"
        ):  # not "queue full": never fits
            engine.generate(prompts[0], SamplingParams(n=9, temperature=1.0, seed=1))
        await assert_idle_and_empty(engine)

    async def test_text_with_a_lone_surrogate_is_a_value_error(self, engine):
        """Text with a lone surrogate (bytes decoded with errors="surrogateescape") raised the
        tokenizer's TypeError "TextEncodeInput must be Union[...]" from generate and encode."""
        bad = "caf" + b"\xe9".decode("utf-8", "surrogateescape") + " au lait"
        with pytest.raises(ValueError, match=r"character 3 is a lone surrogate '\\udce9'"):
            engine.generate(bad, GREEDY)
        with pytest.raises(ValueError, match="lone surrogate"):
            await engine.encode(bad)
        with pytest.raises(ValueError, match="lone surrogate"):
            await engine.encode(bad * 2000)  # large: tokenized in the worker thread
        assert await engine.encode("café") == engine.tokenizer.encode(
            "café", add_special_tokens=False
        )
        await assert_idle_and_empty(engine)

    @pytest.mark.parametrize(
        "field,value",
        [
            ("max_model_len", 300.5),
            ("max_model_len", "300"),
            ("num_kv_blocks", 40.5),
            ("num_kv_blocks", True),
            ("step_timeout_s", "5"),
            ("startup_timeout_s", float("nan")),
        ],
    )
    async def test_config_refuses_non_integers_naming_the_field(self, tiny_model_dir, field, value):
        """A float max_model_len or num_kv_blocks was accepted and killed the ranks at start
        with msgspec's "Expected `int`, got `float`"; a string compared with a TypeError."""
        with pytest.raises(ValueError, match=field):
            engine_config(tiny_model_dir, **{field: value})

    async def test_queue_bound(self, engine, prompts):
        streams = [engine.generate(prompts[0], GREEDY) for _ in range(8)]
        with pytest.raises(QueueFullError, match="max_queued_requests 8"):
            engine.generate(prompts[0], GREEDY)
        for s in streams:
            await s.aclose()
        await assert_idle_and_empty(engine)

    async def test_priority_policy_admits_lower_values_first(self, tiny_model_dir, engine, prompts):
        """vLLM's priority policy: with one slot busy, waiting requests are admitted by
        priority (lower first), then arrival; nothing running is preempted. Under fcfs a
        priority is refused, not ignored."""
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            engine.generate(prompts[0], GREEDY, priority=2)
        placed = await AsyncEngine.start(
            engine_config(tiny_model_dir, max_num_seqs=1, scheduling_policy="priority")
        )
        try:
            log = PlanLog(placed)
            running = placed.generate(
                prompts[0], SamplingParams(max_tokens=8, ignore_eos=True), priority=9
            )
            await running.__anext__()  # admitted before the others arrive
            order = [5, -1, 5, 0, -1]
            streams = [
                placed.generate(prompts[1], SamplingParams(max_tokens=2), priority=p) for p in order
            ]
            for stream in (running, *streams):
                await drain(stream)
            first_seen = list(
                dict.fromkeys(c.request_id for plan in log.plans for c in plan.chunks)
            )
            # stable: arrival within a priority
            expected = sorted(range(len(order)), key=lambda i: (order[i], i))
            assert first_seen == [
                running.request_ids[0],
                *(streams[i].request_ids[0] for i in expected),
            ]
            log.close()
            await assert_idle_and_empty(placed)
        finally:
            await placed.shutdown()

    async def test_queued_prompt_tokens_bound(self, tiny_model_dir):
        """The waiting prompts' tokens are bounded too (LESSONS: a queue of long prompts runs
        the server out of memory): a call past the bound is refused while anything else
        waits, taken alone, and an owner that leaves frees its tokens at once."""
        engine = await AsyncEngine.start(engine_config(tiny_model_dir, max_queued_tokens=150))
        try:
            alone = engine.generate(list(range(5, 205)), GREEDY)  # 200 tokens, nothing else waits
            with pytest.raises(QueueFullError, match="200 queued prompt tokens"):
                engine.generate([7] * 5, GREEDY)
            await alone.aclose()
            first = engine.generate([5] * 100, GREEDY)
            second = engine.generate([6] * 40, GREEDY)  # 140 of 150
            with pytest.raises(
                QueueFullError, match=r"140 queued prompt tokens \+ 20 new > max_queued_tokens 150"
            ):
                engine.generate([7] * 10, SamplingParams(max_tokens=4, n=2))
            await first.aclose()  # its 100 tokens leave the queue now
            third = engine.generate([7] * 10, SamplingParams(max_tokens=4, n=2))
            for stream in (second, third):
                await stream.aclose()
            await assert_idle_and_empty(engine)
        finally:
            await engine.shutdown()


class TestCancellation:
    async def test_cancelled_before_admission_is_never_dispatched(self, engine, prompts):
        log = PlanLog(engine)
        try:
            early = engine.generate(prompts[0], GREEDY, request_id="early")
            await engine.abort("early")  # drained together with the submission
            # Fill every slot, then queue one more and cancel it while it waits.
            busy = [
                engine.generate(p, SamplingParams(max_tokens=20, temperature=0)) for p in prompts
            ]
            queued = engine.generate(prompts[0], GREEDY, request_id="queued")
            for _ in range(500):
                await asyncio.sleep(0.01)
                if engine.load().running == 4:
                    break
            assert (engine.load().running, engine.load().waiting) == (4, 1)
            await engine.abort("queued")
            await engine.abort("queued")  # idempotent
            for s in (early, queued):
                tokens, fin = await collect(s)
                assert tokens == [] and (fin.reason, fin.output_tokens) == ("abort", 0)
            for s in busy:
                await collect(s)
        finally:
            log.close()
        assert not set(early.request_ids + queued.request_ids) & log.request_ids()
        await assert_idle_and_empty(engine)

    async def test_abort_frees_the_request_id_at_once(self, engine, prompts, reference):
        """As in vLLM, an id can be used again right after `await abort(id)` returns (it was
        refused as "already in use" until the abort reached the tick); the old stream still
        ends with its abort, and a second abort of the id cancels the new request only."""
        old = engine.generate(
            prompts[0], SamplingParams(max_tokens=50, temperature=0), request_id="again"
        )
        assert isinstance(await old.__anext__(), TokenEvent)
        await engine.abort("again")
        new = engine.generate(prompts[0], GREEDY, request_id="again")
        assert set(new.request_ids).isdisjoint(old.request_ids)
        _, fin_old = await collect(old)
        tokens, fin_new = await collect(new)
        assert fin_old.reason == "abort"
        assert fin_new.reason == "length" and ids_of(tokens) == ids_of(reference[0])
        third = engine.generate(
            prompts[0], SamplingParams(max_tokens=50, temperature=0), request_id="again"
        )
        await engine.abort("again")
        tokens, fin = await collect(third)
        assert fin.reason == "abort" and len(tokens) < 50
        await assert_idle_and_empty(engine)

    async def test_cancelled_mid_step_gets_no_later_token(self, engine, prompts):
        stream = engine.generate(
            prompts[1], SamplingParams(max_tokens=50, temperature=0), request_id="mid"
        )
        rid = stream.request_ids[0]
        log = PlanLog(engine)
        sampled_steps = []
        committed = []  # its tokens committed when the abort was sent
        tokens0 = engine.metrics.generation_tokens_total

        def cancel_on_fourth_sample(plan) -> None:
            if any(c.request_id == rid and c.sample for c in plan.chunks):
                sampled_steps.append(plan)
                if len(sampled_steps) == 4:  # abort while a step that samples it runs on the ranks
                    committed.append(engine.metrics.generation_tokens_total - tokens0)
                    asyncio.get_running_loop().create_task(engine.abort("mid"))

        engine.scheduler.plan_listeners.append(cancel_on_fourth_sample)
        try:
            tokens, fin = await collect(stream)
        finally:
            engine.scheduler.plan_listeners.remove(cancel_on_fourth_sample)
            log.close()
        assert len(sampled_steps) == 4
        # The 4th step was sent after the 3rd committed, or (pipelined) while the 3rd ran:
        # the step running when the abort arrives yields nothing, nor does any later one.
        assert committed in ([3], [2])
        n = committed[0]
        assert len(tokens) == n and (fin.reason, fin.output_tokens) == ("abort", n)
        await assert_idle_and_empty(engine)

    async def test_consumer_walking_away_leaks_nothing(self, engine, prompts, reference):
        """break, a cancelled consumer task and aclose each cancel the request (counted as
        aborts, not run to their length), leave nothing on the ranks and, as `abort` does,
        free the request id at once (a retry under it was refused "already in use by a
        running request" until the tick had delivered the abort, a step or more later)."""
        before = dict(engine.metrics.request_success_total)
        params = SamplingParams(max_tokens=60, temperature=0)
        retries = []
        seen = 0
        async for _ in engine.generate(prompts[0], params, request_id="broken"):
            seen += 1
            if seen == 3:
                break  # the stream object is dropped here
        retries.append(engine.generate(prompts[0], GREEDY, request_id="broken"))

        two_events = asyncio.Event()

        async def consume(stream) -> None:
            count = 0
            async for _ in stream:
                count += 1
                if count == 2:
                    two_events.set()

        task = asyncio.create_task(
            consume(engine.generate(prompts[1], params, request_id="cancelled"))
        )
        await two_events.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        retries.append(engine.generate(prompts[0], GREEDY, request_id="cancelled"))
        closed = engine.generate(prompts[2], params, request_id="closed")
        await closed.__anext__()
        await closed.aclose()
        retries.append(engine.generate(prompts[0], GREEDY, request_id="closed"))
        assert [e async for e in closed] == []
        for tokens, fin in await asyncio.gather(*(collect(s) for s in retries)):
            assert fin.reason == "length" and ids_of(tokens) == ids_of(reference[0])
        await assert_idle_and_empty(engine)
        after = engine.metrics.request_success_total
        assert after["abort"] - before["abort"] == 3 and after["length"] - before["length"] == 3


# ---- forced mixed steps, on an engine whose EOS is a token the model is known to produce ----


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def eos_case(tmp_path_factory, tiny_model_dir, reference):
    """A copy of the tiny model whose generation_config names as EOS the token that prompt 0
    produces first at output index j >= 1."""
    ref0 = ids_of(reference[0])
    j = next(i for i in range(1, len(ref0)) if ref0[i] not in ref0[:i])
    folder = tmp_path_factory.mktemp("tiny_eos")
    for f in Path(tiny_model_dir).iterdir():
        if f.name != "generation_config.json":
            os.symlink(f, folder / f.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ref0[j]]}))
    return folder, j


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mixed_engine(eos_case):
    engine = await AsyncEngine.start(engine_config(eos_case[0], force_mixed_steps=True))
    yield engine
    await engine.shutdown()


class TestForcedMixed:
    async def test_prefill_and_decode_share_steps_and_agree(
        self, mixed_engine, prompts, reference, eos_case
    ):
        log = PlanLog(mixed_engine)
        try:
            streams = [
                mixed_engine.generate(
                    p,
                    SamplingParams(
                        max_tokens=MAX_TOKENS, temperature=0, logprobs=2, ignore_eos=True
                    ),
                )
                for p in prompts
            ]
            results = await asyncio.gather(*(collect(s) for s in streams))
        finally:
            log.close()
        mixed = [p for p in log.plans if p.is_mixed]
        assert mixed, "no step mixed prefill and decode"
        long_id = streams[3].request_ids[0]
        assert any(c.request_id == long_id and not c.is_decode for p in mixed for c in p.chunks)
        for (tokens, fin), ref in zip(results, reference, strict=True):
            assert ids_of(tokens) == ids_of(ref) and fin.reason == "length"
        await assert_idle_and_empty(mixed_engine)

    async def test_eos_from_generation_config(self, mixed_engine, prompts, reference, eos_case):
        _, j = eos_case
        tokens, fin = await collect(mixed_engine.generate(prompts[0], GREEDY))
        assert ids_of(tokens) == ids_of(reference[0])[: j + 1]
        assert (fin.reason, fin.output_tokens) == ("stop", j + 1) and tokens[-1].text == ""
        tokens, fin = await collect(
            mixed_engine.generate(
                prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            )
        )
        assert ids_of(tokens) == ids_of(reference[0]) and fin.reason == "length"
        await assert_idle_and_empty(mixed_engine)


# ---- tensor parallel ----------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tp2_engine(tiny_model_dir):
    # A cache (24 blocks of 16 = 384 positions) smaller than max_model_len (512).
    # overlapped steps (the CUDA default), so that they meet the broadcast of the last samples
    engine = await AsyncEngine.start(
        engine_config(
            tiny_model_dir, tp_size=2, max_model_len=512, num_kv_blocks=24, overlap_steps=True
        )
    )
    yield engine
    await engine.shutdown()


class TestTensorParallel:
    async def test_tp2_matches_tp1(self, tp2_engine, prompts, reference):
        streams = [tp2_engine.generate(p, GREEDY) for p in prompts]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for (tokens, _), ref in zip(results, reference, strict=True):
            assert ids_of(tokens) == ids_of(ref)
            for a, b in zip(tokens, ref, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert tp2_engine.metrics.pipelined_steps_total > 0  # rank 1 took rank 0's samples
        snaps = await tp2_engine.rank_snapshots()
        assert [s.rank for s in snaps] == [0, 1]
        await assert_idle_and_empty(tp2_engine)

    async def test_request_larger_than_the_cache_is_refused(self, tp2_engine, prompts):
        with pytest.raises(
            ValueError, match=r"= 400 positions need 25 KV blocks; the cache has 24 blocks of 16"
        ):
            tp2_engine.generate(prompts[0], SamplingParams(max_tokens=400 - len(prompts[0])))
        await assert_idle_and_empty(tp2_engine)

    async def test_shutdown_drains_then_refuses(self, tiny_model_dir, prompts):
        """Shutdown lets a running request finish within the drain timeout, then every call
        fails with EngineDeadError. A caller that stops waiting (its call cancelled) stops
        only its wait: the drain and the teardown go on, and `wait_closed` returns once no
        rank is left (the replica was never torn down, and `wait_closed` returned while the
        ranks ran). Its own engine: the module's stays up whatever runs after this."""
        engine = await AsyncEngine.start(
            engine_config(tiny_model_dir, tp_size=2, overlap_steps=True)
        )
        try:
            stream = engine.generate(prompts[0], GREEDY)
            pids = engine.rank_pids
            call = asyncio.create_task(engine.shutdown(drain_timeout_s=30))
            await asyncio.sleep(0)  # the call has begun the drain
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            tokens, fin = await collect(stream)
            assert fin.reason == "length" and len(tokens) == MAX_TOKENS
            await asyncio.wait_for(engine.wait_closed(), 30)
            for pid in pids:
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)
            await engine.shutdown()  # idempotent
            with pytest.raises(EngineDeadError):
                engine.generate(prompts[0], GREEDY)
            with pytest.raises(EngineDeadError):
                await engine.rank_snapshots()
        finally:
            await engine.shutdown()
