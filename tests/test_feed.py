"""The window and the feed on their own: sizing, the drain meter, dealing (the fleet records they size on:
test_fleetview.py)."""

from __future__ import annotations

from pathlib import Path

import orjson
import redis

from batchfleet.config import Config
from batchfleet.keys import Keys
from producer.feed import DrainMeter, Feeder, window_target
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


def test_feed_deals_longest_first_over_the_short_queues(r: redis.Redis, tmp_path: Path) -> None:
    store = Store.create_or_open(tmp_path / "t.sqlite", run="t")
    with store.write():
        store.insert_prompts([(f"c{i}", 1, orjson.dumps({"prompt": "x", "max_tokens": i}), 1, i + 1, i, b"", None)
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
