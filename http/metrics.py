"""`GET /metrics`: the engine's load and counters in Prometheus text format (0.0.4), by hand.

Names follow vLLM's (`vllm:` prefix) so that existing dashboards work unchanged:
  vllm:num_requests_running, vllm:num_requests_waiting          gauges
  vllm:kv_cache_usage_perc                                      gauge, fraction 0..1
  vllm:prompt_tokens_total, vllm:generation_tokens_total        counters
  vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total counters (tokens; prefix caching)
  vllm:request_success_total{finished_reason=stop|length|abort|error} counter (aborts and errors included)
  vllm:num_preemptions_total                                    counter
  deltaserve:steps_total, deltaserve:pipelined_steps_total, deltaserve:step_seconds_total,
  deltaserve:scheduler_seconds_total                            counters (engine overhead)
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
  vllm:e2e_request_latency_seconds                              histograms
Every series carries `model_name`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Mapping[str, str]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in pairs.items()) + "}"


def _num(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class PromText:
    """An append-only Prometheus text exposition."""

    def __init__(self, base_labels: Mapping[str, str]) -> None:
        self.base = dict(base_labels)
        self.lines: list[str] = []

    def _head(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self._head(name, "gauge", help_text)
        self.lines.append(f"{name}{_labels(self.base)} {_num(value)}")

    def counter(
        self, name: str, help_text: str, values: Iterable[tuple[Mapping[str, str], float]]
    ) -> None:
        """`name` ends in `_total`; one sample per label set."""
        self._head(name, "counter", help_text)
        for extra, value in values:
            self.lines.append(f"{name}{_labels({**self.base, **extra})} {_num(value)}")

    def histogram(
        self,
        name: str,
        help_text: str,
        bounds: Sequence[float],
        counts: Sequence[int],
        total: float,
    ) -> None:
        """`counts[i]` observations fell in (bounds[i-1], bounds[i]]; `counts` has one more
        entry than `bounds`, for the +Inf bucket. Prometheus buckets are cumulative."""
        if len(counts) != len(bounds) + 1:
            raise ValueError(f"{name}: {len(counts)} bucket counts for {len(bounds)} bounds")
        self._head(name, "histogram", help_text)
        running = 0
        for le, c in zip([*bounds, math.inf], counts, strict=True):
            running += c
            labels = _labels({**self.base, "le": _num(float(le))})
            self.lines.append(f"{name}_bucket{labels} {running}")
        self.lines.append(f"{name}_sum{_labels(self.base)} {_num(float(total))}")
        self.lines.append(f"{name}_count{_labels(self.base)} {running}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_metrics(engine: Any, model_name: str) -> str:
    """The exposition of `engine.load()` (a LoadSnapshot) and `engine.metrics` (EngineMetrics)."""
    load = engine.load()
    m = engine.metrics
    out = PromText({"model_name": model_name})
    out.gauge("vllm:num_requests_running", "Requests holding a state slot.", load.running)
    out.gauge("vllm:num_requests_waiting", "Requests waiting for admission.", load.waiting)
    used = (load.num_blocks - load.free_blocks) / load.num_blocks if load.num_blocks else 0.0
    out.gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks reserved (1 = full).", used)
    out.gauge(
        "deltaserve:state_slots_usage_perc",
        "Fraction of DeltaNet state slots in use.",
        (load.num_slots - load.free_slots) / load.num_slots if load.num_slots else 0.0,
    )
    out.gauge(
        "deltaserve:engine_dead",
        "1 once the engine has died (a fatal failure; not a shutdown).",
        int(bool(engine.is_dead)),
    )
    out.counter(
        "vllm:prompt_tokens_total", "Prefilled prompt tokens.", [({}, m.prompt_tokens_total)]
    )
    out.counter(
        "vllm:generation_tokens_total", "Generated tokens.", [({}, m.generation_tokens_total)]
    )
    out.counter(
        "vllm:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        [({}, m.prefix_cache_queries_total)],
    )
    out.counter(
        "vllm:prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        [({}, m.prefix_cache_hits_total)],
    )
    out.counter(
        "vllm:num_preemptions_total",
        "Running requests preempted (to be recomputed) for lack of KV blocks.",
        [({}, m.num_preemptions_total)],
    )
    out.counter("deltaserve:steps_total", "Steps run on the ranks.", [({}, m.steps_total)])
    out.counter(
        "deltaserve:pipelined_steps_total",
        "Steps sent while the step before still ran.",
        [({}, m.pipelined_steps_total)],
    )
    out.counter(
        "deltaserve:step_seconds_total",
        "Time steps spent in flight on the ranks.",
        [({}, m.step_seconds_total)],
    )
    out.counter(
        "deltaserve:scheduler_seconds_total",
        "Scheduler time between a step's results and the next step's dispatch (ranks idle).",
        [({}, m.scheduler_seconds_total)],
    )
    out.counter(
        "vllm:request_success_total",
        "Finished requests by finish reason.",
        [({"finished_reason": k}, v) for k, v in sorted(m.request_success_total.items())],
    )
    for name, help_text, h in (
        ("vllm:time_to_first_token_seconds", "Time to first token.", m.time_to_first_token_s),
        ("vllm:inter_token_latency_seconds", "Time between tokens.", m.inter_token_latency_s),
        ("vllm:e2e_request_latency_seconds", "Request latency.", m.e2e_request_latency_s),
    ):
        out.histogram(name, help_text, h.bounds, h.counts, h.total)
    return out.text()
