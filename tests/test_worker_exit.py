"""A stopped worker exits: RQ's pubsub thread cannot hold it.

redis-py 8.2 made `PubSubWorkerThread.stop()` join the thread with no timeout; with RQ's
`sleep_time=60` a SIGTERMed worker could hang for a minute after its "stopped" line (CI saw 11 tests
whose workers did not exit within 30 s). `GPUWorker.unsubscribe` bounds that wait."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

import pytest
import redis

from batchfleet.records import WorkerState

from .fleet import Fleet


def test_unsubscribe_returns_though_the_pubsub_thread_never_stops(r: redis.Redis) -> None:
    from worker import GPUWorker

    w = GPUWorker(["exit.gpu0"], connection=r)
    w.subscribe()  # RQ's: a real pubsub connection and thread
    never = threading.Event()
    w.pubsub_thread.stop = lambda *a, **k: never.wait()  # what redis-py 8.2's join can amount to
    done = threading.Event()
    threading.Thread(target=lambda: (w.unsubscribe(), done.set()), daemon=True).start()
    try:
        assert done.wait(GPUWorker.UNSUBSCRIBE_WAIT_S + 5), "unsubscribe did not return"
        assert r.pubsub_numsub(w.pubsub_channel_name)[0][1] == 0  # RQ's UNSUBSCRIBE itself was sent
    finally:
        never.set()  # the helper ends; RQ's pubsub thread is a daemon and ends on its own


@pytest.mark.slow
def test_sigtermed_workers_exit_0_promptly_start_after_start(fleets, tmp_path: Path) -> None:
    """Three rounds of two real `rq worker`s: each SIGTERM ends the process with 0 within 15 s
    (a minute was possible before), each after RQ's unsubscribe line."""
    fleet: Fleet = fleets(run="exit", prefix="exit.", gpus=2)
    for _ in range(3):
        for g in range(2):
            fleet.start_worker(g)
        fleet.wait_for(lambda: sum(s.state is WorkerState.SERVING for s in fleet.statuses()) == 2, 60, "serving")
        for p in fleet.workers.values():
            p.send_signal(signal.SIGTERM)
        codes = {}
        for g, p in fleet.workers.items():
            try:
                codes[g] = p.wait(15)
            except subprocess.TimeoutExpired:
                codes[g] = None
        assert codes == {0: 0, 1: 0}
        fleet.wait_for(lambda: not fleet.statuses(), 10, "the stopped workers to forget their status")
    assert all(fleet.worker_log(g).count("unsubscribing from channel") == 3 for g in range(2))
