"""batchfleet's worker: `RQ_WORKER_CLASS=worker.GPUWorker rq worker gpu0`.

`GPUWorker` is only the thin entry point `rq worker` needs: it takes the host lock of its server
(one worker per GPU per host), registers with RQ (so `rq info` lists it), then hands over to
`GPUService`, which owns the SGLang server and keeps exactly as many prompts in flight as the server
can really run. RQ's own job loop (one job at a time, a new event loop per job) is not used; RQ's
queues, job hashes and registries are.

Exit status: 0 stopped by a signal (or burst mode done); 1 Redis unreachable at start (RQ's CLI says so
in one line) or an unexpected error; 2 configuration error (a Redis URL RQ cannot use, a bad
`BATCHFLEET_*` value, a state or log directory that cannot be created, a `--tp-size` that disagrees with
the worker's GPU group, a GPU nvidia-smi does not list); 3 another worker on this host already owns this
GPU's server (or a GPU of this worker's group); 75 stopped by RQ's `shutdown` command (drained; meant to be restarted).

RQ's CLI builds its Redis client before it hands over to this class, and reports a URL it cannot parse
with a traceback; so when `rq worker` imports this package, the URL it is about to use is checked
first (`preflight_rq_cli`), and a bad one is one line and exit 2.

`rq info` reads each worker's job counts from RQ's worker hash (`successful_job_count`,
`failed_job_count`); the worker keeps them in step with its own counts at every status beat, in the
same round trip as RQ's heartbeat (never per prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import orjson
import redis
from rq.worker import BaseWorker

from batchfleet.cliopts import EXIT_CONFIG, EXIT_SERVER_TAKEN
from batchfleet.config import Config, gpu_group_for_queue, model_path_problem, queue_host, redis_url_problem
from batchfleet.connection import async_client_like, with_timeouts
from batchfleet.errors import ConfigError
from batchfleet.redact import Scrubber, install_log_scrubbing, private_dir_problem
from batchfleet.serializer import OrjsonSerializer

from .eventloop import loop_factory
from .flags import tp_size_for
from .gpu import listed_gpus
from .lock import GroupLock, ServerTaken
from .service import GPUService

__all__ = ["GPUWorker", "preflight_rq_cli", "rq_cli_url"]

log = logging.getLogger("batchfleet.worker")


def _option(argv: list[str], long: str, short: str) -> str | None:
    """The last value of a click option in argv (`--url X`, `--url=X`, `-u X`, `-uX`)."""
    value = None
    for i, arg in enumerate(argv):
        if arg in (long, short) and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(long + "="):
            value = arg[len(long) + 1:]
        elif arg.startswith(short) and len(arg) > len(short) and not arg.startswith("--"):
            value = arg[len(short):]
    return value


def rq_cli_url(argv: list[str], env: Mapping[str, str]) -> str | None:
    """The Redis URL `rq worker` (argv) will connect with: `--url`/`-u`, else RQ_REDIS_URL, else (with
    no settings module: `-c`/`--config`/RQ_CONFIG) REDIS_URL. None when it comes from elsewhere."""
    url = _option(argv, "--url", "-u") or env.get("RQ_REDIS_URL")
    if url is None and not (_option(argv, "--config", "-c") or env.get("RQ_CONFIG")):
        url = env.get("REDIS_URL")
    return url


def preflight_rq_cli(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> None:
    """When `rq worker` is importing this package: a Redis URL it cannot use is one line on stderr and
    exit EXIT_CONFIG, before RQ's CLI fails on it with a traceback."""
    argv = sys.argv if argv is None else argv
    if not argv or os.path.basename(argv[0]) != "rq" or "worker" not in argv[1:]:
        return
    url = rq_cli_url(argv[1:], os.environ if env is None else env)
    problem = redis_url_problem(url) if url else None
    if problem:
        print(f"worker: {problem}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)


def _make_dirs(config: Config) -> None:
    """The state and log directories (0700), now: one that cannot be made is a configuration error,
    not a traceback when the server first starts."""
    for what, path in (("state directory (BATCHFLEET_STATE_DIR)", config.state_dir),
                       ("log directory (BATCHFLEET_LOG_DIR)", config.logs)):
        if problem := private_dir_problem(path):
            raise ConfigError(f"the {what} {path} cannot be created or written: {problem}")


def _check_listed(queue: str, gpus: tuple[int, ...]) -> None:
    """A queue that names GPUs nvidia-smi does not list on this host (`gpu4-7` on a 4-GPU host) is a
    configuration error now, not a server that dies at start-up again and again ("invalid device
    ordinal"). Without an nvidia-smi that answers, nothing is checked."""
    listed = listed_gpus()
    missing = [g for g in gpus if listed is not None and g not in listed]
    if missing:
        have = ",".join(map(str, listed)) if listed else "none"
        raise ConfigError(f"queue {queue!r} names GPU(s) {','.join(map(str, missing))}, which this host does not have "
                          f"(nvidia-smi lists {have})")


class GPUWorker(BaseWorker):
    """One process per server; the (first) queue name picks its GPU: `gpu3` -> GPU 3, port base + 3; or its
    group of GPUs: `gpu4-7` -> GPUs 4 to 7 (CUDA_VISIBLE_DEVICES=4,5,6,7, --tp-size 4), port base + 4."""

    def __init__(self, queues: Any, *args: Any, **kwargs: Any) -> None:
        # Jobs are JSON whatever `rq worker -S` says: pickle would let Redis writers run code here.
        kwargs["serializer"] = OrjsonSerializer
        if not kwargs.get("name") and not args:
            # Readable and unique among live workers (a fixed --name would block a restart after a
            # kill -9 for minutes): host, queue and pid, e.g. "gpuhost-3.gpu0.41234"; a queue that
            # already names this host is not prefixed twice ("hostb.gpu3.41234").
            first = queues[0] if isinstance(queues, list | tuple) else queues
            queue = first if isinstance(first, str) else getattr(first, "name", "worker")
            host = socket.gethostname()
            named = host in queue_host(queue).split(".")
            kwargs["name"] = f"{queue}.{os.getpid()}" if named else f"{host}.{queue}.{os.getpid()}"
        super().__init__(queues, *args, **kwargs)
        # Redis may be on another host: a partition must fail commands, not hang them (see connection.py).
        with_timeouts(self.connection)

    def work(self, burst: bool = False, logging_level: str | None = "INFO", date_format: str = "%H:%M:%S",
             log_format: str = "%(asctime)s %(name)s %(levelname)s %(message)s", **_: Any) -> bool:
        # RQ's bootstrap gives its own loggers a handler; batchfleet's get one here (not the root
        # logger, which would print RQ's lines twice).
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(log_format, datefmt=date_format))
        ours = logging.getLogger("batchfleet")
        ours.addHandler(handler)
        ours.setLevel(logging_level or "INFO")
        ours.propagate = False
        try:
            config = Config.from_env()
            queue = self.queue_names()[0]
            gpus = (config.gpu,) if config.gpu is not None else gpu_group_for_queue(queue)
            if gpus is None:
                raise ConfigError(f"queue {queue!r} names no GPU: its last part must be gpuN (gpu3, hostb.gpu3) or a "
                                  "group gpuA-B (hostb.gpu0-3), or set BATCHFLEET_GPU")
            tp_size_for(config.server_argv_extra, gpus)  # a --tp-size that disagrees with the group: exit 2 now
            _check_listed(queue, gpus)
            new_loop = loop_factory(config.event_loop)
            _make_dirs(config)
            if problem := model_path_problem(config.model_path):  # refused before any server starts
                raise ConfigError(problem)
        except ConfigError as exc:
            log.error("%s", exc)
            sys.exit(EXIT_CONFIG)
        scrub = Scrubber.for_config(config)
        install_log_scrubbing(scrub)
        lock = GroupLock(config.server_host, {g: config.port_for(g) for g in gpus})
        try:
            lock.acquire()  # before registering with RQ: a refused duplicate leaves no trace there
        except ServerTaken as exc:
            log.error("%s", exc)
            sys.exit(EXIT_SERVER_TAKEN)
        try:
            self.bootstrap(logging_level, date_format, log_format)
        except ValueError as exc:  # RQ: "There exists an active worker named ... already" (a fixed --name)
            lock.release()
            log.error("%s: a worker of that name is registered in Redis (alive, or killed within the last few "
                      "minutes): give another --name, or none (the default is unique)", exc)
            sys.exit(EXIT_CONFIG)
        install_log_scrubbing(scrub)  # RQ's own handlers exist now
        code = 1
        try:
            with asyncio.Runner(loop_factory=new_loop) as runner:
                code = runner.run(self._serve(config, queue, gpus, burst))
        finally:
            with contextlib.suppress(redis.RedisError, OSError):
                self.heartbeat()  # the final job counts, before RQ marks the worker dead
            try:
                self.teardown()
            except (redis.RedisError, OSError) as exc:  # Redis away at exit: not this worker's failure
                log.warning("could not unregister from RQ (%s: %s): RQ's record of this worker expires by itself",
                            type(exc).__name__, str(exc)[:160])
                with contextlib.suppress(Exception):
                    self.unsubscribe()
            lock.release()
        if code:
            sys.exit(code)
        return True

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's heartbeat, and this worker's job counts in RQ's worker hash in the same round trip
        (`rq info`: "jobs: N finished, M failed"). Counted as the worker counts them: succeeded; failed
        (failed prompts and refused jobs, which go to RQ's failed registry)."""
        service = getattr(self, "_service", None)
        if service is None:
            super().heartbeat(timeout, pipeline)
            return
        tally = service.dispatcher.tally
        self.successful_job_count, self.failed_job_count = tally.done, tally.failed + tally.refused
        pipe = pipeline if pipeline is not None else self.connection.pipeline(transaction=False)
        super().heartbeat(timeout, pipe)
        pipe.hset(self.key, mapping={"successful_job_count": self.successful_job_count,
                                     "failed_job_count": self.failed_job_count})
        if pipeline is None:
            pipe.execute()

    async def _serve(self, config: Config, queue: str, gpus: tuple[int, ...], burst: bool) -> int:
        client = async_client_like(self.connection)
        try:
            self._service = GPUService(config, client, worker=self.name, queue=queue, gpu=gpus[0], gpus=gpus,
                                       rq_heartbeat=self.heartbeat)
            return await self._service.run(burst=burst)
        finally:
            await client.aclose()

    UNSUBSCRIBE_WAIT_S = 3.0

    def unsubscribe(self) -> None:
        """RQ's `unsubscribe`, bounded: the worker exits within seconds whatever redis-py does.

        RQ unsubscribes, then calls the pubsub thread's `stop()`. Since redis-py 8.2 `stop()` joins the
        thread with no timeout, and the thread, having read the unsubscribe reply, may be waiting up to
        RQ's `sleep_time` (60 s) for a subscription that will not come: a SIGTERMed worker then hung
        a minute after "stopped" (every test that stops workers saw it). The thread is a daemon and the
        process is exiting, so RQ's steps run on a helper thread and are given `UNSUBSCRIBE_WAIT_S`."""
        if getattr(self, "pubsub_thread", None) is None:
            return
        helper = threading.Thread(target=super().unsubscribe, name="rq-unsubscribe", daemon=True)
        helper.start()
        helper.join(self.UNSUBSCRIBE_WAIT_S)
        if helper.is_alive():
            log.debug("RQ's pubsub thread did not stop within %.0f s; exiting without it", self.UNSUBSCRIBE_WAIT_S)

    def _pubsub_exception_handler(self, exc: Exception, pubsub: Any, pubsub_thread: Any) -> None:
        """RQ's pubsub thread (its commands, e.g. `shutdown`) lives through any Redis outage, quietly.

        RQ's own handler logs an error every 2 s while Redis is down (30 lines a minute, where the
        worker promises one line when it loses Redis and one when it is back: `redislink`, on the main
        loop), and lets the thread die on a timeout (a partition: the connection has timeouts, see
        `with_timeouts`), after which no command reaches the worker. Here any Redis or socket error is
        waited out (redis-py subscribes again when it reconnects); anything else ends the thread
        loudly, as in RQ."""
        if isinstance(exc, redis.RedisError | OSError):
            log.debug("RQ pubsub thread: %s; retrying in 2 s", exc)
            time.sleep(2.0)
            return
        log.warning("RQ pubsub thread exiting on %s: RQ's commands no longer reach this worker", exc)
        raise exc

    def handle_payload(self, message: Any) -> None:
        """RQ's pubsub commands (on RQ's pubsub thread). The message is data: anything unreadable is
        ignored with a warning (it must not end the thread and with it every later command).
        `shutdown` drains and exits EXIT_SHUTDOWN_COMMAND (so restart-on-failure restarts the worker);
        `kill-horse` and `stop-job` have no meaning here (no work horse; prompts are not RQ's jobs to
        stop one by one) and are ignored."""
        try:
            payload = orjson.loads(message["data"])
            command = payload.get("command") if isinstance(payload, dict) else None
        except (KeyError, TypeError, orjson.JSONDecodeError):
            command = None
        if command == "shutdown":
            service = getattr(self, "_service", None)
            if service is None:
                log.warning("RQ shutdown command before the worker started serving: ignored")
            else:
                service.request_stop("RQ shutdown command")
            return
        log.warning("ignored an RQ pubsub message on %s: %.80r", self.pubsub_channel_name,
                    command if command else message.get("data") if isinstance(message, dict) else message)


preflight_rq_cli()
