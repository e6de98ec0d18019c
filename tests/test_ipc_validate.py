"""The controller's checks without processes: plans it must refuse before dispatch, reply
sets it must accept (shuffled) or find fatal, and the gate's shared words."""

from __future__ import annotations

import math
import random

import msgspec
import pytest
from ipc_helpers import replica_config

from deltaserve.ipc.gate import CANCEL, EXECUTE, StartGate
from deltaserve.ipc.messages import (
    Ack,
    DropAck,
    DropRequests,
    Failure,
    NewRequest,
    Ping,
    PromptLogprobs,
    RunUnifiedStep,
    Sample,
    SampleColumns,
    SamplingSpec,
    SnapshotReply,
    StepItem,
    StepResult,
    reply_decoder,
)
from deltaserve.ipc.validate import (
    PlanRejected,
    ReplyError,
    ReplySet,
    check_drop_plan,
    check_plan,
)

VOCAB = 1000
SPEC = SamplingSpec(seed=1)


def new(reserve: int = 64, **spec: object) -> NewRequest:
    return NewRequest(reserve, SamplingSpec(seed=1, **spec))


def step_items() -> list[StepItem]:
    return [
        StepItem(1, 10, [5], True),  # decode
        StepItem(2, 0, [1, 2, 3], False, new()),  # first chunk, more to come
        StepItem(3, 0, [4, 5], True, new()),  # whole prompt: samples
        StepItem(4, 16, [7, 8, 9], True),  # last chunk
    ]


class TestPlan:
    """A plan error is provable before dispatch: PlanRejected names the request and value."""

    def test_valid_plan(self) -> None:
        plan = check_plan(step_items(), VOCAB)
        assert plan.item_ids == {1, 2, 3, 4}
        assert plan.sampled_ids == [1, 3, 4]  # in step order: the order results are handed on

    @pytest.mark.parametrize(
        ("item", "message"),
        [
            (StepItem(1, 3, [5], True), "request 1 appears twice"),
            (StepItem(9, 0, [], True, new()), "request 9: first chunk .start 0. has no token_ids"),
            (StepItem(9, -1, [5], True), "request 9: negative start -1"),
            (StepItem(9, 4, [5], True, new()), "request 9: `new` on an item starting at 4"),
            (StepItem(9, 0, [5], True), "request 9: first chunk .start 0. without `new`"),
            (StepItem(9, 3, [VOCAB], True), f"request 9: token id {VOCAB} outside"),
            (StepItem(9, 3, [1, -2, 3], True), "request 9: token id -2 outside"),
            (StepItem(9, 0, [1, 2, 3], True, new(reserve=2)), "reserve_tokens 2 is less than"),
            (StepItem(9, 0, [1], True, new(top_p=0.0)), "top_p 0.0"),
            (StepItem(9, 0, [1], True, new(temperature=-1.0)), "temperature -1.0"),
            (StepItem(9, 0, [1], True, new(num_logprobs=21)), "num_logprobs 21"),
            (StepItem(9, 3, [5], True, grow=-1), "request 9: grow -1"),
            (StepItem(9, 0, [5], True, new(), grow=1), "request 9: grow 1; .* with `new`"),
            (
                StepItem(9, 0, [5], True, NewRequest(4, SPEC, output_ids=(3, VOCAB))),
                "request 9: an output id outside the vocabulary",
            ),
        ],
    )
    def test_rejected(self, item: StepItem, message: str) -> None:
        with pytest.raises(PlanRejected, match=message):
            check_plan([StepItem(1, 10, [5], True), item], VOCAB)

    @pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
    @pytest.mark.parametrize(
        "name",
        [
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ],
    )
    def test_non_finite_sampling_rejected(self, name: str, value: float) -> None:
        """NaN passes every range comparison and inf is no sampling value: both are refused
        before dispatch, naming the field."""
        item = StepItem(9, 0, [1], True, new(**{name: value}))
        with pytest.raises(PlanRejected, match=f"request 9: {name} {value} is not a finite number"):
            check_plan([StepItem(1, 10, [5], True), item], VOCAB)

    def test_pipelined_step(self) -> None:
        """A decode item without token ids (the ranks' last sample) is valid; a step's drops
        may not repeat a request nor name one that the step runs."""
        plan = check_plan([StepItem(1, 10, [], True)], VOCAB, drops=[2, 3])
        assert plan.sampled_ids == [1]
        with pytest.raises(PlanRejected, match="request 2 appears twice in one drop"):
            check_plan([StepItem(1, 10, [], True)], VOCAB, drops=[2, 2])
        with pytest.raises(PlanRejected, match="request 1 is both dropped and run in one step"):
            check_plan([StepItem(1, 10, [], True)], VOCAB, drops=[3, 1])

    def test_empty_step_rejected(self) -> None:
        with pytest.raises(PlanRejected, match="no items"):
            check_plan([], VOCAB)

    def test_drop_plan(self) -> None:
        check_drop_plan([1, 2], "must_exist")
        with pytest.raises(PlanRejected, match="request 2 appears twice"):
            check_drop_plan([1, 2, 2], "must_exist")
        with pytest.raises(PlanRejected, match="expect"):
            check_drop_plan([1], "maybe")


