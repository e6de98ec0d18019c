"""The engine's monitor publisher: a ZeroMQ PUB socket that operators attach to.

It listens to the scheduler (`load_listeners`, `lifecycle_listeners`) and to AsyncEngine's
start and shutdown, and publishes the messages of engine/monitor_schema.py (docs/MONITOR.md).
Publishing never blocks or slows the tick: every send is NOBLOCK, and a subscriber that does
not keep up loses messages at its high-water mark (PUB drops; nothing queues in the engine).
It costs a few microseconds per message; without a publisher the scheduler's hooks are
empty lists.

Load throttling: a snapshot after a step, or with a new `state`, goes out at once. An idle
tick's (no step before it) goes out only if its counts changed, and at most `idle_max_hz`
times a second: one that comes sooner is held, and the newest held one is sent when the
interval is over. After `heartbeat_s` without a load message the newest snapshot is sent
again with step_* zero (it reports no new step), so a monitor attaching to an idle engine
sees it within a second.

Endpoints: "auto" binds ipc://RUNTIME/deltaserve-UID/monitor-PID (-N for a second engine in
the process), RUNTIME being $XDG_RUNTIME_DIR or the temp folder, the folder 0700 and owned
by this user (checked), so that only this user can connect; tcp:// only when asked for.
"""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from deltaserve.engine import monitor_schema as schema
from deltaserve.engine.events import Lifecycle, LoadSnapshot

if TYPE_CHECKING:
    from deltaserve.engine.scheduler import Scheduler

AUTO = "auto"
IDLE_MAX_HZ = 10.0
HEARTBEAT_S = 1.0
SNDHWM = 10_000  # messages queued per subscriber before PUB drops them for it
CLOSE_LINGER_MS = 250  # time the last messages get to leave on close

_STARTING = LoadSnapshot(
    state="starting",
    running=0,
    waiting=0,
    free_slots=0,
    free_blocks=0,
    num_slots=0,
    num_blocks=0,
    steps_total=0,
)


