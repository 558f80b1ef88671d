"""The job functions batchfleet's workers run: an allow-list of exactly one.

Every prompt is an RQ job whose function is `GENERATE` and whose single argument is a
`records.Prompt` as a dict. Workers never import or call the function a job names: they refuse
(and fail) any job naming something else, so a job written into Redis by someone else cannot
make a worker run arbitrary code.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["ALLOWED", "GENERATE", "generate"]

GENERATE = "batchfleet.jobs.generate"
ALLOWED = frozenset({GENERATE})


def generate(prompt: dict[str, Any]) -> NoReturn:
    """Named by every prompt job; run only by batchfleet's worker, which sends it to its server.

    A stock RQ worker that picks the job up ends here and fails it with instructions, rather than
    losing the prompt silently.
    """
    raise RuntimeError(
        "batchfleet prompt jobs run only under batchfleet's worker: "
        "RQ_WORKER_CLASS=worker.GPUWorker rq worker <queue>"
    )
