"""Where an engine step's time goes, from the files DELTASERVE_STEP_TRACE=DIR wrote
(ipc/step_trace.py): `python -m tools.step_trace DIR [--json OUT]`.

For every step (a command the scheduler got results of), grouped by its number of items, the
median time of each hop from the scheduler's hand-over to its next one, in microseconds. A
pipelined step is sent before the step ahead of it has ended, so its "to rank 0" includes
waiting for that step, and the scheduler's own hop before it is hidden; what the engine then
costs the ranks is "rank 0 idle since the last step" (its reply to the step ahead until its
release of this one). A rank that overlaps steps (ipc/rank_main.py) is released before it
replies to the step ahead: such steps are counted apart, with how long before the reply.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

OVERLAPPED = "rank 0 released before replying to the step ahead (overlapped)"
HOPS = [  # (name, from (process, event), to (process, event))
    ("controller: encode + send", ("controller", "call"), ("controller", "sent")),
    ("to rank 0", ("controller", "sent"), ("rank0", "recv")),
    ("gate release", ("rank0", "recv"), ("rank0", "released")),
    ("executor (forward, sample)", ("rank0", "released"), ("rank0", "executed")),
    ("rank 0 reply send", ("rank0", "executed"), ("rank0", "replied")),
    ("to controller, all replies", ("rank0", "replied"), ("controller", "replies")),
    ("to the scheduler", ("controller", "replies"), ("scheduler", "results")),
]


def load(trace_dir: Path) -> dict[int, dict[tuple[str, str], int]]:
    marks: dict[int, dict[tuple[str, str], int]] = defaultdict(dict)
    for path in sorted(trace_dir.glob("*.tsv")):
        for line in path.read_text().splitlines():
            seq, event, ns, size = line.split("\t")
            marks[int(seq)][(path.stem, event)] = int(ns)
            if int(size):
                marks[int(seq)][("size", "")] = int(size)
    return marks


def hop_table(marks: dict[int, dict[tuple[str, str], int]]) -> dict[int, dict[str, float]]:
    """{step size: {hop: median us}}; the tick's own hop runs from a step's results to the
    controller's next hand-over."""
    by_size: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for seq, m in marks.items():
        if ("scheduler", "results") not in m or ("size", "") not in m:
            continue
        hops = by_size[m[("size", "")]]
        for name, start, end in HOPS:
            if start in m and end in m:
                hops[name].append((m[end] - m[start]) / 1e3)
        following = marks.get(seq + 1, {})
        call_next = following.get(("controller", "call"))
        if call_next is not None and call_next > m[("scheduler", "results")]:  # not pipelined
            hops["scheduler: commit + plan"].append((call_next - m[("scheduler", "results")]) / 1e3)
        ahead = marks.get(seq - 1, {})
        if ("rank0", "replied") in ahead and ("rank0", "released") in m:
            gap = (m[("rank0", "released")] - ahead[("rank0", "replied")]) / 1e3
            if gap >= 0:
                hops["rank 0 idle since the last step"].append(gap)
            else:
                hops[OVERLAPPED].append(-gap)
        if ("controller", "call") in m and ("scheduler", "results") in m:
            hops["whole step (call to results)"].append(
                (m[("scheduler", "results")] - m[("controller", "call")]) / 1e3
            )
    return {
        size: {name: statistics.median(v) for name, v in hops.items()}
        | {
            "steps": len(hops.get(HOPS[0][0], [])),
            "overlapped steps": len(hops.get(OVERLAPPED, [])),
        }
        for size, hops in sorted(by_size.items())
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    table = hop_table(load(args.trace_dir))
    for size, hops in table.items():
        print(
            f"steps of {size} items ({hops['steps']} steps, "
            f"{hops['overlapped steps']} overlapped), median us:"
        )
        for name, us in hops.items():
            if name not in ("steps", "overlapped steps"):
                print(f"  {name:32s} {us:9.1f}")
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in table.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