def runtime_dir() -> str:
    """This user's private folder for monitor sockets, made 0700 if absent; refuses one
    that another user owns or others can enter (someone could impersonate the engine)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, f"deltaserve-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(
            f"monitor runtime folder {path} must be a folder owned by uid {os.getuid()} with "
            f"mode 0700 (it is {stat.filemode(info.st_mode)}, uid {info.st_uid}); remove it or "
            f"pass monitor_endpoint explicitly"
        )
    return path


def resolve_endpoint(endpoint: str) -> str:
    """ "auto": monitor-PID, or monitor-PID-N if taken (binding an ipc path replaces it)."""
    if endpoint != AUTO:
        return endpoint
    folder, name, n = runtime_dir(), f"monitor-{os.getpid()}", 1
    path = f"{folder}/{name}"
    while os.path.exists(path):
        n += 1
        path = f"{folder}/{name}-{n}"
    return f"ipc://{path}"


class MonitorPublisher:
    """Bind with `MonitorPublisher(endpoint)` (in the event loop), `attach` to a scheduler,
    `aclose` at the end. `endpoint` is what subscribers connect to (tcp port 0 resolved)."""

    def __init__(
        self, endpoint: str, *, idle_max_hz: float = IDLE_MAX_HZ, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        if not idle_max_hz > 0 or not heartbeat_s > 0:
            raise ValueError(
                f"idle_max_hz ({idle_max_hz}) and heartbeat_s ({heartbeat_s}) must be > 0"
            )
        self._loop = asyncio.get_running_loop()
        self._idle_interval_s = 1.0 / idle_max_hz
        self._heartbeat_s = heartbeat_s
        self._ctx = zmq.Context(io_threads=1)
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SNDHWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(resolve_endpoint(endpoint))
        except (zmq.ZMQError, ValueError) as exc:
            self._socket.close()
            self._ctx.term()
            raise ValueError(f"cannot bind monitor_endpoint {endpoint!r}: {exc}") from None
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = {topic: 0 for topic in (b"load", b"request", b"replica")}
        self._latest = _STARTING  # newest snapshot from the scheduler
        self._sent = _STARTING  # newest sent
        self._held = False  # `_latest` waits for the idle interval to end
        self._last_sent_mono = 0.0  # any load message
        self._last_idle_mono = -1e9  # an idle tick's
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._send_load(time.monotonic())  # "starting", then heartbeats until the replica is up

    @property
    def num_published(self) -> int:
        """Messages sent on every topic so far (delivered or dropped by PUB)."""
        return sum(self._seq.values())

    # ---- hooks ------------------------------------------------------------------------------

    def attach(self, scheduler: Scheduler) -> None:
        scheduler.load_listeners.append(self.on_load)
        scheduler.lifecycle_listeners.append(self.on_lifecycle)

    def on_load(self, snapshot: LoadSnapshot) -> None:
        previous, self._latest = self._latest, snapshot
        now = time.monotonic()
        if snapshot.steps_total != previous.steps_total or snapshot.state != previous.state:
            self._send_load(now)
        elif _counts(snapshot) == _counts(self._sent):
            self._held = False  # no news: the heartbeat repeats it
        elif now - self._last_idle_mono >= self._idle_interval_s:
            self._last_idle_mono = now
            self._send_load(now)
        else:
            self._held = True
            self._arm(self._last_idle_mono + self._idle_interval_s)

    def on_lifecycle(self, event: Lifecycle) -> None:
        make = _REQUEST_MESSAGES.get(event.transition)
        if make is not None:
            self._send(make(event, self._fields(b"request")))
        elif event.transition == "poisoned":
            self._send(schema.Poisoned(**self._fields(b"replica"), reason=event.message))
        elif event.transition == "terminal":
            self._send(schema.Terminal(**self._fields(b"replica"), reason=event.message))

    def ready(
        self,
        *,
        model: str,
        tp_size: int,
        device: str,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        startup_s: float,
    ) -> None:
        self._send(
            schema.Ready(
                **self._fields(b"replica"),
                model=model,
                tp_size=tp_size,
                device=device,
                num_slots=num_slots,
                num_blocks=num_blocks,
                block_size=block_size,
                max_model_len=max_model_len,
                startup_s=startup_s,
            )
        )

    def failed_to_start(self, reason: str) -> None:
        self._send(schema.Terminal(**self._fields(b"replica"), reason=reason))

    async def aclose(self) -> None:
        """Send the newest unsent snapshot and `shut_down`, then close. Idempotent."""
        if self._closed:
            return
        if self._held:
            self._send_load(time.monotonic())
        self._send(schema.ShutDown(**self._fields(b"replica")))
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._socket.close(linger=CLOSE_LINGER_MS)
        # term waits up to the linger for the last frames to leave: not on the loop thread.
        await self._loop.run_in_executor(None, self._ctx.term)
        if self.endpoint.startswith("ipc://"):  # libzmq leaves the socket file behind
            try:
                os.unlink(self.endpoint.removeprefix("ipc://"))
            except OSError:
                pass

    # ---- sending ----------------------------------------------------------------------------

    def _fields(self, topic: bytes) -> dict:
        seq = self._seq[topic]
        self._seq[topic] = seq + 1
        return {"seq": seq, "time_s": time.time()}

    def _send(self, message: schema.MonitorMessage) -> None:
        if self._closed:
            return
        try:
            self._socket.send_multipart(
                (schema.TOPICS[type(message)], schema.encoder.encode(message)), zmq.NOBLOCK
            )
        except zmq.Again:
            pass  # PUB drops rather than blocks; kept for safety

    def _send_load(self, now: float, heartbeat: bool = False) -> None:
        """Send the newest snapshot; as a heartbeat it ran no step, so step_* are zero."""
        s = self._latest
        if heartbeat:
            s = msgspec.structs.replace(
                s, step_prefill_tokens=0, step_decode_tokens=0, step_duration_s=0.0
            )
        self._send(
            schema.Load(
                **self._fields(b"load"),
                state=s.state,
                running=s.running,
                waiting=s.waiting,
                free_slots=s.free_slots,
                free_blocks=s.free_blocks,
                num_slots=s.num_slots,
                num_blocks=s.num_blocks,
                steps_total=s.steps_total,
                step_prefill_tokens=s.step_prefill_tokens,
                step_decode_tokens=s.step_decode_tokens,
                step_duration_s=s.step_duration_s,
                prompt_tokens_total=s.prompt_tokens_total,
                generation_tokens_total=s.generation_tokens_total,
                step_draft_tokens=s.step_draft_tokens,
                spec_decode_num_drafts_total=s.spec_decode_num_drafts_total,
                spec_decode_num_draft_tokens_total=s.spec_decode_num_draft_tokens_total,
                spec_decode_num_accepted_tokens_total=s.spec_decode_num_accepted_tokens_total,
                spec_decode_accepted_per_position=s.spec_decode_accepted_per_position,
            )
        )
        self._sent = self._latest
        self._held = False
        self._last_sent_mono = now
        self._arm(now + self._heartbeat_s)

    def _arm(self, when_mono: float) -> None:
        """One timer for the held snapshot and the heartbeat: the earlier time wins."""
        if self._closed:
            return
        when = self._loop.time() + (when_mono - time.monotonic())
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = time.monotonic()
        if self._held:
            due = self._last_idle_mono + self._idle_interval_s
            if now >= due - 1e-3:
                self._last_idle_mono = now
                self._send_load(now)
                return
        else:
            due = self._last_sent_mono + self._heartbeat_s
            if now >= due - 1e-3:
                self._send_load(now, heartbeat=True)
                return
        self._arm(due)


def _counts(s: LoadSnapshot) -> tuple[int, int, int, int]:
    return s.running, s.waiting, s.free_slots, s.free_blocks


def _request_id(event: Lifecycle) -> int:
    return event.request.request_id


def _queued(e: Lifecycle, f: dict) -> schema.Queued:
    r = e.request
    return schema.Queued(
        **f,
        request_id=r.request_id,
        client_id=e.client_id,
        index=r.index,
        prompt_tokens=r.prompt_len,
        max_tokens=r.params.max_tokens,
    )


def _admitted(e: Lifecycle, f: dict) -> schema.Admitted:
    return schema.Admitted(
        **f, request_id=_request_id(e), queue_s=e.time_s - e.request.arrival_time_s
    )


def _preempted(e: Lifecycle, f: dict) -> schema.Preempted:
    return schema.Preempted(
        **f, request_id=_request_id(e), output_tokens=e.request.num_output_tokens
    )


def _first_token(e: Lifecycle, f: dict) -> schema.FirstToken:
    r = e.request
    return schema.FirstToken(
        **f, request_id=r.request_id, ttft_s=r.first_token_time_s - r.arrival_time_s
    )


def _finished(e: Lifecycle, f: dict) -> schema.Finished:
    r = e.request
    ttft = None if r.first_token_time_s is None else r.first_token_time_s - r.arrival_time_s
    return schema.Finished(
        **f,
        request_id=r.request_id,
        reason=e.reason,
        prompt_tokens=r.prompt_len,
        output_tokens=r.num_output_tokens,
        ttft_s=ttft,
        e2e_s=e.time_s - r.arrival_time_s,
    )


def _rejected(e: Lifecycle, f: dict) -> schema.Rejected:
    rid = None if e.request is None else e.request.request_id
    return schema.Rejected(
        **f, request_id=rid, client_id=e.client_id, reason=e.reason, message=e.message
    )


def _dropped(e: Lifecycle, f: dict) -> schema.Dropped:
    r = e.request
    return schema.Dropped(
        **f,
        request_id=r.request_id,
        output_tokens=r.num_output_tokens,
        e2e_s=e.time_s - r.arrival_time_s,
        message=e.message,
    )


_REQUEST_MESSAGES: dict[str, Callable[[Lifecycle, dict], schema.MonitorMessage]] = {
    "queued": _queued,
    "admitted": _admitted,
    "preempted": _preempted,
    "first_token": _first_token,
    "finished": _finished,
    "rejected": _rejected,
    "dropped": _dropped,
}
