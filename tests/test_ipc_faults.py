"""The fault matrix at TP=2 (so that a rank survives each fault): every fault poisons the
replica with the right reason, within its bound, exactly once; no rank runs a command the
gate did not release to all; no process, socket folder or shared-memory segment is left.

Ranks keep an append-only journal of gated commands (recv / exec / reply / cancel / die lines) in
the test's folder: that is how a test sees that a surviving rank never ran the step."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest
from ipc_helpers import replica_config

from deltaserve.ipc.controller import ReplicaController, ReplicaPoisoned
from deltaserve.ipc.faults import FAULT_EXIT_CODE, FaultPlan
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

pytestmark = pytest.mark.asyncio

STEP_TIMEOUT_S = 2.0
GATE_TIMEOUT_S = 1.0
FAULT_STEP = 2  # the fault strikes the second RunUnifiedStep...
FAULT_SEQ = 3  # ...which is command seq 3 (seq 1 is the start-up Ping)
DIED = rf"rank 1 \(pid \d+\) exited with code {FAULT_EXIT_CODE}"

# kind -> (reason the replica must be poisoned with, bound on detecting it in seconds)
MATRIX = {
    "die_before_receipt": (DIED, 2.0),
    "stall_before_receipt": (
        rf"rank\(s\) \[1\] did not receive RunUnifiedStep seq {FAULT_SEQ} within gate_timeout_s",
        GATE_TIMEOUT_S + 2.0,
    ),
    "die_after_release": (DIED, 2.0),
    "die_mid_step": (DIED, 2.0),
    "stall": (
        rf"no reply from rank\(s\) \[0, 1\] to RunUnifiedStep seq {FAULT_SEQ} "
        r"within step_timeout_s",
        STEP_TIMEOUT_S + 2.0,
    ),
    "malformed_reply": (r"malformed reply frame", 2.0),
    "duplicate_reply": (rf"rank 1 sent a second reply to RunUnifiedStep seq {FAULT_SEQ}", 2.0),
    "wrong_rank": (rf"Ack for RunUnifiedStep seq {FAULT_SEQ} claims rank 3, outside 0..1", 2.0),
    "wrong_variant": (
        rf"rank 1 replied DropAck to RunUnifiedStep seq {FAULT_SEQ}; expected Ack",
        2.0,
    ),
    # rank 1 forgets request 1 after step 2: its next step with request 1 fails on rank 1...
    "diverge": (
        rf"rank 1 failed RunUnifiedStep seq {FAULT_SEQ + 1}: "
        r"StepError: request 1 is not held by rank 1",
        2.0,
    ),
    # ...and a drop of request 1 gets a mixed answer
    "diverge_then_drop": (
        r"ranks disagree on request 1: rank\(s\) \[0\] held it, rank\(s\) \[1\] did not",
        2.0,
    ),
    "close_reply_socket": (
        rf"no reply from rank\(s\) \[1\] to RunUnifiedStep seq {FAULT_SEQ} within step_timeout_s",
        STEP_TIMEOUT_S + 2.0,
    ),
}


def journal(folder: Path, rank: int) -> list[tuple[str, int]]:
    path = folder / f"rank{rank}.log"
    if not path.exists():
        return []
    return [
        (event, int(seq))
        for event, seq, _ in (line.split() for line in path.read_text().splitlines())
    ]


def first(rid: int, n: int) -> StepItem:
    tokens = [(500 + 31 * i + rid) % 100000 for i in range(n)]
    return StepItem(rid, 0, tokens, True, NewRequest(n + 32, SamplingSpec(seed=rid)))


async def start(
    model_dir: Path,
    journal_dir: Path,
    fault: FaultPlan | None,
    reasons: list[str],
    overlap: bool = False,
) -> ReplicaController:
    config = replica_config(
        model_dir,
        tp_size=2,
        step_timeout_s=STEP_TIMEOUT_S,
        gate_timeout_s=GATE_TIMEOUT_S,
        fault=fault,
        journal_dir=str(journal_dir),
        overlap_steps=overlap,
    )
    return await asyncio.wait_for(ReplicaController.start(config, on_poison=reasons.append), 120)


async def wait_poisoned(controller: ReplicaController, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while controller.poison_reason is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def assert_torn_down(controller: ReplicaController, reasons: list[str], reason: str) -> None:
    """Poisoned once with `reason`; later calls fail at once; nothing left behind."""
    assert re.search(reason, controller.poison_reason), controller.poison_reason
    t0 = time.monotonic()
    with pytest.raises(ReplicaPoisoned) as info:
        await controller.ping()
    assert time.monotonic() - t0 < 0.1
    assert info.value.reason == controller.poison_reason
    await asyncio.wait_for(controller.shutdown(), 10)
    await asyncio.sleep(0)
    assert reasons == [controller.poison_reason]
    for pid in controller.rank_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not Path(controller.run_dir).exists()
    assert not Path(f"/dev/shm/{controller.gate_name}").exists()


@pytest.mark.parametrize("case", list(MATRIX))
async def test_fault(case: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    reason, bound_s = MATRIX[case]
    kind = "diverge" if case.startswith("diverge") else case
    reasons: list[str] = []
    fault = FaultPlan(rank=1, kind=kind, at_step=FAULT_STEP, stall_s=60.0)
    controller = await start(tiny_model_dir, tmp_path, fault, reasons)
    try:
        step1 = await asyncio.wait_for(controller.run_step([first(1, 24)]), 30)
        decode = StepItem(1, 24, [step1.by_id()[1].token_id], True)
        t0 = time.monotonic()
        flight = None
        try:
            # step 2: request 1 decodes while request 2 prefills
            flight = await controller.send_step([decode, first(2, 40)])
            step2 = await asyncio.wait_for(controller.step_result(flight), bound_s + 5)
            if case == "diverge":  # the ranks now disagree on request 1
                decode = StepItem(1, 25, [step2.by_id()[1].token_id], True)
                await asyncio.wait_for(controller.run_step([decode]), bound_s + 5)
            if case == "diverge_then_drop":
                await asyncio.wait_for(controller.drop([1], "must_exist"), bound_s + 5)
        except ReplicaPoisoned as exc:
            assert exc.reason == controller.poison_reason
        else:  # a duplicate can only be seen once it arrives, after a complete reply set
            assert kind == "duplicate_reply", f"{kind}: the faulty step succeeded"
            await wait_poisoned(controller, bound_s)
        elapsed = time.monotonic() - t0
        assert controller.poison_reason is not None, f"{kind}: never poisoned"
        assert elapsed < bound_s, f"{kind}: poisoned after {elapsed:.2f} s, bound {bound_s} s"
        last_seq = controller.last_seq
        await assert_torn_down(controller, reasons, reason)
    finally:
        await controller.shutdown()

    ranks = [journal(tmp_path, 0), journal(tmp_path, 1)]
    # no rank ran anything after the command that went wrong
    assert all(seq <= last_seq for entries in ranks for _, seq in entries)
    # the step's gate outcome: released, unless the gate cancelled it
    assert flight.gate.result() is (kind not in ("die_before_receipt", "stall_before_receipt"))
    if kind in ("die_before_receipt", "stall_before_receipt"):
        # the survivor got the step and was told to cancel it: it never ran it
        assert ("recv", FAULT_SEQ) in ranks[0] and ("cancel", FAULT_SEQ) in ranks[0]
        assert ("exec", FAULT_SEQ) not in ranks[0]
        assert ("exec", FAULT_SEQ) not in ranks[1]
    if kind == "die_before_receipt":
        assert ranks[1][-1] == ("die", FAULT_SEQ)
    if kind == "die_after_release":
        assert ("exec", FAULT_SEQ) in ranks[0] and ("exec", FAULT_SEQ) not in ranks[1]
    assert controller.exit_codes[1] in (FAULT_EXIT_CODE, -signal.SIGKILL)


async def test_idle_rank_death_noticed_from_sentinel(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A rank killed while nothing is in flight poisons the replica within a second."""
    reasons: list[str] = []
    controller = await start(tiny_model_dir, tmp_path, None, reasons)
    try:
        await asyncio.wait_for(controller.run_step([first(1, 8)]), 30)
        os.kill(controller.rank_pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        while not reasons and time.monotonic() - t0 < 1.0:
            await asyncio.sleep(0.005)
        assert reasons, "rank death not noticed within 1 s"
        await assert_torn_down(controller, reasons, r"rank 0 \(pid \d+\) was killed by SIGKILL")
    finally:
        await controller.shutdown()


async def step_with_a_follower(controller: ReplicaController) -> tuple:
    """After a first step: a decode step released (seq 3) and one sent behind it, waiting
    for the gate (seq 4): the two flights of a pipelined replica."""
    step1 = await asyncio.wait_for(controller.run_step([first(1, 24)]), 30)
    ahead = await controller.send_step([StepItem(1, 24, [step1.by_id()[1].token_id], True)])
    assert await asyncio.wait_for(ahead.gate, 10) is True
    behind = controller.follow_step([StepItem(1, 25, [], True)])
    assert behind is not None
    return ahead, behind


@pytest.mark.parametrize(
    ("kind", "at_step", "reason"),
    [
        # the step behind: its gate timer runs from the end of the step ahead
        (
            "stall_before_receipt",
            3,
            r"rank\(s\) \[1\] did not receive RunUnifiedStep seq 4 within gate_timeout_s",
        ),
        # the step ahead: the one behind it, sent but not released, is cancelled with it
        ("die_mid_step", 2, DIED),
    ],
)
@pytest.mark.parametrize("overlap", [False, True], ids=["finished_first", "overlapped"])
async def test_fault_with_a_step_following(
    kind: str, at_step: int, reason: str, overlap: bool, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two flights (a pipelined step behind a released one): a fault in either poisons the
    replica once, every flight it reaches fails with that reason, and the step behind runs on
    no rank. Overlapped, the healthy rank 0 holds the step ahead pending while it waits for
    the gate's word on the step behind, which is a cancel: it still replies to the one ahead."""
    reasons: list[str] = []
    fault = FaultPlan(rank=1, kind=kind, at_step=at_step, stall_s=60.0)
    controller = await start(tiny_model_dir, tmp_path, fault, reasons, overlap)
    try:
        ahead, behind = await step_with_a_follower(controller)
        t0 = time.monotonic()
        outcomes = []
        for flight in (ahead, behind):
            try:
                await asyncio.wait_for(controller.step_result(flight), STEP_TIMEOUT_S + 5)
                outcomes.append("ok")
            except ReplicaPoisoned as exc:
                assert exc.reason == controller.poison_reason
                outcomes.append("poisoned")
        assert outcomes == (
            ["ok", "poisoned"] if kind == "stall_before_receipt" else ["poisoned", "poisoned"]
        )
        assert time.monotonic() - t0 < GATE_TIMEOUT_S + 2.0
        assert behind.gate.result() is False
        await assert_torn_down(controller, reasons, reason)
    finally:
        await controller.shutdown()
    ranks = [journal(tmp_path, 0), journal(tmp_path, 1)]
    assert all(("exec", 4) not in entries for entries in ranks), ranks
    if kind == "stall_before_receipt":  # rank 0 had the step behind and was told to cancel it
        assert ("recv", 4) in ranks[0] and ("cancel", 4) in ranks[0]


async def test_overlapped_follower_refused_by_the_ranks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Overlapped, a follower that every rank refuses (its item starts past the positions the
    ranks hold) fails only after the step ahead: each rank replies to that step before it
    reports the follower's failure, so its samples arrive; then the replica is poisoned once
    with the ranks' reason, and nothing is left behind."""
    reasons: list[str] = []
    controller = await start(tiny_model_dir, tmp_path, None, reasons, overlap=True)
    try:
        step1 = await asyncio.wait_for(controller.run_step([first(1, 24)]), 30)
        # seq 3
        ahead = await controller.send_step([StepItem(1, 24, [step1.by_id()[1].token_id], True)])
        assert await asyncio.wait_for(ahead.gate, 10) is True
        behind = controller.follow_step([StepItem(1, 30, [], True)])  # seq 4: the ranks hold 25
        assert behind is not None
        result = await asyncio.wait_for(controller.step_result(ahead), 30)
        assert list(result.by_id()) == [1]
        with pytest.raises(ReplicaPoisoned):
            await asyncio.wait_for(controller.step_result(behind), 30)
        await assert_torn_down(
            controller,
            reasons,
            r"rank \d failed RunUnifiedStep seq 4: StepError: request 1 "
            r"item starts at 30, rank \d holds 25 positions",
        )
    finally:
        await controller.shutdown()
    for rank in (0, 1):  # the reply to the step ahead went out before the follower's
        entries = journal(tmp_path, rank)
        assert entries.index(("reply", 3)) < entries.index(("reply", 4)), entries


async def test_sampled_token_outside_the_vocabulary_poisons(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rank 0's samples are checked against the vocabulary like the plan's tokens: a step
    result with a token id no model has poisons the replica naming it, rather than reaching
    a client (and, pipelined, the ranks' next step) as a token."""
    reasons: list[str] = []
    fault = FaultPlan(rank=0, kind="bad_token", at_step=FAULT_STEP)
    config = replica_config(tiny_model_dir, tp_size=1, step_timeout_s=STEP_TIMEOUT_S, fault=fault)
    controller = await asyncio.wait_for(
        ReplicaController.start(config, on_poison=reasons.append), 120
    )
    try:
        step1 = await asyncio.wait_for(controller.run_step([first(1, 24)]), 30)
        decode = StepItem(1, 24, [step1.by_id()[1].token_id], True)
        with pytest.raises(ReplicaPoisoned):
            await asyncio.wait_for(controller.run_step([decode]), 10)
        await assert_torn_down(
            controller, reasons, r"rank 0 sampled token -1 for request 1, outside the vocabulary"
        )
    finally:
        await controller.shutdown()


@pytest.mark.parametrize(
    ("kind", "overlap"),
    [("failure_reply", False), ("failure_reply", True), ("late_failure", False)],
    ids=["finished_first", "overlapped", "receipt_before_the_failure_frame"],
)
async def test_no_release_after_a_reported_failure(
    kind: str, overlap: bool, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A rank reports a Failure for the step ahead after running it (rank 1; rank 0 ends it
    well), while a pipelined step waits behind it. The controller holds the Failure back a
    moment (a peer's death, if there is one, names the poison), and the follower's receipts
    come in meanwhile (failure_reply), or even before the Failure frame does (late_failure):
    still the gate must not release it, as the ranks would run a step on state a peer has
    declared broken (and its result would be handed out). It is cancelled when the poison lands."""
    reasons: list[str] = []
    # failure_reply: its next receipt comes 0.15 s after the Failure, within the 0.25 s hold
    fault = FaultPlan(rank=1, kind=kind, at_step=FAULT_STEP, stall_s=0.15)
    controller = await start(tiny_model_dir, tmp_path, fault, reasons, overlap)
    try:
        ahead, behind = await step_with_a_follower(controller)
        for flight in (ahead, behind):
            with pytest.raises(ReplicaPoisoned):
                await asyncio.wait_for(controller.step_result(flight), STEP_TIMEOUT_S + 5)
        assert behind.gate.result() is False
        await assert_torn_down(
            controller, reasons, rf"rank 1 failed RunUnifiedStep seq {FAULT_SEQ}: injected failure"
        )
    finally:
        await controller.shutdown()
    ranks = [journal(tmp_path, 0), journal(tmp_path, 1)]
    assert all(("exec", 4) not in entries for entries in ranks), ranks
    assert all(("recv", 4) in entries and ("cancel", 4) in entries for entries in ranks), ranks