def sample(rid: int, top: int = 0) -> Sample:
    return Sample(rid, rid + 100, -0.5, [(rid + 100 + k, -0.5 - k) for k in range(top)])


def step_replies(samples: list[Sample], num_ranks: int = 2, seq: int = 7) -> ReplySet:
    items = step_items()
    replies = ReplySet(RunUnifiedStep(seq, items), num_ranks, check_plan(items, VOCAB))
    for rank in range(1, num_ranks):
        assert not replies.add(Ack(rank, seq))
    assert replies.add(StepResult(0, seq, SampleColumns.from_samples(samples)))
    return replies


class TestStepReplies:
    """Results are aligned by request id: shuffled is fine; unknown, duplicate, non-final
    and missing samples are fatal."""

    def test_results_in_step_order_accepted(self) -> None:
        samples = [sample(1), sample(3, top=2), sample(4)]
        result = step_replies(samples).result()
        assert [result.sample(row) for row in range(3)] == samples

    @pytest.mark.parametrize("seed", range(3))
    def test_shuffled_results_accepted_in_step_order(self, seed: int) -> None:
        samples = [sample(1), sample(3, top=2), sample(4)]
        shuffled = random.Random(seed).sample(samples, len(samples))
        result = step_replies(shuffled).result()
        assert result.request_ids == [1, 3, 4]
        assert [result.sample(row) for row in range(3)] == samples

    @pytest.mark.parametrize(
        ("samples", "message"),
        [
            ([sample(1), sample(3), sample(4), sample(99)], "request 99, which is not in the step"),
            ([sample(1), sample(3), sample(4), sample(3)], "two samples for request 3"),
            ([sample(1), sample(2), sample(3), sample(4)], "request 2, whose item asked for none"),
            ([sample(1), sample(4)], r"no sample for request\(s\) \[3\]"),
            (
                [sample(1), Sample(3, VOCAB, -0.5, []), sample(4)],
                f"sampled token {VOCAB} for request 3, outside",
            ),
            (
                [sample(1), sample(3), Sample(4, 104, -0.5, [(-2, -1.0)])],
                "top logprob for request 4 outside",
            ),
        ],
    )
    def test_bad_results_fatal(self, samples: list[Sample], message: str) -> None:
        with pytest.raises(ReplyError, match=message):  # as soon as rank 0's reply arrives
            step_replies(samples)

    def test_failed_requests_travel_with_their_samples(self) -> None:
        """A request past its own bounds (SampleColumns.failed) is the step's data, kept in
        step order; one reported without a sample in the step is a protocol error."""
        samples = [sample(1), sample(3), sample(4)]
        failed = SampleColumns.from_samples(samples[::-1], failed={3: "past max_mask_ms"})
        replies = ReplySet(RunUnifiedStep(7, step_items()), 1, check_plan(step_items(), VOCAB))
        replies.add(StepResult(0, 7, failed))
        assert replies.result().failed == {3: "past max_mask_ms"}
        assert replies.result().request_ids == [1, 3, 4]
        stray = SampleColumns.from_samples(samples, failed={2: "past max_mask_ms"})
        replies = ReplySet(RunUnifiedStep(7, step_items()), 1, check_plan(step_items(), VOCAB))
        with pytest.raises(ReplyError, match="request 2 failed, which has no sample"):
            replies.add(StepResult(0, 7, stray))

    def test_alternatives_without_a_sample_fatal(self) -> None:
        result = SampleColumns.from_samples([sample(1), sample(3), sample(4)])
        result = msgspec.structs.replace(result, top_logprobs={2: [(5, -1.0)]})
        replies = ReplySet(RunUnifiedStep(7, step_items()), 1, check_plan(step_items(), VOCAB))
        with pytest.raises(ReplyError, match="top logprobs for request 2, which has no sample"):
            replies.add(StepResult(0, 7, result))

    def test_prompt_logprob_rows_checked(self) -> None:
        """A chunk asking for prompt logprobs gets a row per position whose next token is a
        prompt token (one fewer on the chunk that samples), k alternatives each; nothing else
        gets any."""
        items = [
            StepItem(2, 0, [1, 2, 3], False, new(), prompt_logprobs=2, next_token=4),
            StepItem(3, 0, [4, 5], True, new(), prompt_logprobs=0),
        ]
        plan = check_plan(items, VOCAB)
        assert plan.prompt_logprobs == {2: (3, 2), 3: (1, 0)}

        def reply(parts: dict) -> None:
            result = SampleColumns.from_samples([sample(3)], parts)
            ReplySet(RunUnifiedStep(7, items), 1, plan).add(StepResult(0, 7, result))

        def rows(n: int, k: int, rank: int = 1, token: int = 5) -> PromptLogprobs:
            return PromptLogprobs([-1.0] * n, [rank] * n, [[(token, -1.0)] * k for _ in range(n)])

        reply({2: rows(3, 2), 3: rows(1, 0)})
        for parts, message in [
            ({2: rows(3, 2)}, r"none for \[3\] that asked"),
            ({2: rows(3, 2), 3: rows(1, 0), 1: rows(0, 0)}, r"request\(s\) \[1\] that asked none"),
            ({2: rows(2, 2), 3: rows(1, 0)}, "2 prompt logprob rows for request 2, not 3 of 2"),
            ({2: rows(3, 1), 3: rows(1, 0)}, "not 3 of 2 alternatives"),
            ({2: rows(3, 2, rank=0), 3: rows(1, 0)}, "rank below 1 for request 2"),
            ({2: rows(3, 2, token=VOCAB), 3: rows(1, 0)}, "prompt logprob for request 2 outside"),
        ]:
            with pytest.raises(ReplyError, match=message):
                reply(parts)

    @pytest.mark.parametrize(
        ("item", "message"),
        [
            (StepItem(9, 0, [1, 2], False, new(), prompt_logprobs=1), "next_token -1 outside"),
            (
                StepItem(9, 0, [1, 2], True, new(), prompt_logprobs=1, next_token=3),
                "samples has no next prompt",
            ),
            (StepItem(9, 0, [1, 2], True, new(), prompt_logprobs=21), "prompt_logprobs 21 outside"),
            (StepItem(9, 4, [], True, prompt_logprobs=1), "without prompt tokens"),
            (
                StepItem(9, 0, [1, 2], False, new(), prompt_logprobs=-2),
                "prompt_logprobs -2 outside",
            ),
            (
                StepItem(9, 0, [1, 2], False, new(), next_token=3),
                "next_token 3 without prompt_logprobs",
            ),
        ],
    )
    def test_prompt_logprob_items_rejected(self, item: StepItem, message: str) -> None:
        with pytest.raises(PlanRejected, match=message):
            check_plan([item], VOCAB)

    def test_misaligned_sample_columns_do_not_decode(self) -> None:
        """Columns of different lengths are a decode error (a protocol error), never a crash."""
        with pytest.raises(ValueError, match="sample columns differ in length"):
            SampleColumns([1, 2], [5], [0.0], {})
        frame = msgspec.msgpack.encode(["StepResult", 0, 7, [[1, 2], [5], [0.0], {}]])
        with pytest.raises(msgspec.ValidationError, match="sample columns differ in length"):
            reply_decoder.decode(frame)

    @pytest.mark.parametrize(
        ("reply", "message"),
        [
            (Ack(2, 7), "claims rank 2, outside 0..1"),
            (Ack(-1, 7), "claims rank -1"),
            (
                StepResult(1, 7, SampleColumns([], [], [], {})),
                "rank 1 replied StepResult to RunUnifiedStep seq 7; expected Ack",
            ),
            (
                Failure(1, 7, "StepError: request 1 is not held"),
                "rank 1 failed RunUnifiedStep seq 7: StepError",
            ),
        ],
    )
    def test_bad_reply_fatal(self, reply: object, message: str) -> None:
        replies = ReplySet(RunUnifiedStep(7, step_items()), 2, check_plan(step_items(), VOCAB))
        with pytest.raises(ReplyError, match=message):
            replies.add(reply)

    def test_rank0_must_carry_the_result(self) -> None:
        replies = ReplySet(RunUnifiedStep(7, step_items()), 2, check_plan(step_items(), VOCAB))
        with pytest.raises(ReplyError, match="rank 0 replied Ack .* expected StepResult"):
            replies.add(Ack(0, 7))

    def test_second_reply_fatal(self) -> None:
        replies = ReplySet(Ping(3), 2)
        replies.add(Ack(1, 3))
        with pytest.raises(ReplyError, match="rank 1 sent a second reply to Ping seq 3"):
            replies.add(Ack(1, 3))
        assert replies.missing_ranks() == [0]


