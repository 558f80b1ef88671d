"""Simulated GPUs: which ones a server sees, their memory accounting, and the `nvidia-smi` shim.

The host has SGLANG_SIM_NUM_GPUS GPUs (default 8), indices 0..N-1. A server sees the ones
CUDA_VISIBLE_DEVICES lists, in that order (unset: all of them); as in CUDA, the list stops at the
first entry that is not a GPU of the host. Its ranks use those by ordinal (see parallel.py).

A live server writes $SGLANG_SIM_GPU_DIR/<index>.json ({"index", "total_mib", "used_mib", "pid"})
for every GPU of its group, each with that GPU's share; it removes them on a clean exit. After
SIGKILL the files stay, so a reader treats a file whose pid is dead (or a zombie) as free memory, as
the driver would once the process is gone. `python -m sglang_sim.gpus ARGS` prints what the shim does.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

__all__ = ["gpu_dir", "gpu_index", "num_gpus", "nvidia_smi", "query", "query_apps", "release", "visible_devices",
           "write_usage"]

DEFAULT_TOTAL_MIB = 97887  # an RTX PRO 6000 Blackwell as nvidia-smi reports it
GPU_NAME = "NVIDIA RTX PRO 6000 Blackwell (simulated)"


def gpu_dir() -> Path:
    return Path(os.environ.get("SGLANG_SIM_GPU_DIR", "/tmp/sglang-sim-gpus"))


def num_gpus() -> int:
    return int(os.environ.get("SGLANG_SIM_NUM_GPUS", "8"))


def visible_devices() -> list[int]:
    """Host GPU indices this process sees, by ordinal (CUDA_VISIBLE_DEVICES semantics)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(num_gpus()))
    seen: list[int] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry.isdigit() or int(entry) >= num_gpus() or int(entry) in seen:
            break  # CUDA ignores an invalid entry and every entry after it
        seen.append(int(entry))
    return seen


def gpu_index() -> int:
    """The host index of the first visible GPU (ordinal 0), 0 if none."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


# The simulator's own pid check, not batchfleet.procs.pid_alive: sglang_sim imports nothing of the fleet
# it stands in for SGLang against (tests/test_layout.py).
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not reaped yet still answers kill(0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def write_usage(index: int, *, used_mib: int, total_mib: int) -> None:
    d = gpu_dir()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = d / f".{index}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"index": index, "total_mib": total_mib, "used_mib": used_mib, "pid": os.getpid()}))
    tmp.replace(d / f"{index}.json")


def release(index: int) -> None:
    path = gpu_dir() / f"{index}.json"
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _record(index: int) -> dict | None:
    try:
        rec = json.loads((gpu_dir() / f"{index}.json").read_text())
        return rec if isinstance(rec, dict) and _alive(int(rec["pid"])) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def query() -> list[dict[str, int | str]]:
    """One row per simulated GPU: index, memory.used and memory.total in MiB, name, uuid."""
    rows: list[dict[str, int | str]] = []
    for i in range(num_gpus()):
        used, total = 0, DEFAULT_TOTAL_MIB
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            total = int(json.loads((gpu_dir() / f"{i}.json").read_text()).get("total_mib", total))
        rec = _record(i)
        if rec is not None:
            used = int(rec["used_mib"])
        rows.append({"index": i, "memory.used": used, "memory.total": total, "memory.free": total - used,
                     "name": GPU_NAME, "uuid": f"GPU-sim-{i:04d}", "utilization.gpu": 0})
    return rows


def query_apps() -> list[dict[str, int | str]]:
    """One row per process holding memory on a GPU (nvidia-smi --query-compute-apps)."""
    rows: list[dict[str, int | str]] = []
    for i in range(num_gpus()):
        rec = _record(i)
        if rec is not None:
            rows.append({"pid": int(rec["pid"]), "process_name": "python", "used_memory": int(rec["used_mib"]),
                         "gpu_uuid": f"GPU-sim-{i:04d}", "gpu_name": GPU_NAME,
                         "gpu_bus_id": f"00000000:{i + 1:02X}:00.0"})
    return rows


# nvidia-smi's CSV header names where they differ from the query names
_HEADERS = {"used_memory": "used_gpu_memory"}


def _csv(rows: list[dict[str, int | str]], fields: list[str], fmt: str) -> None:
    opts = set(fmt.split(","))
    mib = {"memory.used", "memory.total", "memory.free", "used_memory"}
    if "noheader" not in opts:
        print(", ".join(_HEADERS.get(f, f) + (" [MiB]" if f in mib and "nounits" not in opts else "")
                        for f in fields))
    for r in rows:
        print(", ".join(str(r[f]) + (" MiB" if f in mib and "nounits" not in opts else "") for f in fields))


def nvidia_smi(argv: list[str]) -> int:
    """The slice of nvidia-smi a GPU probe uses: --query-gpu=..., --query-compute-apps=...,
    --format=csv[,noheader][,nounits], -L."""
    if "-L" in argv:
        for r in query():
            print(f"GPU {r['index']}: {r['name']} (UUID: {r['uuid']})")
        return 0
    fields, apps = ["index", "memory.used", "memory.total"], False
    fmt = "csv,noheader,nounits"
    for a in argv:
        if a.startswith("--query-gpu="):
            fields = [f.strip() for f in a.split("=", 1)[1].split(",") if f.strip()]
        elif a.startswith("--query-compute-apps="):
            fields, apps = [f.strip() for f in a.split("=", 1)[1].split(",") if f.strip()], True
        elif a.startswith("--format="):
            fmt = a.split("=", 1)[1]
    known = ({"pid", "process_name", "used_memory", "gpu_uuid", "gpu_name", "gpu_bus_id"} if apps
             else {"index", "memory.used", "memory.total", "memory.free", "name", "uuid", "utilization.gpu"})
    unknown = [f for f in fields if f not in known]
    if unknown:
        print(f'Field "{unknown[0]}" is not a valid field to query.', file=sys.stderr)
        return 2
    _csv(query_apps() if apps else query(), fields, fmt)
    return 0


if __name__ == "__main__":
    sys.exit(nvidia_smi(sys.argv[1:]))
