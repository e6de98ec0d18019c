"""`GET /metrics` as a Prometheus scrape reads it: the exposition of the engine's counters
and histograms (no server: `render_metrics` over an engine stand-in), read back by
prometheus_client's own parsers."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.engine.events import LoadSnapshot
from deltaserve.engine.metrics import EngineMetrics
from deltaserve.http.metrics import render_metrics

LOAD = LoadSnapshot(
    running=1, waiting=2, free_slots=3, free_blocks=6, num_slots=4, num_blocks=8, steps_total=0
)
# every series /metrics carried before prometheus_client wrote it, with its labels: vLLM's
# names and label sets, which dashboards query
SERIES = {
    "vllm:num_requests_running": ("gauge", ("model_name",)),
    "vllm:num_requests_waiting": ("gauge", ("model_name",)),
    "vllm:kv_cache_usage_perc": ("gauge", ("model_name",)),
    "deltaserve:state_slots_usage_perc": ("gauge", ("model_name",)),
    "deltaserve:engine_dead": ("gauge", ("model_name",)),
    "vllm:prompt_tokens_total": ("counter", ("model_name",)),
    "vllm:generation_tokens_total": ("counter", ("model_name",)),
    "vllm:prefix_cache_queries_total": ("counter", ("model_name",)),
    "vllm:prefix_cache_hits_total": ("counter", ("model_name",)),
    "vllm:num_preemptions_total": ("counter", ("model_name",)),
    "vllm:request_success_total": ("counter", ("finished_reason", "model_name")),
    "deltaserve:steps_total": ("counter", ("model_name",)),
    "deltaserve:pipelined_steps_total": ("counter", ("model_name",)),
    "deltaserve:step_seconds_total": ("counter", ("model_name",)),
    "deltaserve:scheduler_seconds_total": ("counter", ("model_name",)),
    **{
        f"vllm:{name}_seconds{part}": ("histogram", labels)
        for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency")
        for part, labels in (
            ("_bucket", ("le", "model_name")),
            ("_sum", ("model_name",)),
            ("_count", ("model_name",)),
        )
    },
}


def scrape(metrics: EngineMetrics, accept: str | None = None, dead: bool = False) -> str:
    engine = SimpleNamespace(load=lambda: LOAD, metrics=metrics, is_dead=dead)
    body, _ = render_metrics(engine, "m", accept)
    return body.decode()


def buckets(text: str, name: str) -> dict[str, float]:
    """`le` -> cumulative count of histogram `name`'s buckets."""
    return {
        sample.labels["le"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name + "_bucket"
    }


def test_series_names_and_labels_are_vllms():
    """Every series, its type and its label names as before (vLLM's), each reason counted
    (zeros included: an abort is a series before the first one), values as the engine has
    them; the same series to an OpenMetrics scrape that keeps names as they are."""
    m = EngineMetrics()
    m.prompt_tokens_total, m.generation_tokens_total, m.step_seconds_total = 12, 7, 0.25
    m.request_success_total["length"] = 3
    m.time_to_first_token_s.observe(0.3)
    text = scrape(m, dead=True)
    seen, values = {}, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels["model_name"] == "m", sample
            seen.setdefault(sample.name, (family.type, tuple(sorted(labels))))
            values[(sample.name, labels.get("finished_reason"))] = sample.value
    assert seen == SERIES
    assert {r for name, r in values if name == "vllm:request_success_total"} == {
        "stop",
        "length",
        "abort",
        "error",
    }
    assert values[("vllm:request_success_total", "length")] == 3
    assert values[("vllm:prompt_tokens_total", None)] == 12
    assert values[("vllm:generation_tokens_total", None)] == 7
    assert values[("deltaserve:step_seconds_total", None)] == 0.25
    assert values[("deltaserve:engine_dead", None)] == 1
    assert values[("vllm:kv_cache_usage_perc", None)] == 0.25  # 2 of 8 blocks
    assert values[("vllm:time_to_first_token_seconds_count", None)] == 1
    assert values[("vllm:time_to_first_token_seconds_sum", None)] == 0.3

    accept = "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8"
    names = {
        sample.name
        for family in openmetrics_families(scrape(m, accept))
        for sample in family.samples
    }
    assert names == set(SERIES)


def test_latency_buckets_are_vllms_and_reach_past_a_minute():
    """A request slower than 60 s (8k tokens at 8 ms each; a TTFT behind a queue) fell in
    +Inf, the top bound being 60: `histogram_quantile` then read 60 s for p99 whatever the
    latency. And `le` values differed from vLLM's, so SLO rules on `..._bucket{le="0.75"}`
    written for vLLM found no series. The bounds are vLLM's now (plus finer inter-token ones)."""
    m = EngineMetrics()
    m.time_to_first_token_s.observe(100.0)
    m.e2e_request_latency_s.observe(300.0)
    m.inter_token_latency_s.observe(0.003)
    text = scrape(m)

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
