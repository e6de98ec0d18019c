"""Property-based fuzzing of every msgspec decoder on the control plane and of the monitor
schema's (skipped while engine/monitor_schema.py does not exist): commands, replies, start-up
messages, the rank's RankConfig, the fault header. Whatever the bytes, a decoder returns a value of
its declared types or raises one of `DECODE_ERRORS` (msgspec.DecodeError; UnicodeDecodeError for a
string that is not UTF-8, which msgspec does not wrap), the errors every decode site catches; what
it returns re-encodes to the same bytes. Decoded replies and plans then go through the controller's
checks (ipc/validate.py), which answer only with ReplyError / PlanRejected. No processes: pure
functions. `pytest --long`: 10x the examples.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaserve.ipc import faults, launch, messages
from deltaserve.ipc.messages import (
    DECODE_ERRORS,
    Ack,
    DropAck,
    DropRequests,
    Failure,
    NewRequest,
    Ping,
    Ready,
    RunUnifiedStep,
    Sample,
    SampleColumns,
    SamplingSpec,
    Shutdown,
    Snapshot,
    SnapshotReply,
    StartupFailed,
    StepItem,
    StepResult,
)
from deltaserve.ipc.validate import PlanRejected, ReplyError, ReplySet, check_drop_plan, check_plan

QUICK_EXAMPLES, LONG_EXAMPLES = 300, 3000
VOCAB = 1000

encode = msgspec.msgpack.encode

# ---- generic msgpack values --------------------------------------------------------------

_ints = st.integers(-(2**63), 2**64 - 1) | st.integers(-3, 3)
_scalars = (
    st.none() | st.booleans() | _ints | st.floats() | st.text(max_size=10) | st.binary(max_size=10)
)
TREE = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def tagged(tags: list[str]) -> st.SearchStrategy[bytes]:
    """Arrays that start with a real tag: they get past the union's tag to field checks."""
    return st.tuples(st.sampled_from(tags), st.lists(TREE, max_size=7)).map(
        lambda t: encode([t[0], *t[1]])
    )


def mutations(frames: list[bytes]) -> st.SearchStrategy[bytes]:
    """Valid frames with bytes flipped, cut or inserted."""

    def mutate(t: tuple[int, int, int, bytes]) -> bytes:
        which, at, cut, insert = t
        frame = frames[which % len(frames)]
        at %= len(frame) + 1
        return frame[:at] + insert + frame[at + cut :]

    return st.tuples(
        st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 3), st.binary(max_size=3)
    ).map(mutate)


# ---- well-formed messages (small ids so that replies can match a command) -----------------

_rid = st.integers(0, 5)
_rank = st.integers(-1, 2)
_seq = st.integers(0, 2)
_spec = st.builds(
    SamplingSpec,
    seed=st.integers(0, 2**63 - 1),
    temperature=st.floats(-1, 2),
    top_k=st.integers(-1, 2**40),
    top_p=st.floats(-1, 2),
    min_p=st.floats(-1, 2),
    num_logprobs=st.integers(-1, 30),
)
_item = st.builds(
    StepItem,
    request_id=_rid,
    start=st.integers(-1, 40),
    token_ids=st.lists(st.integers(-1, VOCAB), max_size=4),
    sample=st.booleans(),
    new=st.none() | st.builds(NewRequest, st.integers(-1, 64), _spec),
)
_sample = st.builds(
    Sample,
    request_id=_rid,
    token_id=st.integers(0, VOCAB),
    logprob=st.floats(),
    top_logprobs=st.lists(st.tuples(st.integers(0, VOCAB), st.floats()), max_size=2),
)
_samples = st.lists(_sample, max_size=4).map(SampleColumns.from_samples)
COMMANDS = st.one_of(
    st.builds(RunUnifiedStep, _seq, st.lists(_item, max_size=4)),
    st.builds(
        DropRequests,
        _seq,
        st.lists(_rid, max_size=4),
        st.sampled_from(["must_exist", "must_be_absent"]),
    ),
    st.builds(Ping, _seq),
    st.builds(Snapshot, _seq),
    st.builds(Shutdown, _seq),
)
REPLIES = st.one_of(
    st.builds(Ack, _rank, _seq),
    st.builds(DropAck, _rank, _seq, st.lists(st.booleans(), max_size=4)),
    st.builds(StepResult, _rank, _seq, _samples),
    st.builds(SnapshotReply, _rank, _seq, st.lists(_rid, max_size=3), *[st.integers(0, 9)] * 6),
    st.builds(Failure, _rank, _seq, st.text(max_size=10)),
)
STARTUP = st.builds(Ready, _rank, *[st.integers(0, 9)] * 3) | st.builds(
    StartupFailed, _rank, st.text()
)
FAULT_PLANS = st.builds(
    faults.FaultPlan,
    rank=st.integers(0, 3),
    kind=st.sampled_from(faults.FAULT_KINDS),
    at_seq=st.just(1),
    at_step=st.none(),
)
EXECUTOR_CONFIGS = st.builds(
    messages.ExecutorConfig,
    model=st.text(max_size=20),
    tp_size=st.just(4),
    rank=st.integers(0, 3),
    device=st.sampled_from(["cpu", "cuda:0"]),
    dtype=st.sampled_from(["auto", "bfloat16"]),
    block_size=st.integers(1, 64),
    max_num_seqs=st.integers(1, 64),
    num_kv_blocks=st.none() | st.integers(1, 4096),
    max_model_len=st.integers(0, 8192),
    enforce_eager=st.booleans(),
)
RANK_CONFIGS = st.builds(
    launch.RankConfig,
    executor=EXECUTOR_CONFIGS,
    parent_pid=st.integers(1, 2**22),
    command_endpoint=st.text(max_size=20),
    reply_endpoint=st.text(max_size=20),
    gate_name=st.text(max_size=20),
    receipt_fd=st.integers(0, 1000),
    release_fd=st.integers(0, 1000),
    release_timeout_s=st.floats(0.1, 100),
    dist_init_method=st.text(max_size=20),
    dist_timeout_s=st.floats(1, 100),
    fault=st.none() | FAULT_PLANS,
)


