"""What the scheduler tick (engine/scheduler.py) keeps: the messages its inbox takes from the
engine, and its records of an unresolved request and of a step in flight."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.events import Event
from deltaserve.engine.planner import StepPlan
from deltaserve.engine.request import Request
from deltaserve.engine.stream import EventSink
from deltaserve.ipc.controller import Flight


@dataclass(slots=True)
class Submission:
    """The choices of one generate call, for the tick to queue (`Scheduler.submit`)."""

    sink: EventSink
    requests: list[Request]


@dataclass(slots=True)
class Cancellation:
    """Cancel these choices, wherever they are (`Scheduler.cancel`)."""

    request_ids: tuple[int, ...]


@dataclass(eq=False, slots=True)
class Entry:
    """An unresolved choice, its owner's sink and its text so far."""

    request: Request
    sink: EventSink
    detokenizer: IncrementalDetokenizer


@dataclass(eq=False, slots=True)
class Step:
    """A step sent to the ranks and not yet committed."""

    plan: StepPlan
    flight: Flight
    sent_at: float
    drops: dict[int, list[Event]]  # requests it drops before it runs, with their held events
