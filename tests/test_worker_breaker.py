"""The circuit breaker's rule (worker/breaker.py, pure), and the parts of a server's failure the worker
reads from real things: the kernel's socket table (who holds a port), SGLang's start-up lines, and a
log file on a full disk (/dev/full fails every write with ENOSPC, as a full disk does)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time

import pytest

from batchfleet.redact import Scrubber
from worker.breaker import Breaker
from worker.facts import read_facts
from worker.server import LogPump
from worker.startfail import fatal_line, port_holder, start_failure_reason

from .fakeserver import FakeServer


# --- the breaker --------------------------------------------------------------------------------------
def test_many_different_prompts_failing_with_nothing_succeeding_open_the_breaker() -> None:
    b = Breaker(threshold=3)
    assert not b.failure("a") and not b.failure("a") and not b.failure("b")  # a twice is one prompt
    assert b.failure("c") and b.open and b.trips == 1  # the third different prompt opens it
    assert not b.failure("d")  # already open: opened once
    b.success()  # an answer that was on its way does not close it: the probe does
    assert b.open
    b.probe_ok()
    assert not b.open and b.failing == set()


def test_a_success_between_failures_keeps_it_closed() -> None:
    b = Breaker(threshold=3)
    for i in range(100):
        b.failure(f"p{i}")
        if i % 2:
            b.success()
    assert not b.open and b.trips == 0


def test_a_prompt_attempt_counts_only_when_the_server_succeeded_since_its_last_failure() -> None:
    b = Breaker(threshold=5)
    assert b.counts(None)  # a first failure counts
    b.failure("x")
    at = b.epoch
    assert not b.counts(at)  # failed again, nothing succeeded here since: not counted yet
    b.success()
    assert b.counts(at)  # the server served another prompt since: counted
    b.trip()
    assert b.open and not b.counts(None)  # an open breaker counts nothing
    b.reset()  # a new server
    assert not b.open and b.counts(at)


def test_a_threshold_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        Breaker(threshold=0)


# --- why a start failed ----------------------------------------------------------------------------------
OOM = ("[2026-01-01 12:00:00] Scheduler hit an exception: Traceback (most recent call last):\n"
       "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       "8.00 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 6.88 GiB memory in use.\n"
       "[2026-01-01 12:00:01] Received sigquit from a child process. It usually means the child failed.\n")


def test_the_reason_of_an_out_of_memory_start_is_read_from_the_log() -> None:
    assert start_failure_reason(OOM, port=30000, exit_status=-9) == (
        "CUDA out of memory ... Tried to allocate 2.00 GiB (GPU 0 has a total capacity of 8.00 GiB of which "
        "1.12 GiB is free)")


def test_uvicorns_lower_case_address_already_in_use_is_fatal_and_names_the_holder() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        line = (f"[2026-01-01 12:00:00] ERROR:    [Errno 98] error while attempting to bind on address "
                f"('127.0.0.1', {port}): address already in use")
        assert fatal_line(line) == line.strip()
        import os
        assert port_holder(port) == os.getpid()  # /proc/net/tcp + /proc/self/fd
        reason = start_failure_reason(line, port=port, exit_status=1)
        assert reason.startswith(f"port {port} is already in use by pid {os.getpid()} (")
    assert port_holder(port) is None  # nobody listens now


def test_without_a_fatal_line_the_last_exception_line_or_the_exit_status_is_the_reason() -> None:
    text = "Traceback (most recent call last):\n  File \"x\", line 1\nOSError: Repo id must use alphanumeric chars\n"
    assert start_failure_reason(text, port=1, exit_status=1) == "OSError: Repo id must use alphanumeric chars"
    assert start_failure_reason("nothing useful\n", port=1, exit_status=1) == "server exited with status 1"


def test_the_kv_cache_line_of_sglang_0_5_23_is_read() -> None:
    log_text = "[2026-01-01 12:00:00] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 81234, K size: 1.25 GB, " \
               "V size: 1.25 GB\n"
    facts = read_facts({}, log_text, effective=8)
    assert facts.max_total_num_tokens == 81234 and facts.kv_gb == 2.5


# --- a full disk under the server's log -------------------------------------------------------------------
def test_a_full_disk_never_stops_the_worker_draining_the_servers_output(caplog: pytest.LogCaptureFixture) -> None:
    """A server printing far more than a pipe holds (64 KiB), its log file on a full disk: it must not
    block; every line is read, those that cannot be written are dropped and counted, one warning."""
    lines = 20_000  # ~1.2 MB
    child = subprocess.Popen([sys.executable, "-c", f"import sys\nfor i in range({lines}): "
                              "sys.stdout.write(f'line {i:06d} ' + 'x' * 50 + '\\n')\nsys.stdout.flush()"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with caplog.at_level(logging.WARNING, logger="batchfleet.worker.server"):
            pump = LogPump(child, open("/dev/full", "ab"), Scrubber(()), name="gpu0-server-log")  # noqa: SIM115
            deadline = time.monotonic() + 60
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert child.poll() == 0, "the server blocked on a full pipe"
            pump.finish(10)
        assert pump.dropped == lines
        said = [r.getMessage() for r in caplog.records if "cannot write the server's log" in r.getMessage()]
        assert len(said) == 1 and "No space left on device" in said[0], said
        assert any(f"{lines} line(s) of the server's log could not be written" in r.getMessage()
                   for r in caplog.records)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


# --- the dispatcher's hook, against a real Redis ------------------------------------------------------------
class SickAfter(FakeServer):
    """A server that answers HTTP 500 to everything after `ok` requests (and whose probe says so), or to
    one poison prompt only (by its text)."""

    def __init__(self, ok: int = 10**9, poison: str | None = None) -> None:
        super().__init__(self._answer)
        self.ok, self.poison, self.calls = ok, poison, 0

    async def _answer(self, body: dict) -> dict:
        import asyncio

        from batchfleet.errors import RetryableError

        self.calls += 1
        n = self.calls
        await asyncio.sleep(0.005)
        if n > self.ok or body["prompt"] == self.poison:
            raise RetryableError("HTTP 500: Internal Server Error", status_code=500)
        return {"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}}

    async def probe(self) -> bool:
        return self.calls <= self.ok


def drive(redis_url: str, server: SickAfter, *, until, capacity: int = 8, **config):
    """Run a dispatcher over queue gpu0 until `until(dispatcher)` (polled) or 30 s; return it. Retries
    wait a millisecond (`backoff_base_s`)."""
    import asyncio

    import redis.asyncio as aioredis

    from batchfleet.config import Config
    from batchfleet.keys import Keys
    from worker.dispatcher import Dispatcher
    from worker.ledger import Ledger

    from .fakeserver import dispatcher

    async def go() -> Dispatcher:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, Keys("t"), worker="w", lease_ttl_s=15)
        d = dispatcher(ledger, server, Config(run="t", surplus=0, backoff_base_s=0.001, backoff_max_s=0.001,
                                              **config), capacity=capacity)
        flusher = asyncio.create_task(ledger.run_flusher())
        claiming = asyncio.create_task(d.run(burst=True))
        deadline = time.monotonic() + 30
        while not until(d) and not claiming.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        claiming.cancel()
        await asyncio.wait({claiming})
        await d.takeback.drain(5)
        ledger.close()
        await flusher
        await client.aclose()
        return d

    return asyncio.run(go())


def test_a_server_failing_everything_fails_no_prompt_and_takes_no_more_work(r, redis_url) -> None:
    from rq import Queue

    from .test_worker_dispatch import enqueue, results

    enqueue(r, 100)
    backend = SickAfter(ok=20)
    d = drive(redis_url, backend, until=lambda d: d.judge.breaker.open and not d.in_flight, capacity=8, max_attempts=2)
    assert d.judge.breaker.open and d.tally.failed == 0 and d.tally.done == 20
    got = results(r)
    assert len(got) == 20 and all(x.ok for x in got.values())
    assert Queue("gpu0", connection=r).count == 80  # every other prompt is back in its queue, untouched
    calls = backend.calls
    # nothing more was claimed once it opened: beyond the 20 served, only the prompts in hand (8), each at most
    # twice (a first failure counts; a second asks the probe, which fails and opens it)
    assert calls <= 20 + 2 * 8, calls


def test_a_prompt_failing_alone_on_a_server_that_generates_still_fails_after_its_attempts(r, redis_url) -> None:
    from .test_worker_dispatch import enqueue, results

    enqueue(r, 30)
    backend = SickAfter(poison="p7")
    d = drive(redis_url, backend, until=lambda d: d.tally.done + d.tally.failed == 30, capacity=4, max_attempts=3)
    got = results(r)
    assert len(got) == 30 and d.tally.failed == 1 and not got["c7"].ok and got["c7"].attempts == 3
    assert got["c7"].error["code"] == "retries_exhausted" and not d.judge.breaker.open
