"""The replica controller with real rank processes, real ZeroMQ, shared memory and gloo, over
the tiny checkpoint: TP=2 agrees with TP=1, drops free everything, refused plans and configs
change nothing, ranks die with their parent."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
import zmq
from ipc_helpers import replica_config

from deltaserve.ipc.channels import PullChannel, PushChannel, ipc_endpoint
from deltaserve.ipc.controller import (
    PlanRejected,
    ReplicaController,
    ReplicaPoisoned,
    ReplicaStartupError,
)
from deltaserve.ipc.gate import Doorbell, StartGate
from deltaserve.ipc.launch import RankConfig, spawn_rank
from deltaserve.ipc.messages import (
    Ack,
    ExecutorConfig,
    Failure,
    NewRequest,
    Ping,
    Ready,
    Sample,
    SamplingSpec,
    SaveOnDrop,
    Shutdown,
    StepItem,
    command_encoder,
    reply_decoder,
    startup_decoder,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CALL_BOUND_S = 30.0  # no call in this file may take longer


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(1000 + 37 * i + 101 * salt) % 150000 for i in range(n)]


def first(
    rid: int, tokens: list[int], reserve: int, sample: bool = True, logprobs: int = 2
) -> StepItem:
    return StepItem(
        rid, 0, tokens, sample, NewRequest(reserve, SamplingSpec(seed=rid, num_logprobs=logprobs))
    )


def child_pids() -> set[int]:
    """Live (non-zombie) children of this process but multiprocessing's resource tracker,
    which the first SharedMemory of this process (a gate's) starts for the process's life:
    whether it is new depends on the tests that ran before."""
    found = set()
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                "resource_tracker" in arg for arg in child.cmdline()
            ):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a zombie has exited; only its
    parent's reaping is left)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(controller: ReplicaController) -> None:
    for pid in controller.rank_pids:
        assert not Path(f"/proc/{pid}").exists(), f"rank pid {pid} is still there"
    assert not Path(controller.run_dir).exists(), "run dir left behind"
    assert not Path(f"/dev/shm/{controller.gate_name}").exists(), "gate segment left behind"


async def bounded(awaitable: object, bound_s: float = CALL_BOUND_S) -> object:
    return await asyncio.wait_for(awaitable, bound_s)


async def run(controller: ReplicaController, items: list[StepItem]) -> dict[int, Sample]:
    """One step of `items`; rank 0's samples by request id. They come back in step order."""
    samples = await bounded(controller.run_step(items))
    assert samples.request_ids == [item.request_id for item in items if item.sample]
    return samples.by_id()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tp1(tiny_model_dir: Path):
    controller = await ReplicaController.start(replica_config(tiny_model_dir, tp_size=1))
    yield controller
    await controller.shutdown()
    assert controller.exit_codes == [0]
    assert_gone(controller)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tp2(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Overlapped steps (the CUDA default) on gloo; tp1 runs each step to its end."""
    journals = tmp_path_factory.mktemp("tp2_journal")
    config = replica_config(
        tiny_model_dir, tp_size=2, overlap_steps=True, journal_dir=str(journals)
    )
    controller = await ReplicaController.start(config)
    yield controller
    await controller.shutdown()
    assert controller.exit_codes == [0, 0]
    assert_gone(controller)


async def unified_run(controller: ReplicaController, base: int) -> list[tuple[int, int, float]]:
    """A: prefill, then decode while B prefills in two chunks in the same steps (mixed
    unified steps), then both decode. Returns (request, token, logprob) in order."""
    a, b = base + 1, base + 2
    pa, pb = prompt(70, salt=1), prompt(90, salt=2)
    out = []
    res = await run(controller, [first(a, pa, 100)])
    tok_a, pos_a = res[a].token_id, len(pa)
    out.append((a, tok_a, res[a].logprob))
    # step 2: decode A + B's first chunk (no sample); step 3: decode A + B's last chunk
    res = await run(
        controller, [StepItem(a, pos_a, [tok_a], True), first(b, pb[:50], 120, sample=False)]
    )
    assert set(res) == {a}
    tok_a, pos_a = res[a].token_id, pos_a + 1
    out.append((a, tok_a, res[a].logprob))
    res = await run(controller, [StepItem(b, 50, pb[50:], True), StepItem(a, pos_a, [tok_a], True)])
    tok_a, tok_b, pos_a, pos_b = res[a].token_id, res[b].token_id, pos_a + 1, len(pb)
    out += [(a, tok_a, res[a].logprob), (b, tok_b, res[b].logprob)]
    for _ in range(4):
        res = await run(
            controller, [StepItem(a, pos_a, [tok_a], True), StepItem(b, pos_b, [tok_b], True)]
        )
        tok_a, tok_b, pos_a, pos_b = res[a].token_id, res[b].token_id, pos_a + 1, pos_b + 1
        out += [(a, tok_a, res[a].logprob), (b, tok_b, res[b].logprob)]
    await bounded(controller.drop([a, b], "must_exist"))
    return out


async def test_unified_steps_tp2_match_tp1(tp1: ReplicaController, tp2: ReplicaController) -> None:
    """Prefill and decode advanced together in one step give the same greedy tokens (and
    logprobs to fp32 noise) whether the model is split over two ranks or not."""
    one = await unified_run(tp1, base=100)
    two = await unified_run(tp2, base=100)
    assert [(r, t) for r, t, _ in one] == [(r, t) for r, t, _ in two]
    assert max(abs(x[2] - y[2]) for x, y in zip(one, two, strict=True)) < 1e-3


async def seeded_run(controller: ReplicaController, base: int) -> list[tuple[int, int]]:
    """Three requests sampled at random from fixed seeds (temperature; top-k with top-p;
    min-p), prefilled together then decoded 8 steps. Returns (request, token) in order."""
    specs = [
        SamplingSpec(seed=11, temperature=1.0),
        SamplingSpec(seed=12, temperature=0.8, top_k=20, top_p=0.9),
        SamplingSpec(seed=13, temperature=1.2, min_p=0.05),
    ]
    prompts = [prompt(20 + 9 * i, salt=5 + i) for i in range(len(specs))]
    ids = [base + i for i in range(len(specs))]
    res = await run(
        controller,
        [
            StepItem(rid, 0, p, True, NewRequest(len(p) + 10, spec))
            for rid, p, spec in zip(ids, prompts, specs, strict=True)
        ],
    )
    out = [(rid, res[rid].token_id) for rid in ids]
    for step in range(8):
        items = [
            StepItem(rid, len(p) + step, [res[rid].token_id], True)
            for rid, p in zip(ids, prompts, strict=True)
        ]
        res = await run(controller, items)
        out += [(rid, res[rid].token_id) for rid in ids]
    await bounded(controller.drop(ids, "must_exist"))
    return out


async def test_seeded_sampling_tp2_matches_tp1(
    tp1: ReplicaController, tp2: ReplicaController
) -> None:
    """Seeded random sampling (temperature, top-k, top-p, min-p) gives the same tokens at
    TP=2 as at TP=1: rank 0 samples from the whole vocabulary's logits either way."""
    one = await seeded_run(tp1, base=200)
    two = await seeded_run(tp2, base=200)
    assert one == two
    assert len({token for _, token in one}) > 9  # sampled, not one token again and again


async def test_pipelined_steps_tp2(tp2: ReplicaController) -> None:
    """A step sent behind a released step (`follow_step`) decodes from the ranks' own last
    samples (rank 0's, broadcast to rank 1) and gives the tokens that explicit token ids give;
    it drops what it carries before it runs. Only one step may follow, and only a released one."""
    spec = SamplingSpec(seed=5, temperature=0.8, num_logprobs=2)
    pa, pb = prompt(30, salt=3), prompt(45, salt=4)

    def new(tokens: list[int]) -> NewRequest:
        return NewRequest(len(tokens) + 12, spec)

    # reference: request 301 and 302, explicit token ids, one step at a time
    res = await run(tp2, [StepItem(301, 0, pa, True, new(pa)), StepItem(302, 0, pb, True, new(pb))])
    explicit = [(res[301].token_id, res[302].token_id)]
    for step in range(5):
        res = await run(
            tp2,
            [
                StepItem(301, len(pa) + step, [explicit[-1][0]], True),
                StepItem(302, len(pb) + step, [explicit[-1][1]], True),
            ],
        )
        explicit.append((res[301].token_id, res[302].token_id))
    await bounded(tp2.drop([301, 302], "must_exist"))

    # the same requests (same seeds) pipelined: each step follows the one before unseen
    flight = await tp2.send_step(
        [StepItem(311, 0, pa, True, new(pa)), StepItem(312, 0, pb, True, new(pb))]
    )
    assert tp2.follow_step([StepItem(311, len(pa), [], True)]) is None  # not yet released
    assert await bounded(flight.gate) is True
    flights = [flight]
    for step in range(5):
        follower = tp2.follow_step(
            [StepItem(311, len(pa) + step, [], True), StepItem(312, len(pb) + step, [], True)]
        )
        assert follower is not None
        # two in flight
        assert tp2.follow_step([StepItem(311, len(pa) + step + 1, [], True)]) is None
        flights.append(follower)
        await bounded(tp2.step_result(flights[-2]))
        assert await bounded(follower.gate) is True
    pipelined = []
    for flight in flights:
        samples = (await bounded(tp2.step_result(flight))).by_id()
        pipelined.append((samples[311].token_id, samples[312].token_id))
    assert pipelined == explicit
    # the ranks overlapped: a follower ran before the reply to the step ahead of it went out
    # (on the CPU only when the follower came while the step ahead ran: timing, so any of them)
    overlapped = []
    for rank in (0, 1):
        lines = [
            line.split()[:2]
            for line in (Path(tp2.config.journal_dir) / f"rank{rank}.log").read_text().splitlines()
        ]
        order = {(event, int(seq)): i for i, (event, seq) in enumerate(lines)}
        overlapped += [
            (rank, f.seq)
            for f in flights[1:]
            if order[("exec", f.seq)] < order[("reply", f.seq - 1)]
        ]
    assert overlapped, "no rank ran a follower before replying to the step ahead"

    # a followed step's drops: 312 goes while 311 decodes once more
    flight = await tp2.send_step([StepItem(311, len(pa) + 5, [], True)])
    assert await bounded(flight.gate)
    follower = tp2.follow_step([StepItem(311, len(pa) + 6, [], True)], drops=[312])
    await bounded(tp2.step_result(flight))
    assert await bounded(follower.gate)
    # another command waiting for its turn: no step may follow (a chain cannot starve it)
    snapshot = asyncio.ensure_future(tp2.snapshot())
    await asyncio.sleep(0)
    assert tp2.follow_step([StepItem(311, len(pa) + 7, [], True)]) is None
    await bounded(tp2.step_result(follower))
    for snap in await bounded(snapshot):
        assert snap.request_ids == [311]
    await bounded(tp2.drop([311], "must_exist"))
    assert tp2.follow_step([StepItem(311, 0, [1], True, new([1]))]) is None  # nothing in flight
    assert tp2.poison_reason is None


async def test_snapshot_reports_each_rank_shard(
    tp2: ReplicaController, tiny_model_dir: Path
) -> None:
    """Each rank reports its own share of the heads and the same requests."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    await run(tp2, [first(7, prompt(20), 40)])
    snaps = await bounded(tp2.snapshot())
    assert [s.rank for s in snaps] == [0, 1]
    for snap in snaps:
        assert snap.request_ids == [7] and snap.slots_used == 1 and snap.blocks_used > 0
        assert snap.state_heads == config["linear_num_value_heads"] // 2
        assert snap.kv_heads == config["num_key_value_heads"] // 2
    await bounded(tp2.drop([7], "must_exist"))


@pytest.mark.parametrize("tp", [1, 2])
async def test_drop_refill_readmit_and_full_capacity(
    tp: int, tp1: ReplicaController, tp2: ReplicaController
) -> None:
    """Fill every slot, drop them all: snapshots show nothing held and full capacity, a
    dropped request is absent, and re-admitting a prompt gives the clean first token."""
    controller = tp1 if tp == 1 else tp2
    probe = prompt(40, salt=9)
    clean = (await run(controller, [first(200, probe, 60)]))[200]
    await bounded(controller.drop([200], "must_exist"))
    await bounded(controller.drop([200], "must_be_absent"))

    fill = [first(300 + i, prompt(30 + i, salt=i), 64) for i in range(controller.num_slots)]
    res = await run(controller, fill)
    assert sorted(res) == [300 + i for i in range(controller.num_slots)]
    snaps = await bounded(controller.snapshot())
    assert all(s.slots_used == controller.num_slots for s in snaps)
    decodes = [
        StepItem(rid, len(item.token_ids), [res[rid].token_id], True)
        for rid, item in zip(sorted(res), fill, strict=True)
    ]
    await run(controller, decodes)
    await bounded(controller.drop(sorted(res), "must_exist"))
    for snap in await bounded(controller.snapshot()):
        assert (snap.request_ids, snap.slots_used, snap.blocks_used) == ([], 0, 0)
        assert (snap.num_slots, snap.num_blocks) == (controller.num_slots, controller.num_blocks)

    # readmission, whole and in two chunks, on slots and blocks that others just used
    again = (await run(controller, [first(400, probe, 60)]))[400]
    assert (again.token_id, again.top_logprobs[0][0]) == (clean.token_id, clean.top_logprobs[0][0])
    assert abs(again.logprob - clean.logprob) < 1e-4
    await run(controller, [first(401, probe[:25], 60, sample=False)])
    chunked = (await run(controller, [StepItem(401, 25, probe[25:], True)]))[401]
    assert chunked.token_id == clean.token_id
    await bounded(controller.drop([400, 401], "must_exist"))
    # a full-capacity request fits again
    big = controller.num_blocks * controller.block_size
    await run(controller, [first(402, probe, big)])
    await bounded(controller.drop([402], "must_exist"))
    assert controller.poison_reason is None


async def test_rejected_plans_leave_the_replica_healthy(tp2: ReplicaController) -> None:
    """Plans provably wrong before dispatch raise PlanRejected; nothing reaches a rank."""
    seq_before = tp2.last_seq
    bad_steps = [
        [],
        [first(1, [5], 8), first(1, [6], 8)],
        [StepItem(1, 0, [], True, NewRequest(8, SamplingSpec(seed=0)))],
        [StepItem(1, -3, [5], True)],
        [StepItem(1, 4, [5], True, NewRequest(8, SamplingSpec(seed=0)))],
        [StepItem(1, 0, [5], True)],
        [StepItem(1, 3, [tp2.model_config.vocab_size], True)],
    ]
    for items in bad_steps:
        with pytest.raises(PlanRejected):
            await tp2.run_step(items)
    with pytest.raises(PlanRejected, match="appears twice"):
        await tp2.drop([3, 3], "must_exist")
    assert tp2.last_seq == seq_before
    await bounded(tp2.ping())
    assert tp2.poison_reason is None


async def test_rank_local_mismatch_poisons(tiny_model_dir: Path) -> None:
    """A drop that no rank can honour (the scheduler and the ranks disagree) is fatal: the
    replica is poisoned, torn down, and every later call fails at once with the reason."""
    reasons: list[str] = []
    controller = await ReplicaController.start(
        replica_config(tiny_model_dir), on_poison=reasons.append
    )
    try:
        with pytest.raises(
            ReplicaPoisoned, match="request 999 dropped with expect=must_exist, but no rank held it"
        ):
            await bounded(controller.drop([999], "must_exist"))
        await asyncio.sleep(0)
        assert reasons == [controller.poison_reason]
        t0 = time.monotonic()
        with pytest.raises(ReplicaPoisoned, match="request 999"):
            await controller.ping()
        assert time.monotonic() - t0 < 0.05
    finally:
        await controller.shutdown()
    assert_gone(controller)


async def test_last_sample_without_a_sample_poisons(tiny_model_dir: Path) -> None:
    """An item without token_ids whose request's previous item sampled nothing has no input:
    every rank refuses it alike (none waits in the broadcast), and the replica is poisoned."""
    controller = await ReplicaController.start(replica_config(tiny_model_dir, tp_size=2))
    try:
        await run(controller, [first(1, prompt(20), 40, sample=False)])
        with pytest.raises(
            ReplicaPoisoned,
            match="request 1 item has no token_ids, but its previous item did not sample",
        ):
            await bounded(controller.run_step([StepItem(1, 20, [], True)]))
    finally:
        await controller.shutdown()
    assert_gone(controller)


async def test_a_save_at_another_count_poisons(tiny_model_dir: Path) -> None:
    """A state kept as it is dropped must cover the positions the scheduler counts: a rank
    that holds another count refuses the save (a prefix of other positions would be reused
    silently wrong), on every rank alike."""
    controller = await ReplicaController.start(
        replica_config(tiny_model_dir, tp_size=2, prefix_cache_states=2)
    )
    try:
        await run(controller, [first(1, prompt(20), 40)])
        with pytest.raises(PlanRejected, match="not a drop that must exist"):
            await controller.drop([1], "must_be_absent", saves=[SaveOnDrop(1, 0, 20)])
        with pytest.raises(
            ReplicaPoisoned, match="request 1 is saved at 21 positions; rank . holds 20"
        ):
            await bounded(controller.drop([1], "must_exist", saves=[SaveOnDrop(1, 0, 21)]))
    finally:
        await controller.shutdown()
    assert_gone(controller)


class TestPreload:
    """Configs that cannot work are refused with a ValueError before any rank starts."""

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"tp_size": 3}, "tensor-parallel size 3 does not divide"),
            (
                {"device": "cuda", "device_ids": (7,)},
                "CUDA device 7 does not exist: this machine has",
            ),
        ],
    )
    async def test_refused_before_spawn(
        self, tiny_model_dir: Path, kwargs: dict, message: str
    ) -> None:
        before = child_pids()
        with pytest.raises(ValueError, match=message):
            await ReplicaController.start(replica_config(tiny_model_dir, **kwargs))
        assert child_pids() == before


async def test_startup_failure_is_reported_and_cleaned_up(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A rank that cannot load its weights reports StartupFailed; start() raises with the
    rank's reason and leaves no process behind."""
    broken = tmp_path / "no-weights"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    before = child_pids()
    with pytest.raises(ReplicaStartupError, match="rank 0 failed to start: .*safetensors"):
        await bounded(ReplicaController.start(replica_config(broken)))
    assert child_pids() == before


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING])
async def test_ranks_log_at_the_servers_level(
    tmp_path: Path, tiny_model_dir: Path, capfd, level
) -> None:
    """`serve --log-level WARNING` quietened the server only: its ranks logged their start-up
    at INFO whatever it was. They now take the level of the parent's deltaserve logger."""
    broken = tmp_path / "no-weights"  # fails right after the rank's first lines: no load
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    logger = logging.getLogger("deltaserve")
    old, logger.level = logger.level, level
    try:
        with pytest.raises(ReplicaStartupError):
            await bounded(ReplicaController.start(replica_config(broken)))
    finally:
        logger.setLevel(old)
    assert ("rank 0: process up" in capfd.readouterr().err) == (level == logging.INFO)


