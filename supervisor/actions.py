"""What the autopilot is given of the control hash (`Control`), and what it answers with: typed
actions that `run.apply` writes to Redis (specs first, then the events that announce them). Nothing
here touches Redis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchfleet.records import Event, EventKind, ServerSpec

from .memory import Remembered

__all__ = ["Action", "Control", "DropFields", "Emit", "Outbox", "Remember", "SetFleet", "SetOverride"]


@dataclass(frozen=True, slots=True)
class Control:
    """What the control hash holds, and what the fleet runs (see ladder.current_spec)."""

    fleet: ServerSpec | None
    overrides: dict[str, ServerSpec]  # queue -> spec
    current: ServerSpec
    seen_generation: int = 0  # the highest generation any worker reports
    # worker name -> spec: the per-worker fields (`worker:<name>`) workers still honour; the supervisor
    # writes per-queue ones and only removes these
    legacy: dict[str, ServerSpec] = field(default_factory=dict)

    def next_generation(self) -> int:
        gens = [self.seen_generation, self.current.generation, *(s.generation for s in self.overrides.values()),
                *(s.generation for s in self.legacy.values())]
        if self.fleet is not None:
            gens.append(self.fleet.generation)
        return max(gens) + 1


@dataclass(frozen=True, slots=True)
class SetOverride:
    queue: str
    spec: ServerSpec


@dataclass(frozen=True, slots=True)
class SetFleet:
    spec: ServerSpec  # becomes field `fleet`; every per-queue (and per-worker) override is removed


@dataclass(frozen=True, slots=True)
class DropFields:
    fields: tuple[str, ...]  # control hash fields to delete (stale overrides)


@dataclass(frozen=True, slots=True)
class Emit:
    event: Event


@dataclass(frozen=True, slots=True)
class Remember:
    entries: dict[str, Remembered]  # the fleet's memory (`Keys.MEMORY`): memory_field -> the verified spec


Action = SetOverride | SetFleet | DropFields | Emit | Remember


class Outbox:
    """The actions of one step, in the order they are decided. `notes` (the autopilot's state) keeps the
    last thing said per topic, so that a steady state is said once."""

    def __init__(self, notes: dict[str, str]) -> None:
        self.actions: list[Action] = []
        self.notes = notes

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def emit(self, kind: EventKind, message: str, **data: Any) -> None:
        self.actions.append(Emit(Event(kind=kind, message=message, source="supervisor", data=data)))

    def note(self, topic: str, key: str, kind: EventKind, message: str, **data: Any) -> None:
        """Emit only when what there is to say on `topic` changed in substance (`key`, not the figures
        in `message`)."""
        if self.notes.get(topic) != key:
            self.notes[topic] = key
            self.emit(kind, message, **data)
