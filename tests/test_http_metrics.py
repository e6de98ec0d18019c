"""`GET /metrics` as a Prometheus scrape reads it: the rendered exposition of the engine's
counters and histograms (no server: `render_metrics` over an engine stand-in)."""

from __future__ import annotations

from types import SimpleNamespace

from deltaserve.engine.events import LoadSnapshot
from deltaserve.engine.metrics import EngineMetrics
from deltaserve.http.metrics import render_metrics


def buckets(text: str, name: str) -> dict[str, float]:
    """`le` -> cumulative count of histogram `name`'s buckets."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            series, value = line.rsplit(" ", 1)
            out[series.split('le="')[1].split('"')[0]] = float(value)
    return out


def test_latency_buckets_are_vllms_and_reach_past_a_minute():
    """A request slower than 60 s (8k tokens at 8 ms each; a TTFT behind a queue) fell in
    +Inf, the top bound being 60: `histogram_quantile` then read 60 s for p99 whatever the
    latency. And `le` values differed from vLLM's, so SLO rules on `..._bucket{le="0.75"}`
    written for vLLM found no series. The bounds are vLLM's now (plus finer inter-token ones)."""
    m = EngineMetrics()
    m.time_to_first_token_s.observe(100.0)
    m.e2e_request_latency_s.observe(300.0)
    m.inter_token_latency_s.observe(0.003)
    load = LoadSnapshot(
        running=0, waiting=0, free_slots=4, free_blocks=8, num_slots=4, num_blocks=8, steps_total=0
    )
    text = render_metrics(SimpleNamespace(load=lambda: load, metrics=m, is_dead=False), "m")

    vllm = {
        "vllm:time_to_first_token_seconds": [
            0.001,
            0.005,
            0.01,
            0.02,
            0.04,
            0.06,
            0.08,
            0.1,
            0.25,
            0.5,
            0.75,
            1.0,
            2.5,
            5.0,
            7.5,
            10.0,
            20.0,
            40.0,
            80.0,
            160.0,
            640.0,
            2560.0,
        ],
        "vllm:inter_token_latency_seconds": [
            0.01,
            0.025,
            0.05,
            0.075,
            0.1,
            0.15,
            0.2,
            0.3,
            0.4,
            0.5,
            0.75,
            1.0,
            2.5,
            5.0,
            7.5,
            10.0,
            20.0,
            40.0,
            80.0,
        ],
        "vllm:e2e_request_latency_seconds": [
            0.3,
            0.5,
            0.8,
            1.0,
            1.5,
            2.0,
            2.5,
            5.0,
            10.0,
            15.0,
            20.0,
            30.0,
            40.0,
            50.0,
            60.0,
            120.0,
            240.0,
            480.0,
            960.0,
            1920.0,
            7680.0,
        ],
    }
    for name, bounds in vllm.items():
        got = buckets(text, name)
        missing = [b for b in bounds if repr(b) not in got]
        assert not missing, f"{name}: no bucket for vLLM's le={missing}; have {list(got)}"
    # each observation lies in a finite bucket: the quantile is bounded by a real bound
    assert buckets(text, "vllm:time_to_first_token_seconds")["160.0"] == 1
    assert buckets(text, "vllm:e2e_request_latency_seconds")["480.0"] == 1
    itl = buckets(text, "vllm:inter_token_latency_seconds")
    assert (itl["0.0025"], itl["0.005"]) == (0, 1)  # a GPU decode step, resolved below 10 ms
