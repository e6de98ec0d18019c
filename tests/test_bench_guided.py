"""`python -m tools.bench_guided` on the CPU (tiny model, a batch of 2, a few tokens): every
workload at every batch size is measured, the JSON carries the command, commit and hardware,
and a cold run compiles where its cached twin finds the compile done."""

from __future__ import annotations

import json

from deltaserve.tools.bench_guided import run


def test_measures_each_constraint_cold_and_cached(tiny_model_dir, tmp_path):
    out = tmp_path / "guided.json"
    result = run(
        [
            *("--model", str(tiny_model_dir), "--device", "cpu", "--batches", "2"),
            *("--prompt-len", "8", "--output-len", "6", "--out", str(out)),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["command"].startswith("python -m tools.bench_guided --model")
    assert result["commit"] and result["hardware"]["cores"]
    rows = {r["workload"]: r for r in result["rows"]}
    assert set(rows) == {
        "unguided",
        *(
            f"{kind} {temper}"
            for kind in ("json", "regex", "grammar")
            for temper in ("cold", "cached")
        ),
    }
    for row in rows.values():
        assert row["batch"] == 2 and row["outputs"] == row["valid"] == 2, row
        assert row["tpot_ms_median"] > 0 and row["tpot_vs_unguided"] > 0, row
    for kind in ("json", "regex", "grammar"):  # the cached run found the compile done
        assert rows[f"{kind} cached"]["compile_s"] < rows[f"{kind} cold"]["compile_s"], kind
