"""`GET /metrics`: the engine's load and counters, written by prometheus_client.

Names and labels follow vLLM's (`vllm:` prefix) so that existing dashboards work unchanged;
every series carries `model_name`:

| series | kind |
|---|---|
| vllm:num_requests_running, vllm:num_requests_waiting | gauge |
| vllm:kv_cache_usage_perc (fraction 0..1), deltaserve:state_slots_usage_perc | gauge |
| deltaserve:engine_dead (1 once the engine died) | gauge |
| vllm:prompt_tokens_total, vllm:generation_tokens_total | counter |
| vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens) | counter |
| vllm:request_success_total{finished_reason=stop/length/abort/error} | counter |
| vllm:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total | counter |
| vllm:spec_decode_num_accepted_tokens_per_pos_total{position=0..k-1} | counter |
| vllm:num_preemptions_total (running requests sent back to be recomputed) | counter |
| deltaserve:steps_total, deltaserve:pipelined_steps_total | counter |
| deltaserve:step_seconds_total, deltaserve:scheduler_seconds_total | counter |
| vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds | histogram |
| vllm:e2e_request_latency_seconds | histogram |

The engine keeps plain numbers (engine/metrics.py says why); `EngineCollector` reads them at
each scrape, and prometheus_client writes the exposition the scraper's Accept header asks
for (Prometheus text 0.0.4 by default, OpenMetrics on request), as its own HTTP handler does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

MODEL_LABEL = "model_name"


class EngineCollector(Collector):
    """The series of one engine (`engine.load()`, `engine.metrics`, `engine.is_dead`): an
    AsyncEngine, or a DataParallelEngine whose metrics are its replicas' summed."""

    def __init__(
        self, engine: Any, model_name: str, front: Sequence[tuple[str, str, float]] = ()
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.front = front  # the HTTP server's own counters: (name, help, value)

    def collect(self) -> Iterator[Metric]:
        load, m = self.engine.load(), self.engine.metrics
        kv_used = (load.num_blocks - load.free_blocks) / load.num_blocks if load.num_blocks else 0
        slots_used = (load.num_slots - load.free_slots) / load.num_slots if load.num_slots else 0
        yield self.gauge(
            "vllm:num_requests_running", "Requests holding a state slot.", load.running
        )
        yield self.gauge(
            "vllm:num_requests_waiting", "Requests waiting for admission.", load.waiting
        )
        yield self.gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV blocks reserved (1 = full).", kv_used
        )
        yield self.gauge(
            "deltaserve:state_slots_usage_perc",
            "Fraction of DeltaNet state slots in use.",
            slots_used,
        )
        yield self.gauge(
            "deltaserve:engine_dead",
            "1 once the engine has died (a fatal failure; not a shutdown).",
            int(bool(self.engine.is_dead)),
        )
        for name, help_text, value in (
            ("vllm:prompt_tokens_total", "Prefilled prompt tokens.", m.prompt_tokens_total),
            ("vllm:generation_tokens_total", "Generated tokens.", m.generation_tokens_total),
            (
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                m.prefix_cache_queries_total,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache.",
                m.prefix_cache_hits_total,
            ),
            (
                "vllm:num_preemptions_total",
                "Running requests preempted (to be recomputed) for lack of KV blocks.",
                m.num_preemptions_total,
            ),
            ("deltaserve:steps_total", "Steps run on the ranks.", m.steps_total),
            (
                "deltaserve:pipelined_steps_total",
                "Steps sent while the step before still ran.",
                m.pipelined_steps_total,
            ),
            (
                "deltaserve:step_seconds_total",
                "Time steps spent in flight on the ranks.",
                m.step_seconds_total,
            ),
            (
                "deltaserve:scheduler_seconds_total",
                "Scheduler time between a step's results and the next step's dispatch "
                "(ranks idle).",
                m.scheduler_seconds_total,
            ),
            *self.front,
        ):
            yield self.counter(name, help_text, value)
        finished = CounterMetricFamily(
            "vllm:request_success_total",
            "Finished requests by finish reason.",
            labels=[MODEL_LABEL, "finished_reason"],
        )
        for reason, count in sorted(m.request_success_total.items()):
            finished.add_metric([self.model_name, reason], count)
        yield finished
        yield from self.spec_decode(m, len(load.spec_decode_accepted_per_position))
        for name, help_text, histogram in (
            ("vllm:time_to_first_token_seconds", "Time to first token.", m.time_to_first_token_s),
            ("vllm:inter_token_latency_seconds", "Time between tokens.", m.inter_token_latency_s),
            ("vllm:e2e_request_latency_seconds", "Request latency.", m.e2e_request_latency_s),
        ):
            family = HistogramMetricFamily(name, help_text, labels=[MODEL_LABEL])
            buckets = [(floatToGoString(le), count) for le, count in histogram.cumulative()]
            family.add_metric([self.model_name], buckets, histogram.total)
            yield family

    def spec_decode(self, m: Any, num_positions: int) -> Iterator[Metric]:
        """Speculative decoding's counters, as vLLM's (only where the engine speculates: its
        load lists `num_positions` draft positions): verify steps of a request, the drafts
        they verified and accepted, and how often each draft position was accepted."""
        if not num_positions:
            return
        for name, help_text, value in (
            (
                "vllm:spec_decode_num_drafts_total",
                "Verifications of a request's drafts.",
                m.spec_decode_num_drafts_total,
            ),
            (
                "vllm:spec_decode_num_draft_tokens_total",
                "Draft tokens verified.",
                m.spec_decode_num_draft_tokens_total,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens_total",
                "Draft tokens accepted.",
                m.spec_decode_num_accepted_tokens_total,
            ),
        ):
            yield self.counter(name, help_text, value)
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by their position in the drafts.",
            labels=[MODEL_LABEL, "position"],
        )
        for position in range(num_positions):
            count = m.spec_decode_num_accepted_tokens_per_pos.get(position, 0)
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position

    def counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=[MODEL_LABEL])
        family.add_metric([self.model_name], value)
        return family

    def gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=[MODEL_LABEL])
        family.add_metric([self.model_name], value)
        return family


def render_metrics(
    engine: Any,
    model_name: str,
    accept: str | None = None,
    front: Sequence[tuple[str, str, float]] = (),
) -> tuple[bytes, str]:
    """The exposition of `engine`'s series and the server's `front` counters in the format
    `accept` (a scrape's Accept header) asks for, and its Content-Type."""
    encode, content_type = choose_encoder(accept or "")
    return encode(EngineCollector(engine, model_name, front)), content_type