def drop_replies(expect: str, answers: list[list[bool]]) -> ReplySet:
    command = DropRequests(4, [10, 11], expect)
    replies = ReplySet(command, len(answers))
    for rank, existed in enumerate(answers):
        replies.add(DropAck(rank, 4, existed))
    return replies


class TestDropAcks:
    """must_exist needs every rank True, must_be_absent every rank False."""

    def test_expected_answers(self) -> None:
        assert drop_replies("must_exist", [[True, True], [True, True]]).result() is None
        assert drop_replies("must_be_absent", [[False, False], [False, False]]).result() is None

    @pytest.mark.parametrize(
        ("expect", "answers", "message"),
        [
            (
                "must_exist",
                [[True, True], [True, False]],
                r"disagree on request 11: rank\(s\) \[0\] held it, rank\(s\) \[1\] did not",
            ),
            ("must_be_absent", [[False, True], [False, False]], "disagree on request 11"),
            (
                "must_exist",
                [[True, False], [True, False]],
                "request 11 dropped with expect=must_exist, but no rank held it",
            ),
            (
                "must_be_absent",
                [[True, False], [True, False]],
                "request 10 .* every rank still held it",
            ),
            ("must_exist", [[True], [True, True]], "rank 0 answered 1 flags"),
        ],
    )
    def test_unexpected_answers_fatal(self, expect: str, answers: list, message: str) -> None:
        with pytest.raises(ReplyError, match=message):
            drop_replies(expect, answers).result()

    def test_snapshot_variant(self) -> None:
        from deltaserve.ipc.messages import Snapshot

        replies = ReplySet(Snapshot(5), 1)
        snap = SnapshotReply(0, 5, [], 0, 0, 8, 256, 8, 4)
        assert replies.add(snap)
        assert replies.result() == [snap]


