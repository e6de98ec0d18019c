"""The sampler between two decode steps, on the GPU: `python -m tools.bench_sampler [--out FILE]`.

Times `Sampler.launch` + `finish` (what rank 0 adds to a step) over random fp32 logits of the
4B vocabulary (scaled so that a few tokens dominate, as a model's do), greedy and seeded top-p
rows, at 1 and 64 rows, with the logits' logsumexp and argmax taken by kernels/logit_stats.py
("fused") and by torch ("torch"), interleaved in one process. Two figures each: the span of
launch + finish from an idle device (host and device time: what a step that is not overlapped
pays), and the device time alone, the launches queued behind a busy kernel (what an
overlapped step pays).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from deltaserve.engine.rank import sampler as sampler_module
from deltaserve.engine.rank.sampler import Sampler
from deltaserve.ipc.messages import SamplingSpec
from deltaserve.kernels.logit_stats import logsumexp_argmax, logsumexp_argmax_reference
from deltaserve.tools.bench_decode import write_report

VOCAB = 248320
MODES = {"fused": logsumexp_argmax, "torch": logsumexp_argmax_reference}


SLEEP_CYCLES = 4_000_000  # ~2 ms of a busy kernel: the host queues the sampler's work meanwhile


def time_sampler(rows: int, spec: SamplingSpec, stats, reps: int) -> tuple[float, float]:
    """Median ms of one launch + finish over `rows` rows: its span from an idle device,
    and its device time."""
    sampler_module.logsumexp_argmax = stats
    sampler = Sampler()
    ids = list(range(rows))
    for r in ids:
        sampler.add(r, spec)
    logits = torch.randn(rows, VOCAB, device="cuda") * 10
    spans, device = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        sampler.finish(sampler.launch(ids, logits))
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end))
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()  # fires when the busy kernel ends
        launch = sampler.launch(ids, logits)
        end.record()
        sampler.finish(launch)
        end.synchronize()
        device.append(start.elapsed_time(end))
    return statistics.median(spans), statistics.median(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    specs = {
        "greedy": SamplingSpec(seed=0, temperature=0.0),
        "top_p": SamplingSpec(seed=1, temperature=0.8, top_p=0.95),
    }
    rows_out = []
    for rows in (1, 64):
        for name, spec in specs.items():
            figures = {mode: [] for mode in MODES}
            for _ in range(args.rounds):  # interleaved
                for mode, stats in MODES.items():
                    figures[mode].append(time_sampler(rows, spec, stats, args.reps))
            row = {"rows": rows, "sampling": name, "logits_MB": rows * VOCAB * 4 / 1e6}
            for mode, runs in figures.items():
                row[f"{mode}_span_ms"] = statistics.median(span for span, _ in runs)
                row[f"{mode}_device_ms"] = statistics.median(dev for _, dev in runs)
            rows_out.append(row)
            print(
                f"rows {rows:3d} {name:7s}: span fused {row['fused_span_ms']:.3f} / torch "
                f"{row['torch_span_ms']:.3f} ms; device fused {row['fused_device_ms']:.3f} / torch "
                f"{row['torch_device_ms']:.3f} ms",
                flush=True,
            )
    sampler_module.logsumexp_argmax = logsumexp_argmax
    write_report(args.out, "bench_sampler", results=rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
