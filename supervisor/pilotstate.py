"""What the autopilot remembers between windows (`PilotState`), and the phases of its state machine.
The state is stored in Redis (`Keys.autopilot`) as one JSON object, so a restarted supervisor carries
on where it was."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from batchfleet.records import RecordError, ServerSpec, decode

from .classify import ServerView

__all__ = ["Phase", "PilotState"]


class Phase(StrEnum):
    OBSERVING = "observing"
    CANARY = "canary"
    ROLLING_OUT = "rolling_out"
    VERIFYING = "verifying"


@dataclass
class PilotState:
    """Everything the autopilot remembers. Its JSON is what a supervisor of another version reads back:
    fields are added, never renamed."""

    phase: str = Phase.OBSERVING
    stall: int = 0
    stall_since: float = 0.0
    fleet_tps: list[float] = field(default_factory=list)  # recent windows' fleet tokens/s, newest last
    server_tps: list[float] = field(default_factory=list)  # recent windows' per-server mean tokens/s
    baseline: dict[str, Any] | None = None  # ServerSpec before the change
    target: dict[str, Any] | None = None  # ServerSpec being tried
    predicted: float = 1.0
    bar: float = 0.2  # the canary's margin on this try
    canary: str = ""  # its queue
    canary_label: str = ""  # gpuN, for people
    phase_since: float = 0.0
    progress_since: float = 0.0
    served_since: float = 0.0  # the canary (or the fleet, verifying) first seen serving the target; 0: not yet
    measured: list[list[float]] = field(default_factory=list)  # [seconds, canary or fleet rate, peers' rate]
    confounded: str = ""  # why the last window was not measured
    baseline_capacity: float = 0.0
    before_tps: float = 0.0  # fleet tokens/s in the stalled windows; once a canary gained, its peers' x servers
    before_server_tps: float = 0.0  # per server; once a canary gained, its peers' steady rate beside it
    decide_s: float = 0.0
    rolled: list[str] = field(default_factory=list)  # queues given the target
    tried: dict[str, dict[str, Any]] = field(default_factory=dict)  # spec_key -> tries, until, bar, why
    restart_costs: list[float] = field(default_factory=list)  # learned: downtime + time to fill, seconds
    canary_restart: dict[str, float] = field(default_factory=dict)  # its restarted event: ts, downtime_s
    notes: dict[str, str] = field(default_factory=dict)  # last diagnosis per topic: say things once
    classes: dict[str, str] = field(default_factory=dict)  # last window's class per worker (for watch)
    control: dict[str, str] = field(default_factory=dict)  # control fields we last wrote (restored after data loss)
    shape: str = ""  # the canary's shape: the change is measured, rolled out and verified among that shape
    recalled: bool = False  # the fleet's memory is not to be consulted (again) in this run (see `recall`)
    consulted: list[str] = field(default_factory=list)  # queues whose servers the memory was consulted for
    # queues the change in progress is not for: the prefix plan predicts other work there, for which
    # another rung (or none) is best; they keep their spec, and the change stays per queue
    keep: list[str] = field(default_factory=list)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> PilotState:
        """The stored state; fields of another version are ignored, a state that does not decode is
        started over (said once by the caller) rather than stopping the supervisor."""
        if not raw:
            return cls()
        try:
            return decode(cls, orjson.loads(raw))
        except (RecordError, orjson.JSONDecodeError):
            return cls()

    @property
    def target_spec(self) -> ServerSpec:
        return ServerSpec(**self.target or {})

    @property
    def baseline_spec(self) -> ServerSpec:
        return ServerSpec(**self.baseline or {})

    @property
    def measured_s(self) -> float:
        return sum(m[0] for m in self.measured)

    def of_shape(self, v: ServerView) -> bool:
        """`v` is of the shape the change in progress is about (any, for a state stored without a shape),
        and not one it keeps off the change (`keep`)."""
        return (not self.shape or v.shape == self.shape) and v.queue not in self.keep

    def back_to_observing(self) -> None:
        """The change is over (verified, rolled back or given up): watch again from a clean stall count."""
        self.phase, self.stall, self.canary, self.rolled = Phase.OBSERVING, 0, "", []
        self.measured, self.served_since, self.confounded, self.canary_restart = [], 0.0, "", {}
        self.shape, self.keep = "", []
