"""`deltaserve monitor ENDPOINT [--json]`: watch a running engine without touching it.

Connects a ZeroMQ SUB socket to the engine's monitor endpoint (`deltaserve serve` prints it
in its ready line) and decodes each message strictly (engine/monitor_schema.py,
docs/MONITOR.md). Live view (rich): engine state, load, throughput, latencies and recent
events. `--json`: one JSON object per message on stdout, as decoded (undecodable messages
are reported on stderr and skipped). Ends on Ctrl-C (exit 0) or after `--count` messages.
A subscriber joining late misses what was sent before; idle engines repeat their load every
second, so the view fills within one.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import time
from datetime import datetime

import msgspec
import zmq

from deltaserve.engine import monitor_schema as schema
from deltaserve.ipc.messages import DECODE_ERRORS

RECENT_EVENTS = 14
LATENCY_WINDOW = 500  # finished requests the percentiles are over
RATE_WINDOW_S = 5.0
REFRESH_S = 0.25
SILENT_S = 3.0  # three heartbeats missed (the engine sends a load message at least every second)
STATE_STYLE = {"starting": "yellow", "serving": "green", "draining": "yellow", "dead": "bold red"}


def _pct(values: collections.deque, q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3:.0f}"


class MonitorView:
    """What the live view shows, updated one message at a time (no terminal needed)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ready: schema.Ready | None = None
        self.load: schema.Load | None = None
        self.replica_note = ""  # the newest poisoned / terminal / shut_down
        self.num_messages = 0
        self.num_lost = 0
        self.num_undecodable = 0
        self.last_message_s = time.monotonic()  # when anything last arrived (or the view started)
        self.shut_down = False  # a shut_down came: silence is expected (until the next ready)
        self._next_seq: dict[bytes, int] = {}
        self._totals: collections.deque[tuple[float, int, int]] = collections.deque()
        self._ttft_s: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._e2e_s: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._queue_s: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.events: collections.deque[str] = collections.deque(maxlen=RECENT_EVENTS)

    def update(self, topic: bytes, message: schema.MonitorMessage) -> None:
        self.num_messages += 1
        self.last_message_s = time.monotonic()
        expected = self._next_seq.get(topic)
        if expected is not None and message.seq > expected:
            self.num_lost += message.seq - expected  # a smaller seq: the engine restarted
        self._next_seq[topic] = message.seq + 1
        if isinstance(message, schema.Load):
            self._on_load(message)
            return
        if isinstance(message, schema.Admitted):
            self._queue_s.append(message.queue_s)
            return  # too frequent for the event list
        if isinstance(message, schema.Finished):
            self.finished_by_reason[message.reason] += 1
            self._e2e_s.append(message.e2e_s)
            if message.ttft_s is not None:
                self._ttft_s.append(message.ttft_s)
        elif isinstance(message, schema.Rejected):
            self.finished_by_reason["rejected"] += 1
        elif isinstance(message, schema.Dropped):
            self.finished_by_reason["dropped"] += 1
        elif isinstance(message, schema.Ready):
            self.ready, self.replica_note, self.shut_down = message, "", False
        elif isinstance(message, schema.Poisoned | schema.Terminal | schema.ShutDown):
            self.replica_note = describe(message)
            self.shut_down = isinstance(message, schema.ShutDown)
        if not isinstance(message, schema.Queued | schema.FirstToken):
            self.events.appendleft(f"{_clock(message.time_s)}  {describe(message)}")

    def _on_load(self, load: schema.Load) -> None:
        if self._totals and load.generation_tokens_total < self._totals[-1][1]:
            self._totals.clear()  # counters went back: a new engine on this endpoint
        self.load = load
        self._totals.append((load.time_s, load.generation_tokens_total, load.prompt_tokens_total))
        while self._totals and self._totals[0][0] < load.time_s - RATE_WINDOW_S:
            self._totals.popleft()

    def rates(self) -> tuple[float, float]:
        """Generated and prompt tokens per second over the last RATE_WINDOW_S."""
        if len(self._totals) < 2:
            return 0.0, 0.0
        (t0, g0, p0), (t1, g1, p1) = self._totals[0], self._totals[-1]
        dt = max(t1 - t0, 1e-9)
        return (g1 - g0) / dt, (p1 - p0) / dt

    def render(self):  # -> rich renderable
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        load = self.load
        state = load.state if load else "unknown"
        style = STATE_STYLE.get(state, "white")
        silent_s = time.monotonic() - self.last_message_s
        if (
            silent_s > SILENT_S and state != "dead" and not self.shut_down
        ):  # no heartbeat: killed, or unreachable
            state, style = f"silent for {silent_s:.0f} s (was {state})", "bold red"
        head = Table.grid(padding=(0, 2))
        head.add_row(
            f"[b]{self.endpoint}[/b]",
            f"state [{style}]{state}[/]",
            f"messages {self.num_messages}  lost {self.num_lost}  undecodable "
            f"{self.num_undecodable}",
        )
        if self.ready:
            r = self.ready
            head.add_row(
                f"model {r.model}",
                f"tp {r.tp_size} on {r.device}",
                f"max_model_len {r.max_model_len}, started in {r.startup_s:.1f} s",
            )
        if self.replica_note:
            head.add_row(f"[bold red]{self.replica_note}[/]", "", "")
        stats = Table(show_header=True, header_style="bold", expand=True)
        for name in (
            "running",
            "waiting",
            "state slots",
            "KV blocks",
            "last step",
            "gen tok/s",
            "prompt tok/s",
        ):
            stats.add_column(name, justify="right")
        if load:
            gen_rate, prompt_rate = self.rates()
            stats.add_row(
                str(load.running),
                str(load.waiting),
                f"{load.num_slots - load.free_slots}/{load.num_slots}",
                f"{load.num_blocks - load.free_blocks}/{load.num_blocks}",
                f"{load.step_prefill_tokens}p+{load.step_decode_tokens}d"
                + (f"+{load.step_draft_tokens}s" if load.step_draft_tokens else "")
                + f" {load.step_duration_s * 1e3:.1f} ms",
                f"{gen_rate:.1f}",
                f"{prompt_rate:.1f}",
            )
        lat = Table(show_header=True, header_style="bold", expand=True)
        for name in ("ms", "p50", "p90", "p99", "n"):
            lat.add_column(name, justify="right")
        for name, values in (
            ("TTFT", self._ttft_s),
            ("end to end", self._e2e_s),
            ("queue", self._queue_s),
        ):
            lat.add_row(
                name, _pct(values, 0.5), _pct(values, 0.9), _pct(values, 0.99), str(len(values))
            )
        ended = "  ".join(f"{k} {v}" for k, v in sorted(self.finished_by_reason.items())) or "-"
        return Group(
            Panel(head, title="deltaserve monitor"),
            Panel(stats, title="load"),
            Panel(Group(lat, f"ended: {ended}"), title="latency (last 500 requests)"),
            Panel("\n".join(self.events) or "-", title="recent events"),
        )


