"""A claimed job as data: every field checked as strictly as the producer checks an input line,
before anything of it reaches the server.

A job is refused (`JobRefused`: RQ's failed registry, no result) when it names a function off the
allow-list, is not batchfleet's JSON, holds a malformed prompt, belongs to another run, has an id
that its run and custom_id do not give (not written by `producer enqueue`), or asks a request
batchfleet does not send (`batchfleet.prompts.check_body`: the endpoint, the body). A failed job that
was trimmed after its result was collected and brought back by `rq requeue` is `Trimmed`: the head
feeds its prompt again from the store.
"""

from __future__ import annotations

from batchfleet.errors import JobRefused, RecordError
from batchfleet.jobs import ALLOWED, job_id_for, parse_job_data
from batchfleet.keys import TRIMMED
from batchfleet.prompts import InvalidPrompt, check_body
from batchfleet.records import Prompt

from .ledger import Claim

__all__ = ["Trimmed", "read_claim"]


class Trimmed(Exception):
    """A trimmed failed job of this run (its prompt is only in the store)."""

    def __init__(self, cid: str) -> None:
        super().__init__(cid)
        self.cid = cid


def read_claim(claim: Claim, run: str) -> Prompt:
    """The prompt of a job claimed by a worker of `run`. Raises JobRefused, or Trimmed."""
    try:
        func, args, kwargs = parse_job_data(claim.data)
    except Exception as exc:  # orjson, zlib and shape errors alike: the data is not ours
        raise JobRefused(f"job data is not batchfleet JSON ({type(exc).__name__}: {str(exc)[:100]})") from exc
    if func not in ALLOWED:
        raise JobRefused(f"job function {func[:100]!r} is not on batchfleet's allow-list")
    if len(args) != 1 or kwargs or not isinstance(args[0], dict):
        raise JobRefused("a batchfleet job takes exactly one prompt argument")
    if args[0].get(TRIMMED) is True:  # a failed job trimmed after its result was collected
        their_run, cid = args[0].get("run"), args[0].get("cid")
        if their_run == run and isinstance(cid, str) and claim.jid == job_id_for(run, cid):
            raise Trimmed(cid)
        raise JobRefused("trimmed job of another run, or whose id is not its custom_id's")
    try:
        prompt = Prompt.from_dict(args[0])
    except (RecordError, KeyError, TypeError, ValueError) as exc:
        raise JobRefused(f"malformed prompt record: {exc}") from exc
    if not prompt.run:
        raise JobRefused("job names no run (batchfleet's producer always writes one): not run")
    if prompt.run != run:
        # Its result would land in this run's stream and never reach its own export. Loud, and
        # recoverable: `rq requeue` once workers of run {prompt.run} serve this queue.
        raise JobRefused(f"job of run {prompt.run[:60]!r} on a queue served by run {run!r}: "
                         "give each run queues of its own")
    if claim.jid != job_id_for(prompt.run, prompt.cid):
        raise JobRefused("job id is not the one its run and custom_id give: not written by `producer enqueue`")
    try:
        check_body(prompt.url, prompt.body, size_bytes=len(claim.data))
    except InvalidPrompt as exc:
        raise JobRefused(f"request refused: {exc}") from exc
    return prompt