async def test_startup_timeout(tiny_model_dir: Path) -> None:
    before = child_pids()
    t0 = time.monotonic()
    with pytest.raises(ReplicaStartupError, match="not ready within startup_timeout_s=0.3"):
        await ReplicaController.start(replica_config(tiny_model_dir, startup_timeout_s=0.3))
    assert time.monotonic() - t0 < 0.3 + 5.0
    assert child_pids() == before


PARENT = textwrap.dedent("""
    import asyncio, sys
    from deltaserve.ipc.controller import ReplicaConfig, ReplicaController
    from deltaserve.ipc.messages import ExecutorConfig
    from deltaserve.ipc.messages import ExecutorConfig

    async def main():
        config = ReplicaConfig(ExecutorConfig(sys.argv[1], tp_size=2, num_kv_blocks=64))
        controller = await ReplicaController.start(config)
        print(controller.run_dir, *controller.rank_pids, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_ranks_die_with_their_parent(tiny_model_dir: Path) -> None:
    """SIGKILL the controller's process: its ranks go too (PR_SET_PDEATHSIG)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True
    )
    line = ""
    try:
        line = await asyncio.wait_for(asyncio.to_thread(parent.stdout.readline), 60)
        run_dir, *pids = line.split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and all(running(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # orphans are reaped by init; a pid left would be a rank still running
        assert not [p for p in pids if running(p)]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if line:  # a killed controller cannot remove its run dir (its segment goes with its
            shutil.rmtree(line.split()[0], ignore_errors=True)  # resource tracker)


async def test_rank_answers_malformed_commands_and_keeps_serving() -> None:
    """Rank side of strict decoding, driven by hand over its real sockets: a frame that is
    not a Command and a command out of sequence each get a Failure reply; the rank keeps
    serving and exits 0 on Shutdown. No command here reaches the executor, so the rank runs
    the no-op one and skips loading torch."""
    run_dir = tempfile.mkdtemp(prefix="deltaserve-test-")
    ctx = zmq.Context()
    commands = PushChannel(ctx, ipc_endpoint(run_dir, "cmd0"), bind=True)
    replies = PullChannel(ctx, ipc_endpoint(run_dir, "reply"), bind=True)
    gate, receipt, release = StartGate.create(1), Doorbell(), Doorbell()
    proc = spawn_rank(
        RankConfig(
            executor=ExecutorConfig(run_dir, max_num_seqs=2, num_kv_blocks=16),
            parent_pid=os.getpid(),
            command_endpoint=commands.endpoint,
            reply_endpoint=replies.endpoint,
            gate_name=gate.name,
            receipt_fd=receipt.fd,
            release_fd=release.fd,
            release_timeout_s=5.0,
            dist_init_method=f"file://{run_dir}/dist",
            dist_timeout_s=30.0,
            noop_executor=True,
        )
    )

    def reply(decoder: object = reply_decoder) -> object:
        frame = replies.recv(30_000)
        assert frame is not None, "rank sent nothing within 30 s"
        return decoder.decode(frame)

    def send(frame: bytes) -> None:
        deadline = time.monotonic() + 10
        while not commands.send(frame):  # the rank connects after it starts
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        assert isinstance(await asyncio.to_thread(reply, startup_decoder), Ready)
        send(b"\xc1 not a command")
        failure = await asyncio.to_thread(reply)
        assert isinstance(failure, Failure) and failure.seq == 1
        assert "malformed command frame" in failure.reason
        send(command_encoder.encode(Ping(2)))
        assert await asyncio.to_thread(reply) == Ack(0, 2)
        send(command_encoder.encode(Ping(9)))
        failure = await asyncio.to_thread(reply)
        assert (
            isinstance(failure, Failure)
            and "Ping seq 9 out of order; expected seq 3" in failure.reason
        )
        send(command_encoder.encode(Shutdown(4)))
        assert await asyncio.to_thread(reply) == Ack(0, 4)
        assert await asyncio.to_thread(proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        commands.close()
        replies.close()
        ctx.term()
        gate.close(unlink=True)
        receipt.close()
        release.close()
        shutil.rmtree(run_dir, ignore_errors=True)


# A library user's program that never shuts its replica down. The owner's poison callback
# refers back to the owner, as the engine's does: owner and controller form a garbage cycle.
UNCLEAN = textwrap.dedent("""
    import asyncio, gc, json, os, signal, sys
    from deltaserve.ipc.controller import ReplicaConfig, ReplicaController
    from deltaserve.ipc.messages import ExecutorConfig

    class Owner:
        def on_poison(self, reason):
            pass

    mode, model_dir = sys.argv[1], sys.argv[2]
    owner, loop = Owner(), asyncio.new_event_loop()
    owner.controller = c = loop.run_until_complete(ReplicaController.start(
        ReplicaConfig(ExecutorConfig(model_dir, tp_size=2, num_kv_blocks=64), noop_executor=True),
        on_poison=owner.on_poison))
    print(json.dumps([c.run_dir, c.gate_name, c.rank_pids]), flush=True)
    if mode == "tearing_down":  # a rank that does not ack: the shutdown is still running at exit
        os.kill(c.rank_pids[0], signal.SIGSTOP)
        task = loop.create_task(c.shutdown())
        loop.run_until_complete(asyncio.sleep(0.2))
    del c
    if mode == "dropped":  # the loop closed, the owner dropped: the collector meets the cycle
        loop.close()
        del owner
        gc.collect()
        print("collected", flush=True)
""")


def run_unclean(mode: str, model_dir: Path) -> tuple[list, str, str]:
    """Run UNCLEAN in a child (it may hang: bounded); its (run dir, gate, rank pids), stdout
    after that line, and stderr."""
    child = subprocess.Popen(
        [sys.executable, "-c", UNCLEAN, mode, str(model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        err += "\n(timed out: killed)"
    first_line, _, rest = out.partition("\n")
    held = json.loads(first_line) if first_line else ["", "", []]
    if held[0]:  # a killed child cannot remove it; don't leave it behind for other tests
        remaining = Path(held[0]).exists()
        shutil.rmtree(held[0], ignore_errors=True)
        held.append(remaining)
    return held, rest, err


@pytest.mark.parametrize("mode", ["dropped", "exits", "tearing_down"])
async def test_a_replica_never_shut_down_is_freed_quietly(mode: str, tiny_model_dir: Path) -> None:
    """Dropped under a closed hand-made loop (a garbage cycle: pyzmq's Context.__del__ used to
    wait forever there on sockets of the same cycle), or still held, or mid-shutdown, when the
    program exits: no hang, no BufferError or resource-tracker warning, nothing left."""
    (run_dir, gate_name, pids, dir_left), out, err = await asyncio.to_thread(
        run_unclean, mode, tiny_model_dir
    )
    assert "timed out" not in err, err
    if mode == "dropped":
        assert out == "collected\n", (out, err)
    for noise in (
        "Traceback",
        "BufferError",
        "leaked shared_memory",
        "resource_tracker",
        "Exception ignored",
    ):
        assert noise not in err, err
    assert not dir_left, "run dir left behind"
    assert not Path(f"/dev/shm/{gate_name}").exists(), "gate segment left behind"
    assert not [p for p in pids if running(p)]
