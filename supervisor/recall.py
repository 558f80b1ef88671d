"""The fleet's memory, recalled: each server once per run, as soon as it serves and has said what it
is, starts on the spec an earlier run verified as best for its kind (model, GPU, SGLang version,
shape), if any and if its worker did not already start on it (`memory.py` says how entries are kept).
Not a canary (it was verified): the autopilot goes on watching and may move again. Pure."""

from __future__ import annotations

from dataclasses import replace

from batchfleet.records import EventKind

from .actions import Action, Control, Outbox, SetFleet, SetOverride
from .classify import SILENT, WindowReport
from .ladder import spec_key
from .memory import Remembered, describe_field, memory_field, remembered_data
from .pilotstate import PilotState

__all__ = ["recall"]


def recall(st: PilotState, report: WindowReport, control: Control, memory: dict[str, Remembered], *,
           fresh_start: bool) -> list[Action]:
    """The actions that start the servers new in `report` on what `memory` holds for their kind."""
    out = Outbox(st.notes)
    if st.recalled:
        return []
    if not st.consulted and (fresh_start or control.fleet is not None or control.overrides):
        st.recalled = True  # asked to start fresh, or this run's control already says what to run
        if fresh_start:
            out.emit(EventKind.DECISION, "fresh start: the fleet's memory of earlier runs is not used")
        return out.actions
    present = [v for v in report.servers if v.cls != SILENT]
    new = [v for v in present if v.serving and v.facts is not None and v.queue not in st.consulted]
    if not new:
        return []
    first = not st.consulted
    st.consulted = [*st.consulted, *(v.queue for v in new)]
    fields = {v.queue: memory_field(v) for v in new}
    found = {q: memory[f] for q, f in fields.items() if f is not None and f in memory}
    mine = {v.queue: spec_key(v.spec or control.current) for v in new}  # what each runs
    moved = {q: e for q, e in found.items() if spec_key(e.spec) != mine[q]}
    if moved:
        _move(out, control, moved, fields, whole_fleet=first and len(moved) == len(present))
    elif found:
        entry = next(iter(found.values()))
        out.emit(EventKind.DECISION, f"the fleet's memory: {len(found)} server(s) already run "
                 f"{entry.spec.describe()}, which run {entry.run or '?'} verified as best (their workers "
                 "started on it)", recalled=True, remembered={q: remembered_data(e) for q, e in found.items()})
    return out.actions


def _move(out: Outbox, control: Control, moved: dict[str, Remembered], fields: dict[str, str | None], *,
          whole_fleet: bool) -> None:
    """Write the remembered specs: the fleet's spec when every server of a fresh fleet moves to the same
    one, else per-queue overrides; one event names the run that verified it."""
    gen = control.next_generation()
    entry = next(iter(moved.values()))
    where = "; ".join(sorted({describe_field(fields[q] or "") for q in moved}))
    if whole_fleet and len({spec_key(e.spec) for e in moved.values()}) == 1:
        spec = replace(entry.spec, generation=gen)
        out.add(SetFleet(spec))
        what = f"the fleet -> {spec.describe()} (generation {gen})"
    else:
        for q, e in sorted(moved.items()):
            out.add(SetOverride(q, replace(e.spec, generation=gen)))
        what = ", ".join(f"{q} -> {e.spec.describe()}" for q, e in sorted(moved.items())) + f" (generation {gen})"
    ratio = f", verified x{entry.ratio:.2f} per server" if entry.ratio else ""
    out.emit(EventKind.DECISION, f"the fleet's memory: run {entry.run or '?'} verified {entry.spec.describe()} "
             f"as best{ratio} for {where}; starting on it: {what} (--fresh-start ignores this)",
             remembered={q: remembered_data(e) for q, e in moved.items()}, recalled=True, generation=gen)

