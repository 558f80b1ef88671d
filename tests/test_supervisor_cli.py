"""The supervisor's Redis side and CLI on a real Redis with hand-written status records (no processes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import orjson
import pytest
from prometheus_client import generate_latest

from batchfleet.keys import Keys
from batchfleet.records import Event, ServerMetrics, ServerSpec, WorkerStatus
from supervisor.autopilot import DropFields, Emit, PilotState, SetFleet, SetOverride
from supervisor.cli import main
from supervisor.fleet import read_fleet
from supervisor.prom import FleetMetrics
from supervisor.report import load, plot, summarize
from supervisor.run import apply, history_sample, manual_restart, read_control

K = Keys("t")


@pytest.fixture
def fleet(r, redis_url, monkeypatch):
    monkeypatch.setenv("BATCHFLEET_REDIS_URL", redis_url)
    monkeypatch.setenv("BATCHFLEET_RUN", "t")
    for g in range(2):
        w = WorkerStatus(worker=f"w{g}", host="h", queue=f"gpu{g}", gpu=g, state="serving", effective_max=37,
                         in_flight=37, server_flags=["--enable-metrics"], tokens_per_s=560,
                         metrics=ServerMetrics(running=37, full_kv_usage=0.05, mamba_usage=0.69, gen_throughput=560))
        r.set(K.status(w.worker), w.to_json())
        r.sadd(K.workers, w.worker)
        r.sadd("rq:queues", f"rq:queue:gpu{g}")
        r.rpush(f"rq:queue:gpu{g}", *[f"j{i}" for i in range(5)])
    return r


def test_manual_restart_canary_then_fleet(fleet):
    spec = manual_restart(fleet, K, ServerSpec(strategy="no_buffer", mem_fraction_static=0.9), canary="w0")
    assert spec.generation == 1  # named by worker, written for its queue (a stable identity)
    assert ServerSpec.from_json(fleet.hget(K.control, Keys.control_queue("gpu0"))) == spec
    spec2 = manual_restart(fleet, K, ServerSpec(strategy="no_buffer", mem_fraction_static=0.9))
    assert spec2.generation == 2  # generations only increase, overrides included
    assert fleet.hkeys(K.control) == [b"fleet"]  # the fleet spec replaced every override
    events = [Event.from_json(f[b"e"]) for _, f in fleet.xrange(K.events)]
    assert [e.kind for e in events] == ["manual", "manual"] and "canary" in events[0].message


def test_apply_writes_specs_then_events_and_read_control_reads_them_back(fleet):
    said = []
    spec = ServerSpec(generation=3, strategy="no_buffer")
    apply(fleet, K, [Emit(Event("decision", "why")), SetOverride("gpu1", spec)], say=said.append)
    fleet.hset(K.control, Keys.control_worker("old.gpu0.1"), ServerSpec(generation=5).to_json())  # per worker name
    control = read_control(fleet, K, read_fleet(fleet, K))
    assert control.overrides == {"gpu1": spec} and control.fleet is None and control.next_generation() == 6
    assert control.legacy == {"old.gpu0.1": ServerSpec(generation=5)}
    assert control.current.strategy == "default" and said[0].endswith("decision: why")
    apply(fleet, K, [SetFleet(spec)], say=said.append)
    assert fleet.hkeys(K.control) == [b"fleet"]  # overrides of both kinds went in the same transaction
    apply(fleet, K, [SetOverride("gpu0", spec), SetOverride("gpu1", spec), DropFields(("queue:gpu0",))])
    assert sorted(fleet.hkeys(K.control)) == [b"fleet", b"queue:gpu1"]


def test_watch_once_json_has_classes(fleet, capsys):
    assert main(["watch", "--once", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["classes"] == {"w0": "mamba-bound", "w1": "mamba-bound"} and out["total_backlog"] == 10


def test_prometheus_exposes_fleet_and_per_gpu_metrics(fleet):
    m = FleetMetrics()
    m.update(read_fleet(fleet, K), None, PilotState(phase="canary"))
    text = generate_latest(m.registry).decode()
    assert "batchfleet_fleet_tokens_per_second 1120.0" in text and "batchfleet_fleet_live_workers 2.0" in text
    assert 'batchfleet_gpu_max_running_requests{gpu="0",worker="w0"} 37.0' in text
    assert 'batchfleet_gpu_tokens_per_second{gpu="1",worker="w1"} 560.0' in text
    assert 'batchfleet_autopilot_phase{phase="canary"} 1.0' in text


def test_batchfleet_metric_names_pass_promtool(fleet, tmp_path):
    """Prometheus's own linter on everything `supervisor watch --metrics-port` serves (base units spelled
    out: `_seconds`, `_per_second`; `_total` counters). `promtool` comes with Prometheus (Debian:
    `apt-get install prometheus`)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus): the names are not linted")
    from supervisor.classify import classify_window

    m = FleetMetrics()
    snap = read_fleet(fleet, K)
    fleet.xadd(K.events, {"e": Event("decision", "why").to_json()})
    m.update(read_fleet(fleet, K), classify_window([snap]), PilotState(phase="canary"))  # every metric has a sample
    text = generate_latest(m.registry).decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert len(names) >= 14 and all(n.startswith("batchfleet_") for n in names)
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")


