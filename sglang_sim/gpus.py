"""Simulated GPU memory accounting, read by the `nvidia-smi` shim in sglang_sim/bin.

A live server writes $SGLANG_SIM_GPU_DIR/<index>.json ({"index", "total_mib", "used_mib", "pid"});
it removes the file on a clean exit. After SIGKILL the file stays, so a reader treats a file whose
pid is dead (or a zombie) as free memory, as the driver would once the process is gone.
Run `python -m sglang_sim.gpus` for the same CSV as the shim.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["gpu_dir", "gpu_index", "num_gpus", "query", "release", "write_usage"]

DEFAULT_TOTAL_MIB = 97887  # an RTX PRO 6000 Blackwell as nvidia-smi reports it


def gpu_dir() -> Path:
    return Path(os.environ.get("SGLANG_SIM_GPU_DIR", "/tmp/sglang-sim-gpus"))


def gpu_index() -> int:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def num_gpus() -> int:
    return int(os.environ.get("SGLANG_SIM_NUM_GPUS", "8"))


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


def query() -> list[dict[str, int]]:
    """One row per simulated GPU: index, memory.used and memory.total in MiB."""
    rows = []
    for i in range(num_gpus()):
        used, total = 0, DEFAULT_TOTAL_MIB
        try:
            rec = json.loads((gpu_dir() / f"{i}.json").read_text())
            total = int(rec.get("total_mib", total))
            if _alive(int(rec["pid"])):
                used = int(rec["used_mib"])
        except (OSError, ValueError, KeyError):
            pass
        rows.append({"index": i, "memory.used": used, "memory.total": total, "memory.free": total - used,
                     "name": "NVIDIA RTX PRO 6000 Blackwell (simulated)", "uuid": f"GPU-sim-{i:04d}",
                     "utilization.gpu": 0})
    return rows


def nvidia_smi(argv: list[str]) -> int:
    """The slice of nvidia-smi a GPU probe uses: --query-gpu=... --format=csv[,noheader][,nounits], -L."""
    if "-L" in argv:
        for r in query():
            print(f"GPU {r['index']}: {r['name']} (UUID: {r['uuid']})")
        return 0
    fields = ["index", "memory.used", "memory.total"]
    fmt = "csv,noheader,nounits"
    for a in argv:
        if a.startswith("--query-gpu="):
            fields = [f.strip() for f in a.split("=", 1)[1].split(",") if f.strip()]
        elif a.startswith("--format="):
            fmt = a.split("=", 1)[1]
    unknown = [f for f in fields if f not in query()[0]] if num_gpus() else []
    if unknown:
        print(f'Field "{unknown[0]}" is not a valid field to query.', file=sys.stderr)
        return 2
    opts = set(fmt.split(","))
    if "noheader" not in opts:
        print(", ".join(f + (" [MiB]" if f.startswith("memory") and "nounits" not in opts else "")
                        for f in fields))
    for r in query():
        vals = [str(r[f]) + (" MiB" if f.startswith("memory") and "nounits" not in opts else "") for f in fields]
        print(", ".join(vals))
    return 0


if __name__ == "__main__":
    sys.exit(nvidia_smi(sys.argv[1:]))
