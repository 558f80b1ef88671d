"""A run's RQ jobs as data: the one place that says what a job of a run is.

- **Its function**: an allow-list of exactly one, `GENERATE`. Workers never import or call the
  function a job names: they refuse (and fail) any job naming something else, so a job written into
  Redis by someone else cannot make a worker run arbitrary code.
- **Its id**: `job_id_for(run, custom_id)`: the same custom_id in the same run is always the same job,
  which is what makes enqueueing idempotent (hashed, so any custom_id is safe in a key).
- **Its data**: JSON `[GENERATE, null, [prompt], {}]` (`job_data`), the prompt record being
  `prompt_wire`'s, with `run` last; a failed job whose result was collected keeps only a stub
  (`trimmed_data`) that ends the same way. So every job of a run ends with `run_suffix(run)`, which is
  how `producer purge` finds a run's jobs among all of Redis's (producer/lua/run_jobs.lua).
- **Reading it back** (`parse_job_data`): JSON, or RQ's own zlib-compressed JSON; never unpickled,
  never inflated past MAX_JOB_BYTES.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, NoReturn

import orjson

from .keys import TRIMMED
from .prompts import MAX_BODY_BYTES

__all__ = ["ALLOWED", "GENERATE", "MAX_JOB_BYTES", "generate", "job_data", "job_id_for",
           "parse_job_data", "prompt_wire", "run_suffix", "trimmed_data"]

GENERATE = "batchfleet.jobs.generate"
ALLOWED = frozenset({GENERATE})
MAX_JOB_BYTES = MAX_BODY_BYTES + 64 * 1024  # a job's data, decompressed: the prompt and its envelope


def generate(prompt: dict[str, Any]) -> NoReturn:
    """Named by every prompt job; run only by batchfleet's worker, which sends it to its server.

    A stock RQ worker that picks the job up ends here and fails it with instructions, rather than
    losing the prompt silently.
    """
    raise RuntimeError(
        "batchfleet prompt jobs run only under batchfleet's worker: "
        "RQ_WORKER_CLASS=worker.GPUWorker rq worker <queue>"
    )


def job_id_for(run: str, cid: str) -> str:
    """The RQ job id of a prompt of `run` with custom_id `cid`."""
    return "bf-" + hashlib.blake2b(f"{run}\0{cid}".encode(), digest_size=12).hexdigest()


def prompt_wire(cid: str, seq: int, url: str, body: Any, *, src: str = "", fp: str = "",
                run: str = "") -> dict[str, Any]:
    """A prompt record as it travels in a job (`records.Prompt.from_dict` reads it back). `body` may be
    an `orjson.Fragment` (the head splices in the body as the store holds it). Empty fields are left
    out, and `run` comes last (`run_suffix`)."""
    d: dict[str, Any] = {"cid": cid, "seq": seq, "url": url, "body": body}
    if src:
        d["src"] = src
    if fp:
        d["fp"] = fp
    if run:
        d["run"] = run
    return d


def job_data(prompt: dict[str, Any]) -> bytes:
    """A job's `data` for a prompt record (`prompt_wire`'s)."""
    return orjson.dumps([GENERATE, None, [prompt], {}])


def trimmed_data(run: str, cid: str, seq: int) -> bytes:
    """A failed job's `data` once its result is collected: enough to feed the prompt again from the
    store (`rq requeue`), not the prompt."""
    return job_data({"cid": cid, "seq": seq, TRIMMED: True, "run": run})


def run_suffix(run: str) -> bytes:
    """How the `data` of every job of `run` ends."""
    return b'"run":' + orjson.dumps(run) + b"}],{}]"


def parse_job_data(data: bytes) -> tuple[str, list, dict]:
    """(function name, args, kwargs) from a job's `data` field: JSON as batchfleet's producer writes
    it, or zlib-compressed JSON as RQ's own `enqueue` writes it. Never unpickled; never inflated past
    MAX_JOB_BYTES (a zip bomb is refused, not decompressed). Raises ValueError (orjson's decode error
    is one) or zlib.error."""
    if len(data) > MAX_JOB_BYTES:
        raise ValueError(f"job data of {len(data):,} bytes is larger than {MAX_JOB_BYTES:,}")
    if data[:1] == b"x":  # zlib header: written through RQ's API
        inflater = zlib.decompressobj()
        data = inflater.decompress(data, MAX_JOB_BYTES + 1)
        if len(data) > MAX_JOB_BYTES or inflater.unconsumed_tail:
            raise ValueError(f"job data inflates past {MAX_JOB_BYTES:,} bytes")
    func, _instance, args, kwargs = orjson.loads(data)
    if not isinstance(func, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("job data is not (function, instance, args, kwargs)")
    return func, args, kwargs
