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
- **Checking it** (`read_job`, a worker's claim): every field as strictly as the producer checks an
  input line, before anything of it reaches a server. A job is refused (`JobRefused`: RQ's failed
  registry, no result) when it names a function off the allow-list, is not batchfleet's JSON, holds a
  malformed prompt, belongs to another run, has an id that its run and custom_id do not give (not
  written by `producer enqueue`), or asks a request batchfleet does not send (`prompts.check_body`:
  the endpoint, the body). A failed job trimmed after its result was collected and brought back by
  `rq requeue` is `Trimmed`: the head feeds its prompt again from the store.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, NoReturn

import orjson

from .codec import decode
from .errors import JobRefused, RecordError
from .keys import TRIMMED
from .prompts import MAX_BODY_BYTES, InvalidPrompt, check_body
from .records import Prompt

__all__ = ["ALLOWED", "GENERATE", "MAX_JOB_BYTES", "Trimmed", "generate", "job_data", "job_id_for",
           "parse_job_data", "prompt_wire", "read_job", "run_suffix", "trimmed_data"]

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


def prompt_wire(cid: str, seq: int, url: str, body: Any, *, src: str = "", fp: str = "", pri: int = 0,
                run: str = "") -> dict[str, Any]:
    """A prompt record as it travels in a job (`records.Prompt.from_dict` reads it back). `body` may be
    an `orjson.Fragment` (the head splices in the body as the store holds it). Empty fields are left
    out, and `run` comes last (`run_suffix`)."""
    d: dict[str, Any] = {"cid": cid, "seq": seq, "url": url, "body": body}
    if src:
        d["src"] = src
    if fp:
        d["fp"] = fp
    if pri:
        d["pri"] = pri
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


class Trimmed(Exception):
    """A trimmed failed job of this run (its prompt is only in the store)."""

    def __init__(self, cid: str) -> None:
        super().__init__(cid)
        self.cid = cid


def read_job(jid: str, data: bytes, run: str) -> Prompt:
    """The prompt of job `jid` (its `data`) claimed by a worker of `run`. Raises JobRefused, or Trimmed."""
    try:
        func, args, kwargs = parse_job_data(data)
    except Exception as exc:  # orjson, zlib and shape errors alike: the data is not ours
        raise JobRefused(f"job data is not batchfleet JSON ({type(exc).__name__}: {str(exc)[:100]})") from exc
    if func not in ALLOWED:
        raise JobRefused(f"job function {func[:100]!r} is not on batchfleet's allow-list")
    if len(args) != 1 or kwargs or not isinstance(args[0], dict):
        raise JobRefused("a batchfleet job takes exactly one prompt argument")
    record = args[0]
    # Whose job it is, from its raw fields, before anything else is read of it: a trimmed one too
    their_run, cid = record.get("run"), record.get("cid")
    if not their_run or not isinstance(their_run, str):
        raise JobRefused("job names no run (batchfleet's producer always writes one): not run")
    if their_run != run:
        # Its result would land in this run's stream and never reach its own export. Loud, and
        # recoverable: `rq requeue` once workers of run {their_run} serve this queue.
        raise JobRefused(f"job of run {their_run[:60]!r} on a queue served by run {run!r}: "
                         "give each run queues of its own")
    if not isinstance(cid, str) or jid != job_id_for(run, cid):
        raise JobRefused("job id is not the one its run and custom_id give: not written by `producer enqueue`")
    if record.get(TRIMMED) is True:  # a failed job trimmed after its result was collected
        raise Trimmed(cid)
    try:
        prompt = decode(Prompt, record)
    except (RecordError, KeyError, TypeError, ValueError) as exc:
        raise JobRefused(f"malformed prompt record: {exc}") from exc
    try:
        check_body(prompt.url, prompt.body, size_bytes=len(data))
    except InvalidPrompt as exc:
        raise JobRefused(f"request refused: {exc}") from exc
    return prompt
