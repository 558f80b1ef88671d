"""The strategy ladder: which server configuration to try next, and what it should buy. Pure.

From the reference (SGLang 0.5.23, `allocation_sizing.py`): a hybrid server reserves this many
mamba state slots per running request, so for one memory budget the capacity is pool / slots:

    default (auto -> extra_buffer with the overlap schedule) 5 -> no_buffer 3 -> radix cache off 1

The no_buffer rung also raises `--mem-fraction-static` (a bigger pool; how much bigger depends on
memory the status records do not carry, so the prediction leaves it out: it is a bonus) and sets a
`--max-running-requests` ceiling high enough not to bind. The worker adds
`--disable-overlap-schedule` where the server's version needs it. Radix off is only proposed when
the measured cache hit rate says prefix caching buys little.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from batchfleet.config import STRATEGIES
from batchfleet.records import ServerSpec, WorkerStatus

__all__ = ["LADDER", "SLOTS_PER_REQUEST", "LadderConfig", "Proposal", "current_spec", "next_rung", "spec_key"]

SLOTS_PER_REQUEST = {"default": 5, "extra_buffer": 5, "extra_buffer_lazy": 4, "no_buffer": 3, "no_radix": 1}
LADDER = ("default", "no_buffer", "no_radix")  # the rungs the autopilot climbs, cheapest change first


@dataclass(frozen=True, slots=True)
class LadderConfig:
    forbid: frozenset[str] = frozenset()  # strategies this workload must not run (CLI --forbid, --keep-prefix-cache)
    mem_fraction_static: float | None = 0.90  # raised together with the first rung up; None: leave it
    max_running_requests: int | None = 128  # a ceiling that should not bind; None: leave it
    max_cache_hit_rate: float = 0.10  # radix off only when prefix caching saves less than this share

    def __post_init__(self) -> None:
        unknown = set(self.forbid) - set(STRATEGIES)
        if unknown:
            raise ValueError(f"cannot forbid unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")


@dataclass(frozen=True, slots=True)
class Proposal:
    """The next rung (generation 0: the caller numbers it), or None with the reasons why not."""

    target: ServerSpec | None
    ratio: float = 1.0  # predicted capacity ratio, target / current
    reasons: list[str] = field(default_factory=list)


def spec_key(spec: ServerSpec) -> str:
    """What identifies a change regardless of its generation number (for 'tried and failed')."""
    return f"{spec.strategy}|{spec.mem_fraction_static}|{spec.max_running_requests}"


def next_rung(current: ServerSpec, cfg: LadderConfig, *, failed: Iterable[str] = (),
              cache_hit_rate: float | None = None) -> Proposal:
    """The first rung above `current` that is allowed, not tried and failed, and whose conditions hold."""
    failed = set(failed)
    here = SLOTS_PER_REQUEST.get(current.strategy, 5)
    why_not = []
    for strategy in LADDER:
        slots = SLOTS_PER_REQUEST[strategy]
        if slots >= here:
            continue
        if strategy in cfg.forbid:
            why_not.append(f"{strategy} is forbidden for this workload")
            continue
        if strategy == "no_radix":
            if cache_hit_rate is None:
                why_not.append("no_radix needs a measured cache hit rate")
                continue
            if cache_hit_rate >= cfg.max_cache_hit_rate:
                why_not.append(f"no_radix: prefix caching saves {cache_hit_rate:.0%} of prompt tokens "
                               f"(>= {cfg.max_cache_hit_rate:.0%})")
                continue
        mem = current.mem_fraction_static
        if cfg.mem_fraction_static is not None and (mem is None or mem < cfg.mem_fraction_static):
            mem = cfg.mem_fraction_static
        ceiling = current.max_running_requests
        if cfg.max_running_requests is not None:
            ceiling = max(ceiling or 0, cfg.max_running_requests)
        target = ServerSpec(generation=0, strategy=strategy, mem_fraction_static=mem, max_running_requests=ceiling)
        if spec_key(target) in failed:
            why_not.append(f"{target.describe()} was tried in this run and did not gain")
            continue
        ratio = here / slots
        return Proposal(target, ratio, [f"{current.strategy} reserves {here} mamba slots per request, {strategy} "
                                        f"{slots}: capacity x{ratio:.2f} (more with the larger memory fraction)"])
    return Proposal(None, 1.0, why_not or [f"{current.strategy} is the top rung"])


def current_spec(fleet: ServerSpec | None, workers: Iterable[WorkerStatus]) -> ServerSpec:
    """What the fleet runs now: the fleet spec in Redis, else what the workers report (they start from
    their configuration, generation 0), read back from their server flags."""
    if fleet is not None:
        return fleet
    ws = [w for w in workers if w.state == "serving"] or list(workers)
    if not ws:
        return ServerSpec()
    strategies = [w.strategy for w in ws]
    w = next(x for x in ws if x.strategy == max(set(strategies), key=strategies.count))
    flags = w.server_flags

    def flag(name: str) -> str | None:
        return flags[flags.index(name) + 1] if name in flags and flags.index(name) + 1 < len(flags) else None

    mem, ceiling = flag("--mem-fraction-static"), flag("--max-running-requests")
    return ServerSpec(generation=w.generation, strategy=w.strategy,
                      mem_fraction_static=float(mem) if mem else None,
                      max_running_requests=int(ceiling) if ceiling else None)