def test_report_plots_history_and_summarizes(fleet, tmp_path, capsys):
    snap = read_fleet(fleet, K)
    for _ in range(5):
        fleet.xadd(K.history, {"s": history_sample(snap, {"w0": "mamba-bound"})})
    restarted = Event("restarted", "gpu0 restarted", data={"downtime_s": 4.2}, ts=time.time())
    fleet.xadd(K.events, {"e": restarted.to_json()})
    fleet.xadd(K.events, {"e": Event("verified", "done", data={"before_tokens_per_s": 1000,
                                                               "after_tokens_per_s": 1900}).to_json()})
    samples, events = load(fleet, K)
    assert orjson.loads(orjson.dumps(samples[0]))["gpus"]["w0"]["class"] == "mamba-bound"
    text = summarize(samples, events).text()
    assert "1 server restart" in text and "x1.90" in text and "median 4.2 s" in text
    out = tmp_path / "r.png"
    plot(samples, events, out)
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["report", str(tmp_path / "cli.png")]) == 0 and (tmp_path / "cli.png").exists()


def _render_text(snap, report, width: int, phase: str = "") -> list[str]:
    import io

    from rich.console import Console

    from supervisor.view import render

    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(render(snap, report=report, width=width, phase=phase))
    return out.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_view_fits_the_terminal_and_keeps_the_diagnosis_readable(width):
    from supervisor.classify import classify_window
    from supervisor.fleet import FleetSnapshot

    from .test_supervisor_core import SEED, window, ws

    def fleet(t: float) -> list[WorkerStatus]:
        return ([ws(g, t=t, host="gpu-host-a", facts=SEED) for g in range(3)]
                + [ws(4, t=t, host="gpu-host-b", in_flight=8, slots=8)]
                + [ws(5 + g, t=t, host="gpu-host-b", facts=SEED) for g in range(2)])
    snaps: list[FleetSnapshot] = window(fleet)
    report = classify_window(snaps)
    lines = _render_text(snaps[-1], report, width, phase="autopilot: observing, 1 stalled window(s)")
    assert max(len(line) for line in lines) <= width
    header = lines[1].split()
    assert header[:2] == ["gpu", "state"] and {"slots", "tok/s", "mamba", "KV", "class"} <= set(header)
    text = " ".join(" ".join(lines).split())
    stalled = [v for v in report.servers if v.cls == "mamba-bound"]
    assert f"{', '.join(v.label for v in stalled)} mamba-bound: {stalled[0].reasons[0]}" in text  # said once
    (slow,) = [v for v in report.servers if v.cls == "client-bound"]  # a problem: said in full, for that GPU
    assert f"{slow.label} client-bound: {'; '.join(slow.reasons)}" in text
    assert "gpu-host-a: 3 GPU(s)" in text and "gpu-host-b: 3 GPU(s)" in text
    assert "BATCHFLEET_MAX_IN_FLIGHT" in text
    rows = [line for line in lines if line.strip().startswith(("0 ", "1 ", "4 "))]
    assert len(rows) == 3 and all(("mamba-bound" in r) or ("client-bound" in r) for r in rows)
    optional = {"strategy", "run", "wait", "hit", "done", "fail"} & set(header)
    if width == 120:
        assert optional == {"strategy", "run", "wait", "hit", "done", "fail"}


def test_status_prints_one_snapshot_and_watch_once_stays_its_alias(fleet, capsys):
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "mamba-bound" in out and "gpu0" in out
    assert main(["watch", "--once", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["classes"] == {"w0": "mamba-bound", "w1": "mamba-bound"}
