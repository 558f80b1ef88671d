"""batchfleet.backoff: the one back-off every retrying or polling loop uses."""

from __future__ import annotations

from batchfleet.backoff import backoff_s


def test_the_wait_doubles_per_failure_from_its_base_up_to_its_cap() -> None:
    assert [backoff_s(n, base_s=0.5, max_s=10.0) for n in range(8)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff_s(3, base_s=600.0) == 2400.0  # no cap: doubles on
    assert backoff_s(10_000, base_s=600.0) < float("inf")


def test_jitter_waits_between_half_and_all_of_the_wait() -> None:
    waits = [backoff_s(4, base_s=0.5, max_s=30.0, jitter=True) for _ in range(500)]
    assert all(2.0 <= w <= 4.0 for w in waits) and len(set(waits)) > 100