class TestGateWords:
    """Payload first, sequence last; a reader trusts nothing mid-update or stale."""

    def test_receipt_and_decision(self) -> None:
        gate = StartGate.create(2)
        try:
            rank_view = StartGate.attach(gate.name, 2)
            assert gate.receipt(1) == (0, 0)
            rank_view.record_receipt(1, 5, 0xDEADBEEF)
            assert gate.receipt(1) == (5, 0xDEADBEEF)
            assert rank_view.decision(5) == 0
            gate.decide(5, EXECUTE)
            assert rank_view.decision(5) == EXECUTE
            assert rank_view.decision(6) == 0
            gate.decide(6, CANCEL)
            assert rank_view.decision(6) == CANCEL
            rank_view.mark_done(1, 6)
            assert gate.done_seq(1) == 6
            rank_view.close()
        finally:
            gate.close(unlink=True)

    def test_sequences_past_31_bits(self) -> None:
        """A receipt's tag holds the seq's low 32 bits above the crc: from seq 2**31 it set the
        word's sign bit, a signed word wrapped it, and no receipt was trusted again (the gate
        timed out and the replica died after 2**31 commands, ~61 days of decoding)."""
        gate = StartGate.create(1)
        try:
            for seq in (2**31 - 1, 2**31, 2**32 - 1, 2**32 + 7, 2**62 - 1):
                gate.record_receipt(0, seq, 0xFFFFFFFF)
                assert gate.receipt(0) == (seq, 0xFFFFFFFF), seq
                gate.decide(seq, EXECUTE)
                assert gate.decision(seq) == EXECUTE, seq
        finally:
            gate.close(unlink=True)

    def test_half_written_words_are_not_trusted(self) -> None:
        gate = StartGate.create(1)
        try:
            words = gate._words
            gate.decide(3, EXECUTE)
            words[1] = 4  # sequence published, payload still seq 3's
            assert gate.decision(4) == 0
            gate.record_receipt(0, 8, 123)
            words[8 + 1] = 9  # receipt seq moved on, tag still names seq 8
            assert gate.receipt(0) is None
            del words  # the gate's mapping can close only without outside views
        finally:
            gate.close(unlink=True)


