"""The strategy ladder: which server configuration to try next, and what it should buy. Pure.

From the reference (SGLang 0.5.23, `allocation_sizing.py`): a hybrid server reserves this many
mamba state slots per running request, so for one memory budget the capacity is pool / slots:

    default (auto -> extra_buffer with the overlap schedule) 5 -> no_buffer 3 -> radix cache off 1

The no_buffer rung also raises `--mem-fraction-static` and sets a `--max-running-requests` ceiling
high enough not to bind. How much bigger the pools get is predicted from the memory figures the
workers publish (`ServerFacts`, read from the server's start-up log and `/server_info`), with
SGLang's sizing (reference §1):

    rest(mf)  = memory_before_load * mf - weights - lora - held      (held: activations, graphs; unknown)
    so rest(mf') = rest(mf) + memory_before_load * (mf' - mf), with rest(mf) = KV pool + mamba pool
    both pools are a fixed share of rest: pool' + 1 = (pool + 1) * rest' / rest, tokens' likewise
    cap'      = min(pool' // slots_per_request', tokens' // 2, --max-running-requests')

`lora` is a LoRA server's adapter pool (`model_executor/model_runner.py` allocates it after the
weights, before the KV cache is sized): `--max-loras-per-batch` slots x the pool's rank x, per layer
and target module, the A and B rows (`lora/mem_pool.py`; sglang_sim/lora.py `lora_pool_gb`), bf16: a
constant of the server's LoRA flags, which no rung changes, so it drops out of rest(mf') - rest(mf) and
the measured pools already exclude it. It makes a LoRA server another kind of server, though: its
shape says `+lora<N>` (worker/flags.py `server_shape`), so the fleet's memory keeps its verified spec
apart from the same GPU's without adapters, and its peers are LoRA servers with as many slots.
Without those figures (a worker that does not publish them) the prediction is the slot ratio alone.
The worker adds `--disable-overlap-schedule` where the server's version needs it. Radix off is only
proposed when the measured cache hit rate says prefix caching buys little.

**When the work reuses prefixes** (`Reuse`: the prefix plan's predicted share of prompt tokens the
servers' radix caches give, with the prompt and completion tokens per request) capacity is not all a
rung changes. In 0.5.23 `extra_buffer` (and `extra_buffer_lazy`, which reuses the same positions with
4 slots a request, not 5) keeps a mamba state where a request's prefix is shared, so later ones reuse
it; `no_buffer` keeps one only at a request's end, so prompts that share a prefix and differ after it
reuse nothing; radix off reuses nothing. Each rung is weighed by what a request costs its server:

    cost(rung) = prompt tokens x (1 - its reuse) x prefill_weight + completion tokens
    predicted ratio = capacity ratio x cost(now) / cost(rung)

`prefill_weight` is what one prefilled token costs beside one generated token of a request
(`--prefill-weight`, 0.05 by default: a prefill of ~10K tokens/s against a decode step of ~2 ms per
running request). Every allowed rung is weighed, `extra_buffer_lazy` among them (radix off stays the
step after `no_buffer`), the best kept; none better than now: no change, and the decision says what
the plan predicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from batchfleet.records import STRATEGIES, ServerFacts, ServerSpec, Strategy, WorkerState, WorkerStatus

__all__ = ["LADDER", "REUSES_SHARED_PREFIX", "SLOTS_PER_REQUEST", "LadderConfig", "Prediction", "Proposal", "Reuse",
           "current_spec", "next_rung", "predict_capacity", "spec_key"]

SLOTS_PER_REQUEST = {Strategy.DEFAULT: 5, Strategy.EXTRA_BUFFER: 5, Strategy.EXTRA_BUFFER_LAZY: 4,
                     Strategy.NO_BUFFER: 3, Strategy.NO_RADIX: 1}
# The rungs the autopilot climbs, cheapest change first.
LADDER = (Strategy.DEFAULT, Strategy.NO_BUFFER, Strategy.NO_RADIX)
# Which strategies reuse a prefix shared by prompts that differ after it (0.5.23; see the module doc).
REUSES_SHARED_PREFIX = {Strategy.DEFAULT: True, Strategy.EXTRA_BUFFER: True, Strategy.EXTRA_BUFFER_LAZY: True,
                        Strategy.NO_BUFFER: False, Strategy.NO_RADIX: False}


@dataclass(frozen=True, slots=True)
class LadderConfig:
    forbid: frozenset[Strategy] = frozenset()  # strategies this workload must not run (--forbid, --keep-prefix-cache)
    mem_fraction_static: float | None = 0.90  # raised together with the first rung up; None: leave it
    max_running_requests: int | None = 128  # a ceiling that should not bind; None: leave it
    max_cache_hit_rate: float = 0.10  # radix off only when prefix caching saves less than this share
    prefill_weight: float = 0.05  # a prefilled token's cost beside a generated one (`Reuse`, the module doc)

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
class Reuse:
    """What the work ahead reuses: the share of prompt tokens the radix cache gives (`hit`, the prefix
    plan's prediction, or what was measured), and a request's prompt and completion tokens."""

    hit: float
    prompt_tokens: float
    completion_tokens: float
    source: str = "the plan"  # where `hit` comes from, for people

    def cost(self, strategy: Strategy, weight: float) -> float:
        hit = self.hit if REUSES_SHARED_PREFIX.get(strategy, True) else 0.0
        return self.prompt_tokens * (1.0 - hit) * weight + self.completion_tokens


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
              cache_hit_rate: float | None = None, facts: ServerFacts | None = None,
              reuse: Reuse | None = None) -> Proposal:
    """The first rung above `current` that is allowed, not `failed` (keys in back-off, with why), and
    whose conditions hold; the predicted ratio comes from `facts` (one stalled server's) when given.
    With `reuse` (the work reuses prefixes), every such rung is weighed by what it keeps of the reuse
    too (module doc), `extra_buffer_lazy` among them, and the best one better than now is proposed."""
    failed = dict(failed) if isinstance(failed, Mapping) else {k: "was tried in this run and did not gain"
                                                               for k in failed}
    why_not: list[str] = []
    ladder = LADDER if reuse is None else (Strategy.DEFAULT, Strategy.EXTRA_BUFFER_LAZY, *LADDER[1:])
    rungs = [(target, predict_capacity(facts, current, target))
             for target in _rungs(current, cfg, ladder, failed, cache_hit_rate, why_not)]
    if not rungs:
        return Proposal(None, 1.0, why_not or [f"{current.strategy} is the top rung"])
    if reuse is None:
        target, pred = rungs[0]
        return Proposal(target, pred.ratio, [f"predicted capacity x{pred.ratio:.2f}: {pred.how}"])
    now = reuse.cost(current.strategy, cfg.prefill_weight)
    # radix off stays the last step, taken from no_buffer only, as on the ladder without a prediction
    steps = [(t, p) for t, p in rungs if t.strategy is not Strategy.NO_RADIX or current.strategy is Strategy.NO_BUFFER]
    weighed = [(pred.ratio * now / reuse.cost(target.strategy, cfg.prefill_weight), target, pred)
               for target, pred in steps or rungs[:1]]
    ratio, target, pred = max(weighed, key=lambda w: w[0])
    said = (f"{reuse.source} predicts {reuse.hit:.0%} of prompt tokens from the radix cache "
            f"({reuse.prompt_tokens:,.0f} prompt, {reuse.completion_tokens:,.0f} completion tokens a request, a "
            f"prefilled token weighed {cfg.prefill_weight:g} of a generated one)")
    weights = ", ".join(f"{t.strategy} x{r:.2f}" for r, t, _ in weighed)
    if ratio <= 1.0:
        return Proposal(None, 1.0, [f"{said}: no rung gains ({weights}): keeping {current.strategy}"])
    keeps = "keeps" if REUSES_SHARED_PREFIX.get(target.strategy, True) else "loses"
    return Proposal(target, ratio, [f"predicted x{ratio:.2f}: capacity x{pred.ratio:.2f} ({pred.how}); {said}; "
                                    f"{target.strategy} {keeps} that reuse ({weights})"])


def _rungs(current: ServerSpec, cfg: LadderConfig, ladder: Iterable[Strategy], failed: Mapping[str, str],
           cache_hit_rate: float | None, why_not: list[str]) -> list[ServerSpec]:
    """The rungs of `ladder` above `current` (fewer slots a request) that are allowed and not in
    back-off, in ladder order; why each other one is not, into `why_not`."""
    here = SLOTS_PER_REQUEST.get(current.strategy, 5)
    out = []
    for strategy in ladder:
        if SLOTS_PER_REQUEST[strategy] >= here:
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
        out.append(target)
    return out


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
