"""The faults a ten-hour run meets, on the worker's side, each injected on real parts: a real
redis-server, real `rq worker` processes running our worker class, simulated SGLang servers over
HTTP. Every test asserts exact counts (results == prompts, none twice, none lost except exactly the
quarantined ones), uses its own run and queue names, and kills every process it started.

Figures worth reporting (recovery times) are printed; run with `-s` to see them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from batchfleet.keys import Keys
from batchfleet.records import job_id_for

from .fleet import Fleet, expected_text, text_of, write_prompts

pytestmark = pytest.mark.slow


@pytest.fixture
def fleets(tmp_path: Path, redis_url: str) -> Iterator[Callable[..., Fleet]]:
    """Make fleets whose processes are all killed when the test ends, pass or fail."""
    made: list[Fleet] = []

    def make(**kw: object) -> Fleet:
        fleet = Fleet(tmp_path, redis_url, **kw)  # type: ignore[arg-type]
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        fleet.kill_all()


def read_export(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def export(fleet: Fleet, tmp: Path) -> dict[str, dict]:
    out = tmp / "results.jsonl"
    fleet.producer("export", str(out))
    lines = read_export(out)
    by_id = {x["custom_id"]: x for x in lines}
    assert len(by_id) == len(lines), "a custom_id appears twice in the export"
    return by_id


def server_log(fleet: Fleet, gpu: int) -> str:
    path = fleet.tmp / "state" / "logs" / f"sglang-gpu{gpu}.log"
    return path.read_text(errors="replace") if path.exists() else ""


# --- 7.1: a prompt that crashes its server --------------------------------------------------------------
POISON = "POISON-7f3a"


def test_a_poison_prompt_is_quarantined_after_three_server_deaths_and_no_bystander_fails(tmp_path, fleets):
    n, more, gpus = 300, 90, 3
    fleet = fleets(run="poison", prefix="poison.", gpus=gpus, env={"SGLANG_SIM_CRASH_MARKER": POISON})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=48)
    bad = rows[91]
    bad["messages"][0]["content"] = f"Tell me about {POISON} please"
    (tmp_path / "prompts.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    t0 = time.monotonic()
    for g in range(gpus):
        fleet.start_worker(g)

    marks: dict[str, tuple[float, int]] = {}  # moment -> (seconds since start, prompts finished)

    def reached(total: int) -> Callable[[], bool]:
        def check() -> bool:
            s = fleet.stats()
            now, finished = time.monotonic() - t0, s.get("succeeded", 0) + s.get("failed", 0)
            if finished and "first_result" not in marks:
                marks["first_result"] = (now, finished)
            if s.get("server_deaths") and "first_death" not in marks:
                marks["first_death"] = (now, finished)
            if s.get("quarantined") and "quarantined" not in marks:
                marks["quarantined"] = (now, finished)
            return finished >= total
        return check

    fleet.wait_for(reached(n), 240, "every prompt to finish")
    marks["first_batch_done"] = (time.monotonic() - t0, n)
    assert fleet.stats()["server_deaths"] == 3
    # After the quarantine: a second batch runs on every GPU at full capacity, with no death.
    more_rows = write_prompts(tmp_path / "more.jsonl", more, max_tokens=48, start=n)
    fleet.producer("enqueue", "more.jsonl", "--queues", fleet.queues)
    marks["second_batch"] = (time.monotonic() - t0, n)
    fleet.wait_for(reached(n + more), 120, "the second batch")
    marks["all_done"] = (time.monotonic() - t0, n + more)
    statuses = fleet.statuses()
    assert fleet.stop_all() == {g: 0 for g in range(gpus)}
    assert len(statuses) == gpus and all(w.state == "serving" and w.effective_max == 12 for w in statuses)

    stats = fleet.stats()
    deaths = sum(server_log(fleet, g).count("an illegal memory access was encountered") for g in range(gpus))
    assert deaths == 3, f"{deaths} server deaths"
    assert stats["server_deaths"] == 3 and stats["quarantined"] == 1
    assert stats["succeeded"] == n + more - 1 and stats["failed"] == 1
    # Each death takes back at most what was in hand (capacity 12): strikes for those inside, the
    # rest back untouched; nothing cycled claim -> fail -> hand back while a server was down.
    assert stats.get("struck", 0) + stats.get("handed_back", 0) <= 3 * 12, stats

    by_id = export(fleet, tmp_path)
    all_rows = rows + more_rows
    assert sorted(by_id) == sorted(r["id"] for r in all_rows)  # results == prompts, exactly once each
    line = by_id[bad["id"]]
    assert line["error"]["code"] == "server_crash" and line["response"] is None
    assert "3 times" in line["error"]["message"] and "illegal memory access" in line["error"]["message"]
    assert "--- server log (tail) ---" in line["error"]["message"]
    for row in all_rows:
        if row is not bad:  # every bystander succeeded, with the right answer
            assert by_id[row["id"]]["error"] is None, by_id[row["id"]]
            assert text_of(by_id[row["id"]]["response"]["body"]) == expected_text(row)

    # Quarantined for good: in RQ's failed registry only, no strike count left, queued nowhere.
    jid = job_id_for("poison", bad["id"])
    k = Keys("poison")
    assert fleet.r.hget(Keys.job(jid), "status") == b"failed"
    assert fleet.r.hget(Keys.job(jid), "exc_info").startswith(b"server_crash: ")
    assert not fleet.r.hexists(k.strikes, jid)
    assert fleet.r.llen(k.suspects) == 0 and fleet.r.llen(k.isolate) == 0

    def rate(a: str, b: str) -> float:
        (t_a, n_a), (t_b, n_b) = marks[a], marks[b]
        return (n_b - n_a) / max(t_b - t_a, 1e-6)

    (t_death, _), (t_quarantine, _) = marks["first_death"], marks["quarantined"]
    print(f"\npoison: quarantined {t_quarantine - t_death:.1f} s after the first death "
          f"({stats.get('struck', 0)} strikes, {stats.get('handed_back', 0)} handed back); prompts/s before the "
          f"first death {rate('first_result', 'first_death'):.0f}, between it and the quarantine "
          f"{rate('first_death', 'quarantined'):.0f}, second batch {rate('second_batch', 'all_done'):.0f}")
