"""`python -m tools.bench_serve` against a real `deltaserve serve` (tiny model, CPU, with an
API key): a random run and a multi-turn run with small counts; the JSON has vLLM's fields and
agrees with what was sent and with the server's own /metrics. Plus the metric formulas on
made-up timings.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import pytest
from serve_helpers import REPO_ROOT, ServeProcess, get

from deltaserve.tools.bench_client import RequestOutput, compute_metrics, parse_goodput

MODEL = "tiny-bench"
KEY = "sk-bench"
VLLM_FIELDS = [
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")
]


async def bench(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tools.bench_serve",
        *args,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, out.decode()


def generation_tokens(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:generation_tokens_total in /metrics")


async def test_bench_serve_random_and_multi_turn(tiny_model_dir, tmp_path):
    server = await ServeProcess.start(
        "--model",
        str(tiny_model_dir),
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    )
    common = [
        "--base-url",
        server.url,
        "--api-key",
        KEY,
        "--result-dir",
        str(tmp_path),
        "--ignore-eos",
    ]
    try:
        code, out = await bench(
            *common,
            "--model",
            MODEL,
            "--random-input-len",
            "24",
            "--random-output-len",
            "6",
            "--num-prompts",
            "8",
            "--max-concurrency",
            "4",
            "--request-rate",
            "40",
            "--goodput",
            "ttft:600000",
            "e2el:600000",
            "--result-filename",
            "random.json",
            "--save-detailed",
        )
        assert code == 0, out + server.log()
        r = json.loads((tmp_path / "random.json").read_text())
        assert set(VLLM_FIELDS) <= r.keys()
        assert (r["completed"], r["failed"], r["model_id"]) == (8, 0, MODEL)
        assert r["input_lens"] == [24] * 8 and r["output_lens"] == [6] * 8  # token-exact
        assert (
            r["total_input_tokens"],
            r["total_output_tokens"],
            r["total_cached_input_tokens"],
        ) == (192, 48, 0)
        assert r["errors"] == [""] * 8
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])
        assert r["output_throughput"] == pytest.approx(48 / r["duration"])
        assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"]
        assert r["median_itl_ms"] <= r["p99_itl_ms"] and r["mean_tpot_ms"] > 0
        assert all(len(itl) <= 5 for itl in r["itls"])
        assert r["command"].startswith("python -m tools.bench_serve --base-url")
        assert r["max_concurrency"] == 4 and 1 <= r["max_concurrent_requests"] <= 4
        # the engine's own counters over the run: 48 tokens at <= 4 per step need >= 12 steps
        assert (
            r["engine_steps"] >= 12
            and r["engine_mean_step_ms"] > 0
            and r["engine_mean_scheduler_ms"] > 0
        )
        assert 0 < r["engine_busy_fraction"] <= 1 and 0 <= r["engine_pipelined_fraction"] < 1
        status, text = await get(server.url + "/metrics", {"Authorization": f"Bearer {KEY}"})
        assert status == 200
        assert generation_tokens(text) == 48 + 6  # + the uncounted initial test request

        code, out = await bench(
            *common,
            "--multi-turn",
            "--endpoint",
            "chat",
            "--num-conversations",
            "4",
            "--max-concurrency",
            "2",
            "--random-input-len",
            "12",
            "--random-output-len",
            "4",
            "--result-filename",
            "multi.json",
        )
        assert code == 0, out + server.log()
        m = json.loads((tmp_path / "multi.json").read_text())
        assert "itls" not in m and "generated_texts" not in m  # without --save-detailed
        turns = m["turns_per_conversation"]
        assert len(turns) == 4 and all(2 <= t <= 5 for t in turns)
        assert m["conversations_completed"] == 4 and m["conversations_failed"] == 0
        # later turns start after earlier ones
        assert 0 < m["total_cached_input_tokens"] < m["total_input_tokens"]
        assert m["turns_completed"] == m["completed"] == m["turns_planned"] == sum(turns)
        assert m["output_lens"] == [4] * sum(turns)
        # each turn resends the history: prompts grow within a conversation
        lens, at = m["input_lens"], 0
        for t in turns:
            assert lens[at : at + t] == sorted(lens[at : at + t]) and lens[at] < lens[at + t - 1]
            at += t
        probe = m["readmission"]
        assert probe["ok"] and probe["requests"] == probe["completed"] == 4
        assert (probe["health_before"], probe["health_after"]) == (200, 200)
        assert min(probe["input_lens"]) > min(lens)
        assert max(probe["input_lens"]) > max(lens)

        code, out = await bench(
            *common, "--base-url", server.url, "--api-key", "wrong", "--num-prompts", "1"
        )
        assert code == 1 and "401" in out, out
        server.proc.send_signal(signal.SIGTERM)
        assert await server.wait(30) == 0, server.log()
    finally:
        await server.kill()


def test_metrics_formulas():
    """vLLM's definitions: TPOT = (E2EL - TTFT) / (output - 1); ITL pooled over requests;
    goodput counts requests meeting every SLO; failed requests count only as failed."""
    a = RequestOutput(True, "", 10, 5, "x", "length", 0.1, [0.1, 0.2, 0.1, 0.2], 0.7, 0.0)
    b = RequestOutput(True, "", 20, 1, "y", "length", 0.3, [], 0.3, 0.5)
    bad = RequestOutput(False, "HTTP 500", 0, 0, "", None, 0.0, [], 0.0, 0.2)
    m = compute_metrics(
        [a, b, bad], duration_s=2.0, percentiles=(50.0, 99.0), goodput=parse_goodput(["ttft:200"])
    )
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0
    assert m["request_goodput"] == 0.5  # only `a` has TTFT <= 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(150.0)  # (0.7 - 0.1) / 4; `b` has 1 token
    assert m["mean_itl_ms"] == pytest.approx(150.0) and m["p50_itl_ms"] == pytest.approx(150.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_e2el_ms"] == pytest.approx(500.0)
    assert m["max_concurrent_requests"] == 2  # a: [0, 0.7), b: [0.5, 0.8)
    for bad_slo in (["ttft"], ["itl:5"], ["ttft:-1"], ["tpot:x"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad_slo)


def test_coldstart_tool(tiny_model_dir, tmp_path):
    """`python -m tools.coldstart` times a real `deltaserve serve` to its first answer, keeps
    the start-up phases it logged, and sees a clean SIGTERM exit."""
    import subprocess

    out = tmp_path / "coldstart.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.coldstart",
            "--runs",
            "1",
            "--out",
            str(out),
            "--",
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--max-num-seqs",
            "2",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["exit_code"] == 0
    assert 0 < run["seconds_to_first_answer"] < 120
    assert any("weights loaded" in line for line in run["phases"])
    assert any("engine ready" in line for line in run["phases"])
