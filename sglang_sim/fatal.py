"""How SGLang 0.5.23 dies at start-up, in its two ways (what it prints, its exit status).

1. In the launching process, while it resolves its arguments (a bad flag combination, a model path
   that is neither a directory nor a valid hub id): an uncaught Python exception, so a traceback on
   stderr and exit status 1 (upstream: python/sglang/launch_server.py runs `run_server` under a
   `finally` that only kills children).
2. In a scheduler process (one per GPU rank) while it loads the model or sizes its pools (CUDA out of
   memory, a GPU ordinal past the visible devices): `run_scheduler_process` logs
   `Scheduler hit an exception: <traceback>` with the rank's prefix and sends SIGQUIT to the launcher,
   whose handler logs `Received sigquit from a child process. It usually means the child failed.`
   and calls `kill_process_tree(os.getpid())`, which SIGKILLs the launcher itself: the server's exit
   status is -9 (137 in a shell) (upstream: srt/managers/scheduler.py, srt/entrypoints/engine.py
   `launch_phase_sigquit_handler`, srt/utils/common.py `kill_process_tree`).

Traceback frames are abbreviated: the frames named are real upstream functions, the last line is
the exception as torch/transformers/SGLang print it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from .logs import log

__all__ = [
    "SITE_PACKAGES", "MainProcessError", "SchedulerError", "die_in_main", "die_in_scheduler", "kill_process_tree",
]

SITE_PACKAGES = "/usr/local/lib/python3.12/dist-packages"


class MainProcessError(Exception):
    """A start-up failure in the launching process: a traceback ending in `exc_line`, exit 1."""

    def __init__(self, exc_line: str, *, frames: tuple[tuple[str, int, str, str], ...] = ()) -> None:
        super().__init__(exc_line)
        self.exc_line = exc_line
        self.frames = frames or (
            (f"{SITE_PACKAGES}/sglang/launch_server.py", 84, "<module>", "run_server(server_args)"),
            (f"{SITE_PACKAGES}/sglang/launch_server.py", 29, "run_server", "server_args.resolve_once()"),
        )


class SchedulerError(Exception):
    """A start-up failure in a scheduler process: `exc_lines` end its traceback (rank's log prefix)."""

    def __init__(self, *exc_lines: str, after_load: bool, context: str | None = None,
                 frames: tuple[tuple[str, int, str, str], ...] = ()) -> None:
        super().__init__(exc_lines[0])
        self.exc_lines = exc_lines
        self.after_load = after_load  # the rank loaded weights first (the failure takes that long)
        self.context = context  # a line the rank logs before raising
        self.frames = frames or (
            (f"{SITE_PACKAGES}/sglang/srt/managers/scheduler.py", 6362, "run_scheduler_process",
             "scheduler = Scheduler(server_args, port_args)"),
            (f"{SITE_PACKAGES}/sglang/srt/managers/scheduler.py", 568, "__init__", "self.init_model_worker()"),
            (f"{SITE_PACKAGES}/sglang/srt/managers/scheduler.py", 1033, "init_model_worker",
             "self.tp_worker = TpModelWorker(**worker_kwargs)"),
            (f"{SITE_PACKAGES}/sglang/srt/managers/tp_worker.py", 487, "__init__", "self._model_runner = ModelRunner("),
        )


def _traceback(frames: tuple[tuple[str, int, str, str], ...], exc_lines: tuple[str, ...]) -> str:
    out = ["Traceback (most recent call last):"]
    for path, line, func, code in frames:
        out += [f'  File "{path}", line {line}, in {func}', f"    {code}"]
    return "\n".join([*out, *exc_lines])


def die_in_main(err: MainProcessError) -> int:
    sys.stderr.write(_traceback(err.frames, (err.exc_line,)) + "\n")
    sys.stderr.flush()
    return 1


def kill_process_tree(*, include_parent: bool) -> None:
    """SGLang's `kill_process_tree(os.getpid(), include_parent)`: log it; with the parent, SIGKILL
    this process (the simulator has no children to kill)."""
    pid = os.getpid()
    log(f"kill_process_tree called: parent_pid={pid}, include_parent={include_parent}, pid={pid}")
    if include_parent:
        sys.stderr.flush()
        os.kill(pid, signal.SIGKILL)


def die_in_scheduler(errors: list[tuple[SchedulerError, str]]) -> NoReturn:
    """Each failing rank logs its exception (with its prefix); the launcher then kills itself."""
    for err, prefix in errors:
        if err.context:
            log(err.context, prefix=prefix)
        log("Scheduler hit an exception: " + _traceback(err.frames, err.exc_lines), prefix=prefix)
    log("Received sigquit from a child process. It usually means the child failed.")
    kill_process_tree(include_parent=True)
    raise SystemExit(137)  # not reached: SIGKILL
