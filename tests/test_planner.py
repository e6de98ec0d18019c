"""Planner and capacity ledger invariants, without processes or tensors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.engine.capacity import CapacityError, CapacityLedger
from deltaserve.engine.planner import (
    FORCED_CHUNK_TOKENS,
    KvRoom,
    PlanInput,
    StepBudget,
    max_medium_patches,
    plan_step,
)
from deltaserve.engine.request import FINISH_REASON, Request, RequestStatus
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.tick_records import Entry
from deltaserve.engine.waiting_queue import WaitingQueue


@st.composite
def admitted_and_budget(draw):
    seqs = draw(st.integers(1, 12))
    budget = StepBudget(draw(st.integers(seqs, 300)), seqs)
    n = draw(st.integers(0, 16))
    reqs = []
    for i in range(n):
        prompt_len = draw(st.integers(1, 120))
        num_computed = draw(st.integers(0, prompt_len + 40))
        reqs.append(PlanInput(i * 3 + 1, prompt_len, num_computed))
    return reqs, budget


class TestPlanStep:
    @settings(max_examples=400, deadline=None)
    @given(admitted_and_budget(), st.booleans())
    def test_invariants(self, case, force_mixed):
        """Budget respected; decodes first; chunks start where the request stands; sample
        exactly at the end of the prompt; FCFS; no decode starves; the step is never empty
        when there is work."""
        admitted, budget = case
        plan = plan_step(admitted, budget, force_mixed)
        by_id = {r.request_id: r for r in admitted}
        chunks = plan.chunks
        assert plan.num_tokens <= budget.max_num_batched_tokens
        assert len(chunks) <= budget.max_num_seqs
        assert len({c.request_id for c in chunks}) == len(chunks)
        kinds = [c.is_decode for c in chunks]
        assert kinds == sorted(kinds, reverse=True), "decodes must precede prefill chunks"
        for c in chunks:
            r = by_id[c.request_id]
            assert c.start == r.num_computed
            if c.is_decode:
                assert r.is_decoding and c.num_tokens == 1 and c.sample
            else:
                remaining = r.prompt_len - r.num_computed
                assert not r.is_decoding and 1 <= c.num_tokens <= remaining
                assert c.sample == (c.num_tokens == remaining)
        decoding = [r.request_id for r in admitted if r.is_decoding]
        prefilling = [r.request_id for r in admitted if not r.is_decoding]
        planned_decodes = [c.request_id for c in chunks if c.is_decode]
        planned_prefills = [c for c in chunks if not c.is_decode]
        if len(decoding) <= budget.max_num_seqs:
            assert planned_decodes == decoding
        assert [c.request_id for c in planned_prefills] == prefilling[: len(planned_prefills)]
        assert all(c.sample for c in planned_prefills[:-1]), (
            "a later prompt went ahead of an earlier one"
        )
        if admitted:
            assert chunks
        if force_mixed:
            assert len(planned_prefills) <= 1
            assert all(c.num_tokens <= FORCED_CHUNK_TOKENS for c in planned_prefills)
        elif planned_prefills and not planned_prefills[-1].sample:
            # Work conserving: a prompt is cut short only by the token budget.
            assert plan.num_tokens == budget.max_num_batched_tokens

    def test_long_prompt_is_chunked_beside_decodes(self):
        admitted = [
            PlanInput(1, 5, 7),
            PlanInput(2, 3, 3),
            PlanInput(3, 100, 40),
            PlanInput(4, 10, 0),
        ]
        plan = plan_step(admitted, StepBudget(32, 8))
        assert [(c.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks] == [
            (1, 7, 1, True),
            (2, 3, 1, True),
            (3, 40, 30, False),
        ]
        assert plan.is_mixed

    @settings(max_examples=150, deadline=None)
    @given(
        st.lists(
            st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(0, 6)),
            min_size=1,
            max_size=10,
        ),
        st.integers(1, 6),
        st.integers(8, 64),
        st.booleans(),
    )
    def test_simulated_lifetimes(self, specs, num_slots, token_budget, force_mixed):
        """Drive admission + planning to the end: every request runs each position once, in
        order, finishes, and the ledger returns to empty; forced mixing mixes."""
        block_size = 4
        ledger = CapacityLedger(num_slots, num_blocks=64, block_size=block_size)
        budget = StepBudget(max(token_budget, num_slots), num_slots)
        pending = [  # (arrival step, id, prompt_len, max_tokens)
            (arrive, i, p, m) for i, (p, m, arrive) in enumerate(specs) if ledger.fits_ever(p + m)
        ]
        waiting: list[tuple[int, int, int]] = []
        state: dict[int, list[int]] = {}  # id -> [prompt_len, max_tokens, computed, outputs]
        order: list[int] = []
        done = set()
        for step in range(2000):
            waiting += [(i, p, m) for arrive, i, p, m in pending if arrive == step]
            while waiting and ledger.can_admit(waiting[0][1] + waiting[0][2]):
                i, p, m = waiting.pop(0)
                ledger.admit(i, p + m)
                state[i] = [p, m, 0, 0]
                order.append(i)
            if not order and not waiting and step > max(a for a, *_ in pending):
                break
            plan = plan_step(
                [PlanInput(i, state[i][0], state[i][2]) for i in order], budget, force_mixed
            )
            assert plan.chunks or not order
            for c in plan.chunks:
                s = state[c.request_id]
                assert c.start == s[2]
                s[2] += c.num_tokens
                if c.sample:
                    s[3] += 1
                    # computed through the prompt and all but the newest
                    assert s[2] == s[0] + s[3] - 1
                    if s[3] == s[1]:
                        order.remove(c.request_id)
                        ledger.release(c.request_id)
                        done.add(c.request_id)
        assert done == {i for _, i, _, _ in pending}
        assert ledger.free_slots == num_slots and ledger.free_blocks == 64
        for i in done:
            p, m, computed, outputs = state[i]
            assert outputs == m and computed == p + m - 1  # the last token is never fed back

    @pytest.mark.parametrize("force_mixed", [False, True])
    def test_force_mixed_overlaps_prefill_with_decode(self, force_mixed):
        """Two requests arriving together: by default both prompts run in the first step and
        no step mixes; forced, the second prompt is chunked beside the first's decodes."""
        state = {1: [20, 0], 2: [20, 0]}  # prompt_len, computed
        mixed = []
        for _ in range(12):
            plan = plan_step(
                [PlanInput(i, p, c) for i, (p, c) in state.items()], StepBudget(64, 4), force_mixed
            )
            mixed.append(plan.is_mixed)
            for c in plan.chunks:
                state[c.request_id][1] += c.num_tokens
        assert any(mixed) == force_mixed