def _tags(union: object) -> list[str]:
    return [t.__struct_config__.tag for t in union.__args__]


_SPEC = SamplingSpec(seed=3, temperature=0.7, top_k=5, num_logprobs=2)
_CONFIG = launch.RankConfig(
    executor=messages.ExecutorConfig(
        "/m", rank=0, tp_size=2, max_num_seqs=8, num_kv_blocks=256, max_model_len=2048
    ),
    parent_pid=77,
    command_endpoint="ipc:///tmp/x/cmd0",
    reply_endpoint="ipc:///tmp/x/reply",
    gate_name="gate",
    receipt_fd=3,
    release_fd=4,
    release_timeout_s=15.0,
    dist_init_method="file:///tmp/x/s",
    dist_timeout_s=60.0,
    fault=faults.FaultPlan(1, "stall", at_step=2),
)
# Valid frames of each kind, mutated by the fuzzer.
VALID = {
    "command": [
        RunUnifiedStep(
            4, [StepItem(1, 0, [5, 6, 7], True, NewRequest(9, _SPEC)), StepItem(2, 8, [9], True)]
        ),
        DropRequests(5, [1, 2], "must_exist"),
        Ping(1),
        Snapshot(2),
        Shutdown(3),
    ],
    "reply": [
        Ack(1, 4),
        DropAck(0, 5, [True, False]),
        Failure(1, 2, "boom"),
        StepResult(
            0,
            4,
            SampleColumns.from_samples(
                [Sample(1, 5, -0.5, [(5, -0.5), (6, -1.5)]), Sample(2, 7, -0.1, [])]
            ),
        ),
        SnapshotReply(0, 2, [1], 1, 2, 8, 256, 8, 4),
    ],
    "startup": [Ready(0, 8, 256, 16), StartupFailed(1, "no such file")],
    "rank_config": [_CONFIG, msgspec.structs.replace(_CONFIG, fault=None)],
}
VALID["fault_header"] = VALID["command"]

# decoder name -> (decoder, expected types, tags, well-formed values)
DECODERS: dict[str, tuple] = {
    "command": (messages.command_decoder, messages.Command, _tags(messages.Command), COMMANDS),
    "reply": (messages.reply_decoder, messages.Reply, _tags(messages.Reply), REPLIES),
    "startup": (
        messages.startup_decoder,
        messages.StartupReply,
        _tags(messages.StartupReply),
        STARTUP,
    ),
    "rank_config": (launch.rank_config_decoder, launch.RankConfig, [], RANK_CONFIGS),
    "fault_header": (
        faults.header_decoder,
        faults.StepHeader | faults.DropHeader,
        ["RunUnifiedStep", "DropRequests"],
        COMMANDS,
    ),
}


