"""One fleet, many tenants: which input the head feeds next (`FairShare`), in a store whose inputs have
owners (`batchfleet serve`'s batches: `Store.shares`).

The rule, in the order it is applied:

- **Priority first.** `high` (0) before `normal` (1) before `low` (2): an input of a class is fed only
  when no input of a higher class has prompts waiting. High prompts go to the front of the queues
  (`feed.Feeder`): the next slot that frees on any server takes one. Running requests are never aborted
  for them. Strict, with no aging: while high work waits in the store, normal and low get nothing new,
  and low runs only on capacity no high or normal work wants. So high starves normal and low, and normal
  starves low, for as long as it keeps coming: only a tenant the tenants file allows `high` can ask for
  it (batchapi/tenants.py), and low is asked by the batch that waits. Within a class nothing starves
  (below).
- **Within a class, fair share of output tokens by weight.** Each tenant's *usage* is the output tokens
  of its results, decayed with a half-life (`half_life_s`, 5 min), plus what its prompts in Redis are
  expected to generate (its mean completion tokens so far, measured from its results; before 10 results,
  their max_tokens, at most 4,096 each). The next chunk goes to the tenant with work whose usage divided
  by its weight is the smallest. So while several tenants have work, the fleet's output tokens go to
  them in proportion to their weights; a tenant with little work takes all it can use and the rest goes
  to the others (max-min: only tenants with prompts waiting are chosen).
- **A tenant that was idle** has a small usage (it decayed): it is fed first until its usage reaches the
  others'. A newcomer with a small batch runs as on an empty fleet; one that arrives with a huge batch
  after another ran for hours takes the whole fleet for at most one half-life, then shares by weight (the
  other's usage halves while the newcomer's climbs to meet it). A tenant with work is never starved:
  while it waits its usage decays towards 0 and every other's grows.
- **Within a tenant**: its inputs in creation order (an older batch is fed first), each in plan order.

The share is enforced at the feed, the one place that sees every tenant, on every host: a shared
fleet's Redis holds only a few seconds of work per queue (`feed.window_target`, `share_window_s`), so
what the servers run follows what is fed, through stealing too (a stolen prompt is still its tenant's).
No server idles for it: every queue's room is filled from whatever tenant has work.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .store import UNBOUNDED_COST, WaitingInput

__all__ = ["EXPECTED_MAX", "HIGH", "LOW", "NORMAL", "PRIORITIES", "FairShare", "Pick", "TenantUse"]

HIGH, NORMAL, LOW = 0, 1, 2
PRIORITIES = {"high": HIGH, "normal": NORMAL, "low": LOW}
EXPECTED_MAX = 4096  # a prompt without max_tokens is charged this much until its tenant's mean is known
SHARE_SPAN_S = 60.0  # "share now": the output tokens of the last minute


@dataclass(frozen=True, slots=True)
class Pick:
    """The next input to feed from."""

    input: WaitingInput
    front: bool  # high priority: to the front of the queues


@dataclass(slots=True)
class TenantUse:
    """What the feed knows of one tenant."""

    usage: float = 0.0  # output tokens of its results, decayed
    stamp: float = 0.0  # when `usage` was last decayed (monotonic)
    in_redis: int = 0  # prompts fed, no result collected yet
    fed_caps: float = 0.0  # sum of the fed prompts' max_tokens (capped): the guess before results
    fed: int = 0
    tokens: int = 0  # output tokens of its results so far (this head's)
    results: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, output tokens) of the last minute

    def mean(self) -> float:
        """Output tokens a prompt of this tenant is expected to generate."""
        if self.results >= 10:
            return self.tokens / self.results
        return self.fed_caps / self.fed if self.fed else float(EXPECTED_MAX)


@dataclass
class FairShare:
    half_life_s: float = 300.0
    tenants: dict[str, TenantUse] = field(default_factory=dict)

    def pick(self, waiting: Sequence[WaitingInput], weights: dict[str, float], now: float | None = None) -> Pick | None:
        """The input the next chunk comes from (`waiting` oldest first), or None when nothing waits."""
        if not waiting:
            return None
        now = time.monotonic() if now is None else now
        top = min(w.priority for w in waiting)
        candidates = [w for w in waiting if w.priority == top]
        tenant = min({w.tenant for w in candidates}, key=lambda t: (self.load(t, weights, now), t))
        first = next(w for w in candidates if w.tenant == tenant)
        return Pick(first, front=top == HIGH)

    def load(self, tenant: str, weights: dict[str, float], now: float | None = None) -> float:
        """The tenant's usage over its weight: the smallest is fed next."""
        t = self._get(tenant, time.monotonic() if now is None else now)
        return (t.usage + t.in_redis * t.mean()) / max(weights.get(tenant, 1.0), 1e-9)

    def charge(self, tenant: str, costs: Iterable[int]) -> None:
        """Fed to `tenant`: prompts of these expected costs (max_tokens; UNBOUNDED_COST without one)."""
        t = self._get(tenant)
        for cost in costs:
            t.in_redis += 1
            t.fed += 1
            t.fed_caps += cost if 0 < cost <= EXPECTED_MAX and cost != UNBOUNDED_COST else EXPECTED_MAX

    def observed(self, tenant: str, tokens: int, results: int, now: float | None = None) -> None:
        """Results of `tenant` collected: `results` of them, `tokens` output tokens in all."""
        now = time.monotonic() if now is None else now
        t = self._get(tenant, now)
        t.usage += tokens
        t.tokens += tokens
        t.results += results
        t.in_redis = max(0, t.in_redis - results)
        t.recent.append((now, tokens))
        while t.recent and t.recent[0][0] < now - SHARE_SPAN_S:
            t.recent.popleft()

    def in_redis(self, tenant: str, n: int) -> None:
        """A head that starts finds `n` of the tenant's prompts fed before it (no result yet)."""
        self._get(tenant).in_redis = n

    def shares(self, now: float | None = None) -> dict[str, float]:
        """Each tenant's part of the output tokens of the last minute."""
        now = time.monotonic() if now is None else now
        got = {name: sum(n for at, n in t.recent if at >= now - SHARE_SPAN_S) for name, t in self.tenants.items()}
        total = sum(got.values())
        return {name: (n / total if total else 0.0) for name, n in got.items()}

    def _get(self, tenant: str, now: float | None = None) -> TenantUse:
        """The tenant's record, its usage decayed to `now` (when given)."""
        t = self.tenants.get(tenant)
        if t is None:
            t = self.tenants[tenant] = TenantUse(stamp=time.monotonic() if now is None else now)
        elif now is not None and now > t.stamp:
            t.usage *= math.exp2(-(now - t.stamp) / self.half_life_s)
            t.stamp = now
        return t
