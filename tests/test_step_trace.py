"""The step trace (ipc/step_trace.py) through the engine as bench_engine_overhead runs it: real
rank processes with the no-op executor. Every step must carry every process's marks, in the
order a step can only happen in, and the hop table must cover each step."""

from __future__ import annotations

from pathlib import Path

from deltaserve.ipc import step_trace
from deltaserve.tools.bench_engine_overhead import run_streams
from deltaserve.tools.step_trace import hop_table, load

# each pair: the first mark is made before the second can happen (clock shared by processes)
CAUSAL = [
    (("controller", "call"), ("rank0", "recv")),
    (("rank0", "recv"), ("rank0", "released")),
    (("rank0", "released"), ("rank0", "executed")),
    (("rank0", "executed"), ("controller", "replies")),
    (("controller", "replies"), ("scheduler", "results")),
]


async def test_every_step_is_traced_in_causal_order(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_STEP_TRACE", str(tmp_path))  # rank processes read it
    monkeypatch.setattr(step_trace, "TRACE_DIR", str(tmp_path))  # this process read it at import
    row = await run_streams(str(tiny_model_dir), streams=3, step_s=0.001, new_tokens=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "controller.tsv",
        "rank0.tsv",
        "scheduler.tsv",
    ]
    marks = load(Path(tmp_path))
    steps = {seq: m for seq, m in marks.items() if ("scheduler", "results") in m}
    # two runs (warm-up and measured) of a prompt step and 5 decode steps each, at the least
    assert len(steps) >= 2 * 6 and row["steps"] >= 6
    for seq, m in steps.items():
        for first, then in CAUSAL:
            assert first in m and then in m, f"step {seq} lacks {first} or {then}: {sorted(m)}"
            assert m[first] <= m[then], f"step {seq}: {first} after {then}"
        assert m[("size", "")] in (1, 2, 3), f"step {seq} has {m[('size', '')]} items"
    # pipelined: a decode step is sent before the results of the step ahead are in
    pipelined = [
        seq
        for seq, m in steps.items()
        if seq - 1 in steps and m[("controller", "call")] < steps[seq - 1][("scheduler", "results")]
    ]
    assert len(pipelined) >= 2 * 3  # 5 of each run's 6 steps, as measured here
    # the follower's receipt is in the gate before the reply to the step ahead goes out
    # (rank_main.receive_ahead): the controller can release it before reacting to the results
    early = [
        seq
        for seq in pipelined
        if steps[seq][("rank0", "recv")] < steps[seq - 1][("rank0", "replied")]
    ]
    assert len(early) >= 2 * 3, (
        f"{len(early)} of {len(pipelined)} followers received before the reply ahead"
    )
    table = hop_table(marks)
    assert sum(hops["steps"] for hops in table.values()) == len(steps)
    assert "rank 0 idle since the last step" in table[3]
    assert table[3]["executor (forward, sample)"] >= 1e3, "the no-op executor sleeps 1 ms per step"


def test_critical_path_shares_of_overlapping_kernels():
    """tools/step_anatomy.py's reading of a profiled replay, on a made-up trace: a PDL kernel
    that starts while its predecessor runs is charged only what it adds after it, a kernel
    fully inside another's time adds nothing, a gap is charged to the kernel after it, the
    shares add up to the span, and projections (ours, cuBLAS's) take the shapes in launch
    order with a split-K sum charged to its projection."""
    from deltaserve.tools.step_anatomy import critical_path_shares

    kernels = [  # ts, dur in us, listed out of order as a trace may be
        {"name": "_rms_norm_kernel", "ts": 100.0, "dur": 2.0},
        {"name": "_gemv_kernel", "ts": 101.0, "dur": 10.0},  # starts early (PDL), ends at 111
        {"name": "_sum_splits_kernel", "ts": 110.0, "dur": 2.0},  # ends at 112
        {"name": "_tiny_kernel", "ts": 110.5, "dur": 0.5},  # inside the others' time
        {"name": "nvjet_sm90_tst_64x64<bf16>", "ts": 115.0, "dur": 5.0},  # after a 3 us gap
        {"name": "nvjet_sm90_lm_head", "ts": 120.0, "dur": 4.0},  # no shape left: the lm_head
    ]
    path = critical_path_shares(list(reversed(kernels)), [(2560, 4096, 1000), (12352, 2560, 4000)])
    rows = path["launches"]
    assert [r["share_us"] for r in rows] == [2.0, 9.0, 1.0, 0.0, 8.0, 4.0]
    assert path["span_us"] == 24.0 == sum(r["share_us"] for r in rows)
    assert rows[1]["shape"] == [2560, 4096] and rows[1]["GBps"] == round(1000 / 9.0 / 1e3, 1)
    assert rows[2]["shape"] == [2560, 4096] and "bytes" not in rows[2]
    assert rows[4]["name"] == "nvjet_sm90_tst_64x64" and rows[4]["shape"] == [12352, 2560]
    assert "shape" not in rows[5] and "shape" not in rows[3]
    by_name = {e["name"]: e for e in path["by_name"]}
    assert by_name["_gemv_kernel"]["share_us"] == 9.0 and by_name["_gemv_kernel"]["dur_us"] == 10.0