@pytest.fixture
def examples(request: pytest.FixtureRequest) -> int:
    return LONG_EXAMPLES if request.config.getoption("--long") else QUICK_EXAMPLES


def fuzz(strategy, examples: int):
    return lambda f: settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )(given(strategy)(f))


def decoded_or_error(decoder, expected, frame: bytes) -> object | None:
    """The decoded value (of the expected types, re-encoding to a stable form), or None if
    the decoder refused the frame with one of DECODE_ERRORS; anything else fails the test."""
    try:
        value = decoder.decode(frame)
    except DECODE_ERRORS:
        return None
    if expected is not None:
        assert isinstance(value, getattr(expected, "__args__", (expected,))), value
    again = encode(value)
    assert encode(decoder.decode(again)) == again
    return value


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoders_accept_typed_values_or_raise_decode_error(name, examples):
    decoder, expected, tags, wellformed = DECODERS[name]
    valid = [encode(v) for v in VALID[name]]
    frames = st.binary(max_size=200) | TREE.map(encode) | wellformed.map(encode) | mutations(valid)
    if tags:
        frames |= tagged(tags)

    @fuzz(frames, examples)
    def one(frame: bytes) -> None:
        decoded_or_error(decoder, expected, frame)

    one()


def test_monitor_schema_decoder(examples):
    """engine/monitor_schema.py's `decode(topic, body)`: a message of its union whose kind
    the topic carries, or one of DECODE_ERRORS."""
    schema = pytest.importorskip("deltaserve.engine.monitor_schema")
    kinds = [t.__struct_config__.tag for t in schema.TOPICS]

    def body(t: tuple[str, dict]) -> bytes:
        kind, fields = t
        return encode({"kind": kind, "schema_version": 1, "seq": 0, "time_s": 0.0, **fields})

    fields = st.dictionaries(
        st.sampled_from(
            [
                "state",
                "running",
                "request_id",
                "reason",
                "client_id",
                "message",
                "schema_version",
                "x",
            ]
        ),
        TREE,
        max_size=4,
    )
    bodies = (
        st.tuples(st.sampled_from(kinds), fields).map(body)
        | TREE.map(encode)
        | st.binary(max_size=80)
    )
    topics = st.sampled_from([b"load", b"request", b"replica", b"", b"loadx"])

    @fuzz(st.tuples(topics, bodies), examples)
    def one(t: tuple[bytes, bytes]) -> None:
        topic, frame = t
        try:
            message = schema.decode(topic, frame)
        except DECODE_ERRORS:
            return
        assert schema.TOPICS[type(message)] == topic
        assert schema.decode(topic, schema.encoder.encode(message)) == message

    one()


def test_wellformed_messages_round_trip(examples):
    """Every well-formed command and reply survives encode -> strict decode unchanged."""

    @fuzz(st.tuples(COMMANDS, REPLIES, STARTUP, RANK_CONFIGS), examples)
    def one(values: tuple) -> None:
        command, reply, startup, rank_config = values
        for decoder, value in (
            (messages.command_decoder, command),
            (messages.reply_decoder, reply),
            (messages.startup_decoder, startup),
            (launch.rank_config_decoder, rank_config),
        ):
            assert encode(decoder.decode(encode(value))) == encode(value)

    one()


def test_plans_and_reply_sets_fail_only_with_their_errors(examples):
    """Any decoded command through the controller's plan check, and any decoded replies to
    it through ReplySet: the answers are a plan / result, PlanRejected or ReplyError only."""
    reply_frames = REPLIES.map(encode) | tagged(_tags(messages.Reply)) | st.binary(max_size=40)

    @fuzz(st.tuples(COMMANDS, st.lists(reply_frames, max_size=4)), examples)
    def one(values: tuple) -> None:
        command, frames = values
        plan = None
        try:
            if isinstance(command, RunUnifiedStep):
                plan = check_plan(command.items, VOCAB)
            elif isinstance(command, DropRequests):
                check_drop_plan(command.request_ids, command.expect)
        except PlanRejected as exc:
            assert str(exc)
            return
        replies = ReplySet(command, 2, plan)
        for frame in frames:
            reply = decoded_or_error(messages.reply_decoder, messages.Reply, frame)
            if reply is None or reply.seq != command.seq:
                continue  # the controller poisons on these before the set sees them
            try:
                if replies.add(reply):
                    replies.result()
                    return
            except ReplyError as exc:
                assert str(exc)
                return

    one()
