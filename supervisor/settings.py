"""What the operator tells the autopilot (`supervisor watch` options): how long to watch before acting,
what a change must gain to be kept, how fast it is rolled out and how long each phase may take."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    windows: int = 3  # consecutive mamba-bound windows (most serving servers) when only gauges say so
    static_windows: int = 1  # ... when the servers' start-up facts say their mamba pool caps them
    dry_run: bool = False
    # One server's restart cost, an override (`--restart-cost`) until the canary measured one; None:
    # the median of what the workers of the canary's shape measured (start + drain), else ASSUMED_COST_S.
    restart_cost_s: float | None = None
    fresh_start: bool = False  # ignore the fleet's memory (`--fresh-start`)
    worth_factor: float = 2.0  # the time saved must exceed the restart cost this many times
    margin: float = 0.2  # the canary must beat its peers' tokens/s by this share (first try)
    margin_step: float = 0.1  # each rollback of a rung that did not gain raises its bar by this
    verify_windows: int = 2  # windows of steady measurement for the canary and after the rollout
    rollout_batch: int = 2  # servers restarting at once during the rollout
    phase_timeout_s: float = 900.0  # canary to serve and measure, rollout progress, verification
    retry_after_s: float = 600.0  # back-off before a rolled-back rung is tried again (doubles per failure)