class TestMedia:
    @settings(max_examples=300, deadline=None)
    @given(st.integers(2, 80), st.data())
    def test_a_prompt_whose_media_a_step_can_start_is_planned_to_its_end(self, tokens, data):
        """A lone prompt whose every image costs at most the budget to start (its first token
        and its patches) is planned to its end, one chunk a step, each step's tokens and
        patches within the budget, each image's patches spent in the step of its first token."""
        budget = StepBudget(tokens, 1)
        prompt_len = data.draw(st.integers(1, 120))
        firsts = sorted(data.draw(st.sets(st.integers(0, prompt_len - 1), max_size=4)))
        patches = [data.draw(st.integers(1, max_medium_patches(tokens))) for _ in firsts]
        media = tuple(zip(firsts, patches, strict=True))
        computed, encoded = 0, set()
        for _ in range(prompt_len):
            (chunk,) = plan_step([PlanInput(1, prompt_len, computed, media=media)], budget).chunks
            assert chunk.start == computed
            started = [(f, p) for f, p in media if computed <= f < computed + chunk.num_tokens]
            assert chunk.num_tokens + sum(p for _, p in started) <= tokens
            encoded.update(started)
            computed += chunk.num_tokens
            if computed == prompt_len:
                break
        assert computed == prompt_len and encoded == set(media)

    def test_an_image_of_the_whole_budget_never_starts(self):
        """Its first token and its patches are one more than the budget: the engine refuses
        such an image (tests/test_vision.py), which would otherwise wait forever."""
        plan = plan_step([PlanInput(1, 10, 0, media=((0, 16),))], StepBudget(16, 1))
        assert plan.chunks == ()
        plan = plan_step([PlanInput(1, 10, 0, media=((0, 15),))], StepBudget(16, 1))
        assert [(c.start, c.num_tokens) for c in plan.chunks] == [(0, 1)]


