"""The autopilot's state machine. Pure: it gets one classified window at a time (and the events seen
since the last one) and answers with actions (write a spec, drop stale overrides, emit an event);
`run.py` applies them to Redis.

    observing ──stalled (1 window on start-up facts, N on gauges), a rung, worth it──▶ canary
        ▲                                  (--dry-run: advice only)                       │
        │            ┌─────── gained (steady windows, same-window peers, bar) ────────────┘
        │            ▼                                     not gained / down / timed out (back-off)
        │       rolling_out ── a few at a time; absent workers do not block; timeout: carry on
        │            ▼
        └──── verifying ── steady windows after every server filled; timeout: say so
        └──────────────── rolled back: the rung may be retried after a back-off, with a higher bar

**Steady windows only.** The canary is judged on samples taken after its worker filled it to its new
capacity, against its peers over the very same intervals (both feel the same CPU contention, the same
Redis); a window where the canary or every peer is not full is *confounded*: not measured, and the
autopilot measures longer rather than roll back. Rates are the servers' own generation counters over
those intervals (each worker's counter paired with its own clock).

**Stable identity.** Overrides are keyed by queue (`queue:<queue>`): a GPU's identity in the run,
which survives a worker killed and restarted under a new name. Generations only ever increase: the
canary and each rolled-out queue get an override with the new generation; when all present servers
serve it, the same spec becomes the fleet's and the overrides go. A rollback writes the old spec
under a newer generation to the queues that moved. Every phase has a timeout.

**Learned cost.** The worth-it test (time saved ≥ factor × one server's restart cost) prices a restart
at what the canary's restart measured (its downtime plus its time to fill again) once there is one,
before that at `--restart-cost` or what the workers measured.

The parts, one job each:

| module | job |
| --- | --- |
| `settings.py` | what the operator tells the autopilot (`Settings`) |
| `pilotstate.py` | what it remembers between windows, stored in Redis (`PilotState`), and its `Phase`s |
| `actions.py` | what it is given of the control hash (`Control`) and what it answers with (the actions) |
| `decision.py` | observing: the stall, the rung and its expected gain (where a workload prediction enters) |
| `pricing.py` | one server's restart cost and whether a change pays for it |
| `measure.py` | steady measurement of the canary against its peers, and of the moved fleet |
| `phases.py` | canary, rolling_out, verifying, and the rollback they may end in |
| `recall.py` | the fleet's memory of earlier runs, recalled as servers come up |

This module ties them: `Autopilot.step` learns from the events, diagnoses, drops stale overrides and
runs the step of the current phase.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from batchfleet.keys import Keys
from batchfleet.records import Event, EventKind

from .actions import Action, Control, DropFields, Emit, Outbox, Remember, SetFleet, SetOverride
from .classify import CLIENT_BOUND, DOWN, HUNG, KV_BOUND, SILENT, WindowReport
from .decision import Observing
from .ladder import LadderConfig
from .memory import Remembered
from .phases import CanaryPhase, PhaseStep, RollingOut, Verifying
from .pilotstate import Phase, PilotState
from .pricing import learn_canary_restart, price_restart
from .recall import recall
from .settings import Settings

__all__ = ["Action", "Autopilot", "Control", "DropFields", "Emit", "Phase", "PilotState", "Remember", "SetFleet",
           "SetOverride", "Settings"]

PROBLEMS = (CLIENT_BOUND, HUNG, DOWN, KV_BOUND, SILENT)  # worth a diagnosis line when a server enters one


class Autopilot:
    def __init__(self, settings: Settings, ladder: LadderConfig, state: PilotState | None = None) -> None:
        self.s = settings
        self.ladder = ladder
        self.state = state or PilotState()

    def step(self, report: WindowReport, control: Control, now: float,
             events: Sequence[Event] = ()) -> list[Action]:
        """One window: learn from events, diagnose, then advance the state machine."""
        st = self.state
        out = Outbox(st.notes)
        st.classes = {v.worker: str(v.cls) for v in report.servers}
        st.fleet_tps = [*st.fleet_tps, report.fleet_tokens_per_s][-max(self.s.windows, 3):]
        serving = report.serving
        st.server_tps = [*st.server_tps, statistics.fmean(v.tokens_per_s for v in serving) if serving else 0.0
                         ][-max(self.s.windows, 3):]
        learn_canary_restart(st, report, events)
        diagnose(report, out)
        drop_stale(st, report, control, out)
        self._phase(out).step(report, control, now)
        return out.actions

    def _phase(self, out: Outbox) -> PhaseStep:
        """The step of the current phase (observing, for a phase this version does not know)."""
        phases = {Phase.CANARY: CanaryPhase, Phase.ROLLING_OUT: RollingOut, Phase.VERIFYING: Verifying}
        step = phases.get(self.state.phase)
        return step(self.s, self.state, out) if step else Observing(self.s, self.ladder, self.state, out)

    def restart_cost_s(self, report: WindowReport | None = None, shape: str = "") -> float:
        return self.restart_cost(report, shape)[0]

    def restart_cost(self, report: WindowReport | None = None, shape: str = "") -> tuple[float, str]:
        """(one server's restart cost, where it comes from): see `pricing.price_restart`."""
        return price_restart(self.state.restart_costs, self.s.restart_cost_s, report, shape)

    def recall(self, report: WindowReport, control: Control, memory: dict[str, Remembered]) -> list[Action]:
        """Each server once per run, as soon as it serves and has said what it is: start it on the spec an
        earlier run verified as best for its kind, if any (see `recall.py`)."""
        return recall(self.state, report, control, memory, fresh_start=self.s.fresh_start)


def diagnose(report: WindowReport, out: Outbox) -> None:
    """One `diagnosis` event per server (and per slow host) when what there is to say about it changes."""
    for v in report.servers:
        problem = v.cls in PROBLEMS and not v.filling
        text = f"{v.label}: {v.cls}: {'; '.join(v.reasons)}" if problem else ""
        if v.outliers:
            text += ("; " if text else f"{v.label}: ") + "far from its peers: " + "; ".join(v.outliers)
        if not text:
            out.notes.pop(v.worker, None)
            continue
        key = "|".join([v.cls if problem else "", *(o.split(" ")[0] for o in v.outliers)])
        out.note(v.worker, key, EventKind.DIAGNOSIS, text, worker=v.worker, queue=v.queue, cls=str(v.cls),
                 reasons=v.reasons, outliers=v.outliers, ours=v.cls == CLIENT_BOUND)
    for host, why in report.hosts.items():
        out.note("host:" + host, "|".join(w.split(":")[0] for w in why), EventKind.DIAGNOSIS,
                 f"host {host}: slower than the other hosts: " + "; ".join(why), host=host, reasons=why)
    for topic in [t for t in out.notes if t.startswith("host:") and t[5:] not in report.hosts]:
        out.notes.pop(topic)


def drop_stale(st: PilotState, report: WindowReport, control: Control, out: Outbox) -> None:
    """Overrides for queues no worker serves any more (their records expired) and not part of the
    change in progress; per-worker-name overrides of workers that are gone."""
    live_queues = {v.queue for v in report.servers}
    live_workers = {v.worker for v in report.servers}
    busy = set(st.rolled) | ({st.canary} if st.phase != Phase.OBSERVING else set())
    stale = [Keys.control_queue(q) for q in control.overrides if q not in live_queues and q not in busy]
    stale += [Keys.control_worker(w) for w in control.legacy if w not in live_workers]
    if stale:
        out.add(DropFields(tuple(sorted(stale))))
        out.emit(EventKind.DECISION, f"removed {len(stale)} stale override(s) ({', '.join(sorted(stale))}): "
                 "no worker serves them any more", removed=sorted(stale))
