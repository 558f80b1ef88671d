"""LoRA adapters per line with real parts (issue 30): producer CLI -> Redis/RQ -> `rq worker gpuN`
processes whose simulated SGLang servers load the fleet's adapters (BATCHFLEET_LORA_PATHS) -> export.
The simulator's output is deterministic per adapter (`expected_completion(..., adapter=)`), so every
exported line shows which adapter ran it."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchfleet.keys import Keys

from .fleet import Fleet, text_of

pytestmark = pytest.mark.slow

ADAPTERS = ("sql", "poet", "terse", "legal")


def make_adapters(tmp: Path, names: tuple[str, ...] = ADAPTERS) -> str:
    """PEFT adapter directories as SGLang reads them; BATCHFLEET_LORA_PATHS for them."""
    items = []
    for name in names:
        d = tmp / "adapters" / name
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16,
                                                           "target_modules": ["q_proj", "v_proj"]}))
        items.append(f"{name}={d}")
    return ",".join(items)


def lora_lines(n: int, *, seed: int = 3, max_tokens: int = 24) -> list[dict[str, Any]]:
    """n simple-form lines over the adapters and the base model, both ways of naming one, shuffled."""
    rows = []
    for i in range(n):
        adapter = (None, *ADAPTERS)[i % (len(ADAPTERS) + 1)]
        row: dict[str, Any] = {"id": f"p{i}", "prompt": f"Write line {i} of the report", "max_tokens": max_tokens}
        if adapter is not None:
            if i % 2:
                row["model"] = f"sim/tiny-hybrid:{adapter}"
            else:
                row["lora_path"] = adapter
        rows.append(row)
    random.Random(seed).shuffle(rows)
    return rows


def adapter_of(row: dict[str, Any]) -> str | None:
    return row["model"].split(":", 1)[1] if ":" in row.get("model", "") else row.get("lora_path")


def expected(row: dict[str, Any]) -> str:
    from sglang_sim.textgen import expected_completion

    return expected_completion(row["prompt"], {"max_new_tokens": row["max_tokens"]}, adapter=adapter_of(row))[0]


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def export(fleet: Fleet) -> list[dict[str, Any]]:
    out = fleet.tmp / "results.jsonl"
    fleet.producer("export", str(out))
    return [orjson.loads(x) for x in out.read_bytes().splitlines()]


def lora_env(tmp: Path, **more: str) -> dict[str, str]:
    return {"BATCHFLEET_LORA_PATHS": make_adapters(tmp), "BATCHFLEET_MAX_LORAS_PER_BATCH": "3",
            "BATCHFLEET_MAX_RUNNING_REQUESTS": "32", **more}


def test_a_lora_runs_export_has_each_lines_own_adapters_output(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=2, env=lora_env(tmp_path))
    rows = lora_lines(300)
    write(tmp_path / "in.jsonl", rows)
    fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues)
    for gpu in (0, 1):
        fleet.start_worker(gpu)
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= 300, 180, "300 prompts")
    fleet.stop_all()
    lines = export(fleet)
    assert [x["custom_id"] for x in lines] == [r["id"] for r in rows]
    for row, line in zip(rows, lines, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        assert text_of(line["response"]["body"]) == expected(row), (row, line)
    # the servers loaded the fleet's adapters, with its slots, and ran each line's
    loads: dict[str, int] = {}
    for gpu in (0, 1):
        rec = fleet.sim_record(gpu)
        assert "--enable-lora" in rec["argv"] and "--max-loras-per-batch" in rec["argv"]
        assert sorted(rec["lora"]["registered"]) == sorted(ADAPTERS)
        assert rec["lora"]["peak_adapters_in_batch"] <= 3
        for name, n in rec["lora"]["loads"].items():
            loads[name] = loads.get(name, 0) + n
    assert set(loads) == set(ADAPTERS)
    # grouped by adapter, each server loads few: far fewer loads than the 240 adapter lines
    assert sum(loads.values()) <= 4 * len(ADAPTERS), loads
    shapes = {s.shape for s in fleet.statuses()}
    assert shapes <= {"tp1+lora3"}, shapes


def test_an_adapter_the_fleet_does_not_have_is_refused_at_enqueue_naming_it(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=1, env=lora_env(tmp_path))
    rows = lora_lines(20)
    rows.insert(7, {"id": "bad", "prompt": "hi", "model": "sim/tiny-hybrid:nosuch"})
    write(tmp_path / "in.jsonl", rows)
    done = fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues, "--no-progress", check=False)
    assert done.returncode == 1
    said = [x for x in done.stderr.splitlines() if "nosuch" in x]
    assert said == ["in.jsonl:8: unknown LoRA adapter 'nosuch': the fleet's servers load legal, poet, sql, terse "
                    "(BATCHFLEET_LORA_PATHS, or --lora-paths in BATCHFLEET_SERVER_ARGS)"], done.stderr
    assert "Traceback" not in done.stderr
    assert "20 new" in done.stdout and "1 rejected" in done.stdout


def test_kill_9_in_a_lora_run_loses_and_duplicates_nothing(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=2, env=lora_env(tmp_path, SGLANG_SIM_TIME_SCALE="4"))
    rows = lora_lines(240, seed=9, max_tokens=64)
    write(tmp_path / "in.jsonl", rows)
    fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues)
    victim = fleet.start_worker(0)
    fleet.start_worker(1)
    fleet.start_head()
    fleet.wait_for(lambda: fleet.r.zcard(Keys.started(fleet.queue(0))) >= 5, 60, "gpu0 to have prompts in flight")
    time.sleep(0.5)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    fleet.wait_for(lambda: fleet.finished() >= 240, 240, "all prompts after the kill")
    fleet.start_worker(0)  # the GPU comes back; nothing is left for it
    time.sleep(1)
    fleet.stop_all()
    lines = export(fleet)
    ids = [x["custom_id"] for x in lines]
    assert sorted(ids) == sorted(r["id"] for r in rows)  # 0 lost
    assert len(ids) == len(set(ids)) == 240  # 0 duplicated
    by_id = {x["custom_id"]: x for x in lines}
    for row in rows:
        assert text_of(by_id[row["id"]]["response"]["body"]) == expected(row)
    assert fleet.stats()["succeeded"] == 240  # one result ever published per prompt
