"""tools/bench_mtp.py's CPU path on a tiny checkpoint: the record has every run, forced
acceptance is the acceptance measured (0 and 1), and no request parted from MTP off's output
(fp32: exact). Timings are not asserted (benchmarks are tools, not tests)."""

from __future__ import annotations

import json

from deltaserve.tools.bench_mtp import main
from deltaserve.tools.make_model import make_model


def test_bench_mtp_smoke(tmp_path):
    model = make_model(tmp_path / "agree", preset="tiny", dtype="fp32", mtp="agree")
    out = tmp_path / "mtp.json"
    main(
        [
            *("--model", str(model), "--device", "cpu", "--concurrency", "1"),
            *("--acceptance", "0", "1", "--drafts", "1", "2"),
            *("--prompt-len", "12", "--output-len", "6", "--no-eager-baseline"),
            *("--draft-vocab-size", "124160"),
            *("--out", str(out)),
        ]
    )
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m tools.bench_mtp")
    assert [(r["rate"], r["k"]) for r in record["forced"]] == [
        (0.0, 1),
        (0.0, 2),
        (1.0, 1),
        (1.0, 2),
    ]
    assert [r["rate"] for r in record["adaptive"]] == [0.0, 1.0]
    for run in record["forced"] + record["adaptive"]:
        assert run["parted"] == 0, run
        assert run["draft_tokens"] > 0 or run["k"] is None, run
        if run["draft_tokens"]:
            assert run["measured_acceptance"] == run["rate"], run
    assert set(record["costs"]["measured"]) == {"decode_ms", "draft_ms", "verify_ms"}
    assert record["costs"]["bytes"]["mtp"] > 0
    assert record["args"]["draft_vocab_size"] == 124160
    assert record["costs"]["bytes"]["draft_lm_head"] * 2 == record["costs"]["bytes"]["lm_head"]
    assert "c1" in record["summary"]["best_k_speedup"]