class TestCapacityLedger:
    def test_ask_then_reserve_then_release(self):
        ledger = CapacityLedger(num_slots=2, num_blocks=10, block_size=16)
        assert (
            ledger.blocks_for(1) == 1 and ledger.blocks_for(16) == 1 and ledger.blocks_for(17) == 2
        )
        assert ledger.can_admit(100)  # 7 blocks
        ledger.admit(1, 100)
        assert (ledger.free_slots, ledger.free_blocks) == (1, 3)
        assert not ledger.can_admit(49)  # 4 blocks
        with pytest.raises(CapacityError, match="4 blocks"):
            ledger.admit(2, 49)
        assert (ledger.free_slots, ledger.free_blocks) == (1, 3)  # a refused admit changed nothing
        ledger.admit(2, 48)
        assert not ledger.can_admit(1)  # no slot left
        with pytest.raises(CapacityError, match="already"):
            ledger.admit(2, 1)
        ledger.release(1)
        with pytest.raises(CapacityError, match="no reservation"):
            ledger.release(1)
        ledger.release(2)
        assert (ledger.free_slots, ledger.free_blocks) == (2, 10)
        assert ledger.fits_ever(160) and not ledger.fits_ever(161)

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.booleans(), st.integers(1, 200)), max_size=60))
    def test_never_overcommits(self, ops):
        ledger = CapacityLedger(num_slots=4, num_blocks=20, block_size=8)
        held: dict[int, int] = {}
        for n, (admit, tokens) in enumerate(ops):
            if admit:
                ok = ledger.can_admit(tokens)
                if ok:
                    ledger.admit(n, tokens)
                    held[n] = -(-tokens // 8)
                else:
                    assert len(held) == 4 or sum(held.values()) + -(-tokens // 8) > 20
            elif held:
                victim = next(iter(held))
                ledger.release(victim)
                del held[victim]
            assert ledger.free_slots == 4 - len(held) >= 0
            assert ledger.free_blocks == 20 - sum(held.values()) >= 0


class TestRequestLifecycle:
    def _request(self, **params):
        return Request(
            request_id=9,
            index=0,
            prompt_ids=(5, 6, 7),
            params=SamplingParams(max_tokens=3, **params),
            seed=0,
            arrival_time_s=0.0,
        )

    def test_counters_move_only_through_transitions(self):
        r = self._request()
        assert (r.status, r.lifetime_tokens, r.is_prefilling) == (RequestStatus.WAITING, 6, True)
        with pytest.raises(ValueError, match="waiting"):
            r.advance(1)
        r.admit()
        r.mark_sent(r.prompt_len)
        assert r.input_tokens(0, 2) == [5, 6]
        r.advance(2)
        with pytest.raises(ValueError, match="computed"):
            r.append_token(1, now_s=1.0)  # sampling before the prompt is in
        assert r.input_tokens(2, 1) == [7]
        r.advance(1)
        r.append_token(11, now_s=1.0)
        assert not r.is_prefilling and r.input_tokens(3, 1) == [11]
        with pytest.raises(ValueError, match="positions"):
            r.input_tokens(2, 2)
        r.advance(1)
        r.append_token(12, now_s=2.0)
        assert r.output_ids == (11, 12) and r.num_tokens == 5 and r.num_computed == 4
        r.finish("length")
        assert r.status is RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"
        with pytest.raises(ValueError, match="already"):
            r.finish("abort")
        with pytest.raises(ValueError, match="finished_length"):
            r.advance(1)

    def test_terminal_statuses_name_their_reason(self):
        for reason in ("stop", "length", "abort", "error"):
            r = self._request()
            r.admit()
            r.finish(reason)
            assert r.is_finished and r.finish_reason == reason
        r = self._request()
        with pytest.raises(ValueError, match="cannot end with 'stop'"):
            r.finish("stop")  # never ran
        r.finish("abort")
        assert FINISH_REASON[r.status] == "abort"


class TestKvRoom:
    """Admission by present need: a step's chunks take the blocks their positions pass
    (`grow`), never more than are free."""

    @settings(max_examples=300, deadline=None)
    @given(admitted_and_budget(), st.integers(0, 8), st.sampled_from([1, 4, 16]), st.data())
    def test_a_plan_never_runs_out(self, case, free_blocks, block_size, data):
        admitted, budget = case
        admitted = [  # each holds at least its computed positions' blocks, maybe more
            PlanInput(
                r.request_id,
                r.prompt_len,
                r.num_computed,
                num_blocks=-(-r.num_computed // block_size) + data.draw(st.integers(0, 2)),
                num_drafts=data.draw(st.integers(0, 3)),  # speculative drafts: blocks too
            )
            for r in admitted
        ]
        room = KvRoom(free_blocks, block_size)
        plan = plan_step(admitted, budget, room=room)
        by_id = {r.request_id: r for r in admitted}
        assert sum(c.grow for c in plan.chunks) <= free_blocks
        for c in plan.chunks:
            held = by_id[c.request_id].num_blocks
            end = c.start + c.num_tokens
            assert end <= (held + c.grow) * block_size, "positions past its blocks"
            assert c.grow == 0 or end > (held + c.grow - 1) * block_size, "a block not needed"
        unbounded = plan_step(admitted, budget)
        if free_blocks >= sum(-(-r.prompt_len // block_size) + 3 for r in admitted):
            assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [
                (c.request_id, c.num_tokens) for c in unbounded.chunks
            ]  # room enough: the same step

    def test_a_decode_without_a_block_waits_and_others_go_on(self):
        admitted = [
            PlanInput(1, 4, 4, num_blocks=1),  # position 4 needs a second block of 4
            PlanInput(2, 3, 3, num_blocks=1),  # position 3 fits its block
            PlanInput(3, 8, 8, num_blocks=2),  # position 8 needs a third
            PlanInput(4, 12, 0, num_blocks=3),  # its prompt's blocks were taken at admission
        ]
        plan = plan_step(admitted, StepBudget(32, 8), room=KvRoom(1, 4))
        assert [(c.request_id, c.num_tokens, c.grow) for c in plan.chunks] == [
            (1, 1, 1),
            (2, 1, 0),
            (4, 12, 0),
        ]

    def test_drafts_shrink_to_the_blocks_left_never_a_decode(self):
        """Every decode's own token is planned first; drafts take what blocks are left."""
        admitted = [
            PlanInput(1, 4, 7, num_blocks=2, num_drafts=3),  # 7..10: a third block for 8..10
            PlanInput(2, 4, 8, num_blocks=2, num_drafts=3),  # its own token needs a block
            PlanInput(3, 4, 5, num_blocks=2, num_drafts=2),  # 5..7 fit its blocks
        ]
        plan = plan_step(admitted, StepBudget(32, 8), room=KvRoom(1, 4))
        assert [(c.request_id, c.num_tokens, c.grow) for c in plan.chunks] == [
            (1, 1, 0),  # no block left for its drafts
            (2, 4, 1),  # 8..11 in the block its token takes
            (3, 3, 0),
        ]
        roomy = plan_step(admitted, StepBudget(32, 8), room=KvRoom(2, 4))
        assert [(c.num_tokens, c.grow) for c in roomy.chunks] == [(4, 1), (4, 1), (3, 0)]


class TestGrowthAndPreemption:
    def test_ledger_grows_and_counts_what_a_release_frees(self):
        ledger = CapacityLedger(num_slots=3, num_blocks=6, block_size=4)
        ledger.admit(1, 5)  # 2 blocks
        assert ledger.growth(1, 8) == 0 and ledger.growth(1, 9) == 1
        ledger.grow(1, 1)
        assert len(ledger.blocks(1)) == 3 and ledger.free_blocks == 3
        with pytest.raises(CapacityError, match="4 blocks; 3 are free"):
            ledger.grow(1, 4)
        assert not ledger.can_admit(8, keep_free=2)  # 2 blocks + 2 kept > 3 free
        ledger.admit(2, 8, shared=ledger.blocks(1)[:2])  # shares two of request 1's blocks
        assert ledger.free_blocks == 3
        assert ledger.freed_by(ledger.blocks(1)) == 1  # the two shared stay held by request 2
        both = ledger.blocks(1) + ledger.blocks(2)
        assert ledger.freed_by(both) == 3
        assert ledger.freed_by(both, kept=ledger.blocks(2)[:1]) == 2
        assert ledger.release(1) == [0, 1, 2] and ledger.free_blocks == 4

    def test_a_preempted_request_prefills_its_output_and_keeps_its_usage(self):
        r = Request(9, 0, (5, 6, 7), SamplingParams(max_tokens=5, prompt_logprobs=1), 0, 0.0)
        r.admit(1)
        assert r.num_cached == 1 and r.prompt_logprobs_fields(1, 2, False) == (1, -1)
        r.mark_sent(3)
        r.advance(2)
        r.append_token(11, now_s=1.0)
        r.mark_sent(4)
        r.advance(1)
        r.append_token(12, now_s=2.0)
        r.preempt()
        assert (r.status, r.num_computed, r.num_sent, r.on_ranks) == (
            RequestStatus.WAITING,
            0,
            0,
            False,
        )
        assert (r.prefill_len, r.prefill_ids, r.prompt_len) == (5, (5, 6, 7, 11, 12), 3)
        r.admit(4)  # from a saved prefix of 4 positions: not counted as cached prompt tokens
        assert r.num_cached == 1 and r.num_computed == 4 and r.is_prefilling
        assert r.input_tokens(4, 1) == [12]
        assert r.prompt_logprobs_fields(4, 1, False) == (-1, -1)  # delivered already
        r.mark_sent(5)
        r.advance(1)
        r.append_token(13, now_s=3.0)
        assert r.output_ids == (11, 12, 13) and not r.is_prefilling
        with pytest.raises(ValueError, match="in flight"):
            r.mark_sent(6)
            r.preempt()

    def test_preempted_requests_go_back_in_front_oldest_first(self):
        def entry(rid: int, priority: int = 0) -> Entry:
            request = Request(rid, 0, (1, 2), SamplingParams(), 0, 0.0, priority=priority)
            return Entry(request, None, None)

        queue = WaitingQueue()
        queue.extend([entry(7), entry(8)])
        queue.requeue([entry(5), entry(3)])  # youngest first, as the scheduler picks them
        assert [queue.popleft().request.request_id for _ in range(4)] == [3, 5, 7, 8]
        assert queue.num_choices == 0
        ranked = WaitingQueue(by_priority=True)
        ranked.extend([entry(7, priority=-1), entry(8, priority=2)])
        ranked.requeue([entry(6, priority=2), entry(5, priority=0)])
        assert [ranked.popleft().request.request_id for _ in range(4)] == [7, 5, 6, 8]
