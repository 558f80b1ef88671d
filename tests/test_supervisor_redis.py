"""The supervisor rides out a Redis outage (issue 7 §3): a real redis-server stopped for over a minute
and started again without its data, under a real `supervisor watch` process. One line when Redis is
lost, one when it is back; the process never exits; its state (the canary it started, the rung it
backs off from) is written back from memory."""

from __future__ import annotations

import contextlib
import threading
import time

import orjson
import pytest
import redis

from batchfleet.keys import Keys
from batchfleet.records import ServerMetrics, ServerSpec, WorkerStatus
from bench.bench_seed import SupervisorProc

from .conftest import RedisServer
from .fleet import Fleet
from .test_supervisor_core import SEED

pytestmark = pytest.mark.slow

OUTAGE_S = 62


class FakeWorkers:
    """Two workers' status records, republished twice a second while Redis answers (as workers do)."""

    def __init__(self, url: str, k: Keys) -> None:
        self.r = redis.Redis.from_url(url, socket_timeout=2)
        self.k = k
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.time()

    def publish(self) -> None:
        t = time.time()
        pipe = self.r.pipeline()
        for g in range(2):
            w = WorkerStatus(worker=f"host.gpu{g}.{100 + g}", host="host", queue=f"gpu{g}", gpu=g, state="serving",
                             effective_max=37, slots=37, in_flight=37, tokens_per_s=560, facts=SEED, ts=t,
                             metrics=ServerMetrics(running=37, queued=0, full_kv_usage=0.05, mamba_usage=0.69,
                                                   gen_throughput=560, generation_tokens_total=560 * (t - self.t0),
                                                   ts=t))
            pipe.set(self.k.status(w.worker), w.to_json())
            pipe.sadd(self.k.workers, w.worker)
            pipe.sadd("rq:queues", f"rq:queue:gpu{g}")
            if not self.r.exists(f"rq:queue:gpu{g}"):
                pipe.rpush(f"rq:queue:gpu{g}", *[f"j{i}" for i in range(5000)])
        pipe.hset(self.k.stats, mapping={"succeeded": 1000, "completion_tokens": 500_000})
        pipe.execute()

    def _run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, OSError):
                self.publish()
            time.sleep(0.5)

    def __enter__(self) -> FakeWorkers:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def test_the_supervisor_rides_out_a_redis_outage_and_keeps_its_state(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    fleet = Fleet(tmp_path, server.url, gpus=2, prefix="")  # its own redis-server; FakeWorkers serve gpuN
    k = fleet.k
    # A rung rolled back earlier in this run: the supervisor must still remember it after the outage.
    fleet.r.set(k.autopilot, orjson.dumps({"tried": {"no_radix|0.9|128": {"tries": 1, "bar": 0.3,
                                                                           "until": time.time() + 3600,
                                                                           "why": "did not gain"}}}))
    sup = None
    try:
        with FakeWorkers(server.url, k):
            sup = SupervisorProc(fleet, "--window", "1", "--sample", "0.5", "--restart-cost", "1")
            sup.wait_event("decision", 30, match="canary")  # it starts a canary on gpu0
            fleet.wait_for(lambda: fleet.r.hexists(k.control, Keys.control_queue("gpu0")), 10, "the canary override")
            canary_spec = fleet.r.hget(k.control, Keys.control_queue("gpu0"))
            server.stop()
            stopped = time.monotonic()
            fleet.wait_for(lambda: "lost Redis" in sup.output(), 30, "the supervisor to notice")
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))  # the outage itself: a minute
            assert sup.proc.poll() is None, sup.output()
            server.start()  # same port, no persistence: everything is gone
            fleet.wait_for(lambda: "is back" in sup.output(), 30, "the supervisor to see Redis back")
            fleet.wait_for(lambda: fleet.r.exists(k.autopilot), 10, "the state written back")
            state = orjson.loads(fleet.r.get(k.autopilot))
            control = fleet.r.hgetall(k.control)
            # A few more samples (each one a pass that would say it if Redis looked lost): no more lines
            # about Redis. The history started over with Redis's data.
            fleet.wait_for(lambda: fleet.r.xlen(k.history) >= 4, 30, "four more samples")
            out = sup.output()
    finally:
        if sup is not None:
            sup.stop()
        server.stop()
    assert out.count("lost Redis") == 1 and out.count("is back") == 1, out
    assert "restoring it from memory" in out
    assert state["phase"] == "canary" and state["canary"] == "gpu0"
    assert "no_radix|0.9|128" in state["tried"]
    assert control == {Keys.control_queue("gpu0").encode(): canary_spec}
    assert ServerSpec.from_json(canary_spec).strategy == "no_buffer"
    assert "Traceback" not in out