def _clock(time_s: float) -> str:
    """A message's wall-clock time; a time no clock shows (NaN, 1e20) must not end the view."""
    try:
        return datetime.fromtimestamp(time_s).strftime("%H:%M:%S.%f")[:-3]
    except (ValueError, OverflowError, OSError):
        return f"time {time_s!r}"


def describe(m: schema.MonitorMessage) -> str:
    """One line for the recent-events list."""
    if isinstance(m, schema.Finished):
        ttft = "-" if m.ttft_s is None else f"{m.ttft_s * 1e3:.0f} ms"
        return (
            f"finished  #{m.request_id} {m.reason}: {m.prompt_tokens}+{m.output_tokens} tokens, "
            f"ttft {ttft}, e2e {m.e2e_s * 1e3:.0f} ms"
        )
    if isinstance(m, schema.Rejected):
        rid = "" if m.request_id is None else f"#{m.request_id} "
        return f"rejected  {rid}{m.client_id} ({m.reason}): {m.message}"
    if isinstance(m, schema.Dropped):
        return f"dropped   #{m.request_id} after {m.output_tokens} tokens: {m.message}"
    if isinstance(m, schema.Preempted):
        return f"preempted #{m.request_id} after {m.output_tokens} tokens"
    if isinstance(m, schema.Ready):
        return f"ready     {m.model} tp={m.tp_size} {m.num_slots} slots {m.num_blocks} blocks"
    if isinstance(m, schema.Poisoned | schema.Terminal):
        return f"{type(m).__name__.lower():<9} {m.reason}"
    if isinstance(m, schema.ShutDown):
        return "shut down"
    return type(m).__name__.lower()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deltaserve monitor",
        description="Watch a running engine's monitor endpoint (docs/MONITOR.md).",
    )
    p.add_argument(
        "endpoint",
        help="the engine's endpoint, e.g. ipc:///run/user/1000/"
        "deltaserve-1000/monitor-4242 or tcp://127.0.0.1:5557",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per message")
    p.add_argument(
        "--topics", default="load,request,replica", help="comma-separated topics to subscribe to"
    )
    p.add_argument("--count", type=int, default=None, help="exit after this many messages")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    topics = [t.strip().encode() for t in args.topics.split(",") if t.strip()]
    unknown = sorted({t.decode() for t in topics} - {t.decode() for t in schema.TOPICS.values()})
    if unknown or not topics:
        print(
            f"deltaserve monitor: error: unknown topic(s) {unknown or args.topics!r}; "
            "topics are load, request, replica",
            file=sys.stderr,
        )
        return 2
    if args.count is not None and args.count < 1:
        print(f"deltaserve monitor: error: --count must be >= 1, got {args.count}", file=sys.stderr)
        return 2
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        for topic in topics:
            sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(args.endpoint)
    except zmq.ZMQError as exc:
        print(
            f"deltaserve monitor: error: cannot connect to {args.endpoint!r}: {exc}",
            file=sys.stderr,
        )
        return 2
    path = args.endpoint.removeprefix("ipc://")
    if path != args.endpoint and not os.path.exists(path):  # zmq waits silently for it
        print(
            f"deltaserve monitor: nothing at {path} yet: waiting for an engine to bind it "
            "(serve's ready line names its monitor endpoint)",
            file=sys.stderr,
        )
    # ^C and SIGTERM end the watch with status 0, also when our parent left SIGINT ignored
    # (a shell's background job; Python then installs no KeyboardInterrupt handler itself)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.json:
            _print_json(sock, args.count)
        else:
            _live(sock, args.endpoint, args.count)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        ctx.term()
    return 0


def _messages(sock: zmq.Socket, count: int | None, on_undecodable, timeout_ms: int = 100):
    """Yield (topic, message) until `count`; None when nothing came within `timeout_ms`."""
    seen = 0
    while count is None or seen < count:
        if not sock.poll(timeout_ms):
            yield None
            continue
        frames = sock.recv_multipart()
        seen += 1
        try:
            if len(frames) != 2:
                raise msgspec.ValidationError(f"expected 2 frames [topic, body], got {len(frames)}")
            yield frames[0], schema.decode(frames[0], frames[1])
        except DECODE_ERRORS as exc:  # bad msgpack, bad UTF-8, too deep: never crash the view
            on_undecodable(frames[0], exc)


def _print_json(sock: zmq.Socket, count: int | None) -> None:
    out = sys.stdout.buffer

    def undecodable(topic: bytes, exc: Exception) -> None:
        print(f"deltaserve monitor: undecodable message on topic {topic!r}: {exc}", file=sys.stderr)

    for item in _messages(sock, count, undecodable):
        if item is not None:
            out.write(msgspec.json.encode(item[1]) + b"\n")
            out.flush()


def _live(sock: zmq.Socket, endpoint: str, count: int | None) -> None:
    from rich.live import Live

    view = MonitorView(endpoint)

    def undecodable(topic: bytes, exc: Exception) -> None:
        view.num_undecodable += 1
        view.events.appendleft(f"undecodable on {topic!r}: {exc}")

    last = 0.0
    with Live(view.render(), auto_refresh=False, screen=False) as live:
        for item in _messages(sock, count, undecodable):
            if item is not None:
                view.update(*item)
            now = time.monotonic()
            if now - last >= REFRESH_S:
                live.update(view.render(), refresh=True)
                last = now
        live.update(view.render(), refresh=True)
