"""Is a GPU's memory free again? Asked of `nvidia-smi` before a server is started on it.

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

__all__ = ["gpu_memory_mib", "wait_gpu_free"]

log = logging.getLogger("batchfleet.worker.gpu")
QUERY = ["--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"]


def gpu_memory_mib(index: int) -> tuple[int, int] | None:
    """(used, total) MiB of one GPU, or None when no nvidia-smi answers."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0] == str(index):
            return int(float(fields[1])), int(float(fields[2]))
    return None


async def wait_gpu_free(index: int, *, timeout_s: float = 120.0, free_below_fraction: float = 0.05) -> str:
    """Wait until the GPU holds (almost) nothing; return what was seen, for the restart event."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = await asyncio.to_thread(gpu_memory_mib, index)
        if seen is None:
            return "GPU memory not checked (no nvidia-smi)"
        used, total = seen
        if used <= total * free_below_fraction:
            return f"GPU {index} memory free again ({used} of {total} MiB used)"
        if time.monotonic() > deadline:
            log.warning("gpu%d still has %d MiB in use after %.0f s; starting anyway", index, used, timeout_s)
            return f"GPU {index} still had {used} MiB in use after {timeout_s:.0f} s"
        await asyncio.sleep(0.5)
