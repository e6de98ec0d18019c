"""Time stamps of each command's passage through the processes, for finding where an engine
step's time goes: set DELTASERVE_STEP_TRACE=DIR before the engine starts (ranks inherit it).

Every process appends `seq event monotonic_ns size` to a list and writes DIR/<who>.tsv at exit or
shutdown. CLOCK_MONOTONIC is one clock for every process of the host, so the files line up;
`python -m tools.step_trace DIR` prints the median time of each hop. Off (the default), a mark
is one attribute test.

Events, in order: controller `call` (the scheduler hands a command over), `sent` (its frame is
out to every rank); rank `recv`, `released` (the gate said EXECUTE), `executed`, `replied`;
controller `replies` (the last rank's reply is in); scheduler `results` (the tick has them).
"""

from __future__ import annotations

import os
import time

TRACE_DIR = os.environ.get("DELTASERVE_STEP_TRACE") or None


class StepTrace:
    def __init__(self, who: str) -> None:
        self.who = who
        self.marks: list[tuple[int, str, int, int]] | None = [] if TRACE_DIR else None

    def mark(self, seq: int, event: str, size: int = 0) -> None:
        """`size`: the step's items, where the marker knows them."""
        if self.marks is not None:
            self.marks.append((seq, event, time.monotonic_ns(), size))

    def write(self) -> None:
        """Write what was marked so far (and keep marking: a later write rewrites the file)."""
        if self.marks is None:
            return
        os.makedirs(TRACE_DIR, exist_ok=True)
        with open(os.path.join(TRACE_DIR, f"{self.who}.tsv"), "w") as f:
            f.writelines(f"{seq}\t{event}\t{ns}\t{size}\n" for seq, event, ns, size in self.marks)
