"""Is a GPU's memory free again (every GPU of a server's group)? Asked of `nvidia-smi` before a server
is started on it again.

On a GPU host `nvidia-smi` is the driver's own tool; without a driver the simulator ships a
stand-in with the same command line (`sglang_sim/bin/nvidia-smi`) that reports its accounting.
When neither answers, the check is skipped (and says so) rather than blocking the restart.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from collections.abc import Iterable

__all__ = ["gpu_memory_mib", "gpus_memory_mib", "listed_gpus", "nvidia_smi", "wait_gpu_free"]

log = logging.getLogger("batchfleet.worker.gpu")
QUERY = ["--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"]


def nvidia_smi(args: list[str]) -> str | None:
    """What `nvidia-smi ARGS` prints (the driver's tool, or the simulator's stand-in), or None when none
    is on PATH or it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpus_memory_mib(indices: Iterable[int]) -> dict[int, tuple[int, int]] | None:
    """(used, total) MiB of each of these GPUs that nvidia-smi lists (one call), or None when no
    nvidia-smi answers."""
    out = nvidia_smi(QUERY)
    if out is None:
        return None
    wanted = {str(i): i for i in indices}
    seen: dict[int, tuple[int, int]] = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0] in wanted:
            seen[wanted[fields[0]]] = int(float(fields[1])), int(float(fields[2]))
    return seen


def listed_gpus() -> tuple[int, ...] | None:
    """The indices of the GPUs nvidia-smi lists on this host, or None when no nvidia-smi answers."""
    seen = gpus_memory_mib(range(1024))
    return None if seen is None else tuple(sorted(seen))


def gpu_memory_mib(index: int) -> tuple[int, int] | None:
    """(used, total) MiB of one GPU, or None when no nvidia-smi answers (or it lists no such GPU)."""
    return (gpus_memory_mib([index]) or {}).get(index)


async def wait_gpu_free(gpus: int | Iterable[int], *, timeout_s: float = 120.0,
                        free_below_fraction: float = 0.05) -> str:
    """Wait until every GPU of the server's group (or the one GPU) holds (almost) nothing; return what was
    seen, for the restart event."""
    indices = (gpus,) if isinstance(gpus, int) else tuple(gpus)
    names = f"GPU {indices[0]}" if len(indices) == 1 else f"GPUs {','.join(map(str, indices))}"
    deadline = time.monotonic() + timeout_s
    while True:
        seen = await asyncio.to_thread(gpus_memory_mib, indices)
        if not seen:
            return "GPU memory not checked (no nvidia-smi)"
        busy = {i: used for i, (used, total) in seen.items() if used > total * free_below_fraction}
        if not busy:
            used = sum(u for u, _ in seen.values())
            total = sum(t for _, t in seen.values())
            return f"{names} memory free again ({used} of {total} MiB used)"
        if time.monotonic() > deadline:
            held = ", ".join(f"GPU {i} {u} MiB" for i, u in sorted(busy.items()))
            log.warning("%s still in use after %.0f s (%s); starting anyway", names, timeout_s, held)
            return f"{names} still in use after {timeout_s:.0f} s ({held})"
        await asyncio.sleep(0.5)
