"""The strategy ladder: which server configuration to try next, and what it should buy. Pure.

From the reference (SGLang 0.5.23, `allocation_sizing.py`): a hybrid server reserves this many
mamba state slots per running request, so for one memory budget the capacity is pool / slots:

    default (auto -> extra_buffer with the overlap schedule) 5 -> no_buffer 3 -> radix cache off 1

The no_buffer rung also raises `--mem-fraction-static` and sets a `--max-running-requests` ceiling
high enough not to bind. How much bigger the pools get is predicted from the memory figures the
workers publish (`ServerFacts`, read from the server's start-up log and `/server_info`), with
SGLang's sizing (reference §1):

    rest(mf)  = memory_before_load * mf - weights - held      (held: activations, graphs; unknown)
    so rest(mf') = rest(mf) + memory_before_load * (mf' - mf), with rest(mf) = KV pool + mamba pool
    both pools are a fixed share of rest: pool' + 1 = (pool + 1) * rest' / rest, tokens' likewise
    cap'      = min(pool' // slots_per_request', tokens' // 2, --max-running-requests')

Without those figures (a worker that does not publish them) the prediction is the slot ratio alone.
The worker adds `--disable-overlap-schedule` where the server's version needs it. Radix off is only
proposed when the measured cache hit rate says prefix caching buys little.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from batchfleet.records import STRATEGIES, ServerFacts, ServerSpec, Strategy, WorkerState, WorkerStatus

__all__ = ["LADDER", "SLOTS_PER_REQUEST", "LadderConfig", "Prediction", "Proposal", "current_spec", "next_rung",
           "predict_capacity", "spec_key"]

SLOTS_PER_REQUEST = {Strategy.DEFAULT: 5, Strategy.EXTRA_BUFFER: 5, Strategy.EXTRA_BUFFER_LAZY: 4,
                     Strategy.NO_BUFFER: 3, Strategy.NO_RADIX: 1}
# The rungs the autopilot climbs, cheapest change first.
LADDER = (Strategy.DEFAULT, Strategy.NO_BUFFER, Strategy.NO_RADIX)


@dataclass(frozen=True, slots=True)
class LadderConfig:
    forbid: frozenset[Strategy] = frozenset()  # strategies this workload must not run (--forbid, --keep-prefix-cache)
    mem_fraction_static: float | None = 0.90  # raised together with the first rung up; None: leave it
    max_running_requests: int | None = 128  # a ceiling that should not bind; None: leave it
    max_cache_hit_rate: float = 0.10  # radix off only when prefix caching saves less than this share

    def __post_init__(self) -> None:
        unknown = set(self.forbid) - set(STRATEGIES)
        if unknown:
            raise ValueError(f"cannot forbid unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
        object.__setattr__(self, "forbid", frozenset(Strategy(s) for s in self.forbid))  # members, given strings


@dataclass(frozen=True, slots=True)
class Prediction:
    capacity: int | None  # predicted effective max running requests on the target (None: no figures)
    ratio: float  # predicted capacity, target / now
    how: str  # what the prediction rests on, for people


def predict_capacity(facts: ServerFacts | None, current: ServerSpec, target: ServerSpec) -> Prediction:
    """The target's capacity from one server's start-up facts (see the module docstring)."""
    here = SLOTS_PER_REQUEST.get(current.strategy, 5)
    there = SLOTS_PER_REQUEST.get(target.strategy, 5)
    fallback = Prediction(None, here / there, f"{current.strategy} reserves {here} mamba slots per request, "
                                              f"{target.strategy} {there}")
    if facts is None or not facts.mamba_pool or not facts.effective_max_running:
        return fallback
    pool, tokens = facts.mamba_pool, facts.max_total_num_tokens
    scale, how = 1.0, f"pool {pool} / {there} per request"
    mf_now, mf_new = facts.mem_fraction_static, target.mem_fraction_static
    rest = (facts.kv_gb or 0.0) + (facts.mamba_gb or 0.0)
    if mf_new is not None and mf_now is not None and mf_new != mf_now and facts.memory_before_load_gb and \
            facts.kv_gb is not None and facts.mamba_gb is not None and rest > 0:
        scale = max(0.0, rest + facts.memory_before_load_gb * (mf_new - mf_now)) / rest
        how = (f"mem {mf_now:g} -> {mf_new:g} grows the pools x{scale:.2f} ({rest:.1f} -> {rest * scale:.1f} GB of "
               f"{facts.memory_before_load_gb:.1f} GB)")
    elif mf_new is not None and mf_new != mf_now:
        how += " (the memory fraction's gain is not predicted: no memory figures)"
    if target.strategy is Strategy.NO_RADIX:
        # Radix off: the pool is sized to --max-running-requests when given, one slot per request.
        new_pool = target.max_running_requests or int((pool + 1) * scale - 1)
    else:
        new_pool = int((pool + 1) * scale - 1)
    caps = [new_pool // there]
    if tokens and facts.kv_gb and facts.mamba_gb is not None:
        # The KV pool gets what the mamba pool leaves: a bigger pool (radix off) shrinks it.
        slot_gb, token_gb = facts.mamba_gb / (pool + 1), facts.kv_gb / tokens
        caps.append(max(0, int((rest * scale - (new_pool + 1) * slot_gb) / token_gb)) // 2)
    elif tokens:
        caps.append(int(tokens * scale) // 2)
    if target.max_running_requests:
        caps.append(target.max_running_requests)
    capacity = max(0, min(caps))
    cap_now = facts.effective_max_running
    return Prediction(capacity, capacity / cap_now if cap_now else fallback.ratio,
                      f"{cap_now} -> {capacity} slots: {how}")


@dataclass(frozen=True, slots=True)
class Proposal:
    """The next rung (generation 0: the caller numbers it), or None with the reasons why not."""

    target: ServerSpec | None
    ratio: float = 1.0  # predicted capacity ratio, target / current
    reasons: list[str] = field(default_factory=list)


def spec_key(spec: ServerSpec) -> str:
    """What identifies a change regardless of its generation number (for 'tried and failed')."""
    return f"{spec.strategy}|{spec.mem_fraction_static}|{spec.max_running_requests}"


def next_rung(current: ServerSpec, cfg: LadderConfig, *, failed: Mapping[str, str] | Iterable[str] = (),
              cache_hit_rate: float | None = None, facts: ServerFacts | None = None) -> Proposal:
    """The first rung above `current` that is allowed, not `failed` (keys in back-off, with why), and
    whose conditions hold; the predicted ratio comes from `facts` (one stalled server's) when given."""
    failed = dict(failed) if isinstance(failed, Mapping) else {k: "was tried in this run and did not gain"
                                                               for k in failed}
    here = SLOTS_PER_REQUEST.get(current.strategy, 5)
    why_not = []
    for strategy in LADDER:
        slots = SLOTS_PER_REQUEST[strategy]
        if slots >= here:
            continue
        if strategy in cfg.forbid:
            why_not.append(f"{strategy} is forbidden for this workload")
            continue
        if strategy is Strategy.NO_RADIX:
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
            why_not.append(f"{target.describe()} {failed[spec_key(target)]}")
            continue
        pred = predict_capacity(facts, current, target)
        return Proposal(target, pred.ratio, [f"predicted capacity x{pred.ratio:.2f}: {pred.how}"])
    return Proposal(None, 1.0, why_not or [f"{current.strategy} is the top rung"])


def current_spec(fleet: ServerSpec | None, workers: Iterable[WorkerStatus]) -> ServerSpec:
    """What the fleet runs now: the fleet spec in Redis, else what the workers report (they start from
    their configuration, generation 0), read back from their server flags."""
    if fleet is not None:
        return fleet
    ws = [w for w in workers if w.state is WorkerState.SERVING] or list(workers)
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