class TestReplicaConfig:
    """Configs that cannot work are refused with a ValueError naming the field."""

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            (
                {"device": "cuda", "tp_size": 2, "device_ids": (0, 0)},
                r"device_ids \(0, 0\) names a device twice",
            ),
            ({"device": "cpu", "device_ids": (0,)}, "device_ids .* given with device 'cpu'"),
            ({"device": "cuda", "tp_size": 2, "device_ids": (0,)}, "has 1 entries for tp_size 2"),
            ({"device": "cuda:1"}, "name the device kind, 'cpu' or 'cuda'"),
            ({"device": "tpu"}, "device must be 'cpu' or 'cuda"),
            ({"tp_size": 0}, "tp_size must be an integer >= 1"),
            ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
            ({"num_kv_blocks": None}, "num_kv_blocks None .*: CUDA only"),
            ({"step_timeout_s": 0}, "step_timeout_s must be > 0"),
        ],
    )
    def test_bad_config(self, kwargs: dict, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            replica_config("/nonexistent", **kwargs)


@pytest.mark.parametrize(
    "visible,count",
    [
        (None, 4),
        ("", 0),
        ("0,1", 2),
        ("3", 1),
        ("0,5,1", 1),
        ("-1", 0),
        ("GPU-8f2c,1", 2),
        ("1,1,2", 1),
        (" 2, 0", 2),
    ],
)
def test_visible_devices_read_as_the_cuda_runtime_does(visible: str | None, count: int) -> None:
    """The server counts GPUs without torch; the count must match what a rank's CUDA sees,
    or a missing ordinal would pass the server's check and fail later, inside a rank."""
    from deltaserve.ipc.replica_config import visible_devices

    assert visible_devices(4, visible) == count
