"""The window and the feed on their own: sizing, the drain meter, validated fleet records, dealing."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import redis

from batchfleet.config import Config
from batchfleet.keys import STATUS_TTL_S, Keys
from batchfleet.records import WorkerStatus
from producer.feed import DrainMeter, Feeder, read_fleet_view, window_target
from producer.store import Store


def test_window_target() -> None:
    c = Config(window_s=60, window_default=1000, window_max=20_000)
    assert window_target(c, 0, 0.0) == 1000  # nothing known yet
    assert window_target(c, 37, 0.0) == 74  # a worker reports, nothing finished yet: 2 x capacity
    assert window_target(c, 37, 10.0) == 600  # 60 s of 10 prompts/s
    assert window_target(c, 0, 0.5) == 30  # no worker of its own, drained by stealing
    assert window_target(c, 4096, 1e9) == 20_000  # capped whatever the figures say


def test_drain_meter_measures_per_queue_and_restarts_when_counters_go_back() -> None:
    m = DrainMeter(span_s=30)
    m.update({"succeeded:gpu0": 100, "failed:gpu0": 4, "succeeded:gpu1": 0, "succeeded": 104}, now=0.0)
    m.update({"succeeded:gpu0": 190, "failed:gpu0": 4, "succeeded:gpu1": 10, "succeeded": 204}, now=10.0)
    assert (m.rate("gpu0"), m.rate("gpu1"), m.rate("gpu9")) == (9.0, 1.0, 0.0)
    m.update({"succeeded:gpu0": 3}, now=11.0)  # Redis lost its counters
    assert m.rate("gpu0") == 0.0
    m.update({"succeeded:gpu0": 13}, now=13.0)
    assert m.rate("gpu0") == 5.0


def test_fleet_view_reads_only_sound_fresh_records(r: redis.Redis) -> None:
    k = Keys("t")
    # Fresh = the record exists (Redis expires it); "skewed" wrote with a clock an hour behind and counts,
    # "gone" stopped writing and its record expired.
    for name, queue, cap, skew in (("a", "gpu0", 37, 0), ("b", "gpu0", 5, 1), ("c", "gpu1", 9999, 0),
                                   ("skewed", "gpu2", 50, -3600), ("evil", "../x", 10, 0)):
        ws = WorkerStatus(worker=name, host="h", queue=queue, gpu=0, state="serving", effective_max=cap,
                          ts=time.time() + skew)
        r.set(k.status(name), ws.to_json(), ex=STATUS_TTL_S)
        r.sadd(k.workers, name)
    r.sadd(k.workers, "gone")
    r.set(k.status("junk"), b"{not json")
    r.sadd(k.workers, "junk")
    view = read_fleet_view(r, k)
    assert view.capacity == {"gpu0": 42, "gpu1": 4096, "gpu2": 50} and view.fresh == 4 and view.known == 7


def test_feed_deals_longest_first_over_the_short_queues(r: redis.Redis, tmp_path: Path) -> None:
    store = Store.create_or_open(tmp_path / "t.sqlite", run="t")
    with store.write():
        store.insert_prompts([(f"c{i}", 1, orjson.dumps({"prompt": "x", "max_tokens": i}), 1, i + 1, i, b"")
                              for i in range(1, 11)])
    feeder = Feeder(Config(run="t"), r, store)
    out = feeder.feed({"gpu0": 3, "gpu1": 1, "gpu2": 0})
    assert out.fed == {"gpu0": 3, "gpu1": 1, "gpu2": 0} and out.total == 4
    cost = {q: [orjson.loads(r.hget(Keys.job(j.decode()), "data"))[2][0]["body"]["max_tokens"]
                for j in r.lrange(Keys.queue(q), 0, -1)] for q in ("gpu0", "gpu1")}
    assert cost == {"gpu0": [10, 8, 7], "gpu1": [9]}
    # top_up counts what a queue holds already
    out = feeder.top_up({"gpu0": 5, "gpu1": 1})
    assert out.fed == {"gpu0": 2, "gpu1": 0}
    assert store.counts()["fed"] == 6 and store.counts()["waiting"] == 4
