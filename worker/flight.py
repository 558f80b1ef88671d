"""A claimed prompt while this worker holds it (`Flight`, with its `FlightState`), the set of them
(`Board`), and what became of them (`Tally`).

Each claimed prompt runs as one asyncio task; the board maps each task to its flight. A flight's
state says where its request is and who ends it:

    OUTSIDE ──sent──▶ INSIDE ──answered──▶ OUTSIDE          (its task holds it)
       │collected        │collected
       ▼                 ▼
    COLLECTED ──sent──▶ COLLECTED_INSIDE ──answered──▶ COLLECTED   (server_lost holds it)
    OUTSIDE, INSIDE ──lost──▶ LOST                                 (dropped silently)
    any ──settled──▶ SETTLED

Its task holds it while it is OUTSIDE or INSIDE (a cancel hands it back; a task cancelled before its
first step never runs, and the dispatcher's reaper hands its prompt back and frees its slot); `Takeback.server_lost`
takes it over (COLLECTED...: struck if inside, else handed back); a lapsed lease or a cancelled run
drops it (LOST); its outcome, or its hand back, ends it (SETTLED). Each transition is a method; one
that does not apply keeps the state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

from batchfleet.records import Prompt

from .ledger import Claim, ClaimKind

__all__ = ["Board", "Flight", "FlightState", "Tally"]


class FlightState(Enum):
    OUTSIDE = "outside"  # nothing of it in the server: not sent yet, answered, or the request never reached it
    INSIDE = "inside"  # its request is (or may still be) inside the server: a death strikes it
    COLLECTED = "collected"  # taken over by `server_lost`, nothing inside: handed back
    COLLECTED_INSIDE = "collected_inside"  # taken over by `server_lost`, inside: struck
    LOST = "lost"  # its lease lapsed (another worker requeued it) or its run was cancelled: dropped
    SETTLED = "settled"  # its outcome is written (or it was handed back): nothing left to do

    # Transitions compare members by identity with module-level aliases: `sent` runs for every
    # request, and an identity test is the cheapest comparison there is.
    def sent(self) -> FlightState:
        if self is _OUTSIDE:
            return _INSIDE
        return _COLLECTED_INSIDE if self is _COLLECTED else self

    def answered(self) -> FlightState:
        """The server answered: it holds nothing of this prompt."""
        if self is _INSIDE:
            return _OUTSIDE
        return _COLLECTED if self is _COLLECTED_INSIDE else self

    def unsent(self, earlier: FlightState) -> FlightState:
        """This attempt never reached the server; an earlier one (in state `earlier`) may have."""
        return self if earlier.inside else self.answered()

    def collected(self) -> FlightState:
        if self is _OUTSIDE:
            return _COLLECTED
        return _COLLECTED_INSIDE if self is _INSIDE else self

    def lost(self) -> FlightState:
        return _LOST if self is _OUTSIDE or self is _INSIDE else self

    @property
    def inside(self) -> bool:
        return self is _INSIDE or self is _COLLECTED_INSIDE

    @property
    def held_by_task(self) -> bool:
        """Its task ends it: cancelled, the task hands it back."""
        return self is _OUTSIDE or self is _INSIDE


_OUTSIDE, _INSIDE = FlightState.OUTSIDE, FlightState.INSIDE
_COLLECTED, _COLLECTED_INSIDE = FlightState.COLLECTED, FlightState.COLLECTED_INSIDE
_LOST, _SETTLED = FlightState.LOST, FlightState.SETTLED


@dataclass(slots=True, eq=False)
class Flight:
    """One claimed job while this worker holds it."""

    claim: Claim
    prompt: Prompt | None = None
    attempts: int = 0
    state: FlightState = FlightState.OUTSIDE
    sent_at: float = 0.0  # time.monotonic() when its request was last sent
    rid: str = ""  # the SGLang request id of its latest request: `<job id>-<session>-<attempt>`
    failed_epoch: int | None = None  # the breaker's epoch at its last failed attempt
    uncounted: int = 0  # attempts that did not count (the server was at fault)
    holds_slot: bool = True  # one of the in-flight slots, except while it waits to retry

    @property
    def settled(self) -> bool:
        return self.state is _SETTLED

    def settle(self) -> None:
        self.state = _SETTLED


@dataclass(slots=True)
class Tally:
    """What became of the prompts this worker claimed (the worker's figures, and its last log line)."""

    done: int = 0
    failed: int = 0
    refused: int = 0
    handed_back: int = 0
    struck: int = 0
    quarantined: int = 0
    dropped: int = 0  # in-flight prompts dropped because the run (or their batch) was cancelled
    sick_handed_back: int = 0  # prompts handed back uncounted because the server was at fault


class Board:
    """The prompts in this worker's hands: each claimed prompt's task and its flight; the group of
    suspects it runs (one group at a time), and the prompt running alone, if any."""

    def __init__(self) -> None:
        self.tasks: dict[asyncio.Task[None], Flight] = {}
        self.group: set[asyncio.Task[None]] = set()
        self.solo: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def add(self, task: asyncio.Task[None], flight: Flight) -> None:
        self.tasks[task] = flight
        kind = flight.claim.kind
        if kind is ClaimKind.SUSPECT:
            self.group.add(task)
        elif kind is ClaimKind.SOLO:
            self.solo = task

    def remove(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)
        self.group.discard(task)
        if task is self.solo:
            self.solo = None

    def open(self) -> list[tuple[asyncio.Task[None], Flight]]:
        """(task, flight) of every prompt not settled yet."""
        return [(t, f) for t, f in self.tasks.items() if not f.settled]

    def settled(self, task: asyncio.Task[None]) -> bool:
        """Its flight has ended (its task may still be writing its hand back)."""
        flight = self.tasks.get(task)
        return flight is not None and flight.settled
