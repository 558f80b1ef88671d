"""`serve_api`: the run's store made ready for batches, the batch engine's thread, the HTTP API, until
SIGINT/SIGTERM.

The API owns ONE run of the fleet (`--run`, default `serve`): every batch's prompts go into that run's
store as one input each, under `<batch id>:<custom_id>`. Workers, the head and the supervisor serve
that run exactly as they serve any other (its keys `bf:<run>:...`, its queues `<run>.gpuN` or those
given), so nothing of them knows about batches. The store is told to feed by input
(`Store.order_feed_by_input`), and each batch is stored owned by its tenant at its priority: the head
shares the fleet between tenants by weight, high first, each tenant's batches in creation order
(producer/share.py). The tenants file is read again on SIGHUP (`reload_tenants`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis
from aiohttp import web

from batchfleet.config import Config
from producer.api import Access, StoreError, ensure_marker, locate, repair_if_lost

from .app import MB, make_app
from .auth import ApiKeys, AuthError
from .engine import Engine, Limits
from .fleet import TenantRow
from .registry import Registry
from .tenancy import Tenancy

__all__ = ["ServeError", "ServeOptions", "prepare_store", "reload_tenants", "serve_api"]

log = logging.getLogger("batchfleet.serve")
GIL_SWITCH_S = 0.02


class ServeError(Exception):
    """The API cannot start (its port is in use, its address cannot be bound): exit 2 with the message."""


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_upload_bytes: int = 200 * MB  # OpenAI's
    max_requests: int = 50_000  # per batch, OpenAI's
    window_s: float = 24 * 3600.0  # how long the `24h` completion window lasts
    model: str = "default"  # body.model of a request without one
    queues: tuple[str, ...] = ()  # queues the head feeds besides those live workers serve


def prepare_store(config: Config, r: redis.Redis, queues: tuple[str, ...]) -> Path:
    """The run's store, created when new (and repaired when Redis lost the run's data), ordered by
    input, with its run marker written. Returns its path."""
    loc = locate(config, r, explicit=True, access=Access.CREATE)
    try:
        if loc.store.cancelled_at() is not None:
            raise StoreError(f"run {config.run} was cancelled (producer cancel): its head feeds nothing any more; "
                             f"serve another run (--run NAME), or `producer purge {config.run} --yes` and move its "
                             f"store {loc.store.path} away")
        repair_if_lost(config, r, loc)
        with loc.store.write():
            loc.store.order_feed_by_input()
        ensure_marker(r, config, loc.store, queues=queues)
        return loc.store.path
    finally:
        loc.store.close()


def serve_api(config: Config, r: redis.Redis, keys: ApiKeys, options: ServeOptions, *,
              tick: Callable[[], bool] | None = None, on_ready: Callable[[str], None] | None = None,
              on_rows: Callable[[list[TenantRow]], None] | None = None, hup: threading.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or until `tick`, called every second, returns False). Returns 0.
    SIGHUP reads the tenants file again (`reload_tenants`). `on_rows`: the tenants' rows for a screen,
    from the engine's thread when they change (at most every fleet.SCREEN_EVERY_S). `hup`: set by a SIGHUP
    that came while serve was starting; the file is read again once the API serves."""
    store_path = prepare_store(config, r, options.queues)
    # The engine's thread validates batches (CPU-bound Python) while the API's loop answers polls: at
    # the default 5 ms a poll every 10 ms made a 50,000-line validation take 1.45 s instead of 1.0 s
    # (bench/bench_serve.py). A poll then waits at most this long for its turn.
    sys.setswitchinterval(GIL_SWITCH_S)
    registry = Registry(config.state_dir, config.run)
    limits = Limits(max_requests=options.max_requests, window_s=options.window_s, model=options.model)
    engine = Engine(config, registry, store_path, r, limits, queues=options.queues, keys=keys, on_rows=on_rows)
    engine.start()
    engine.ready.wait(60)
    try:
        app = make_app(registry, engine, limits, max_upload_bytes=options.max_upload_bytes)
        early = hup or threading.Event()
        _run_loop(_serve(app, options, tick, on_ready, lambda: reload_tenants(engine.tenancy), early))
    finally:
        engine.stop()
        registry.close()
    return 0


def _run_loop(main: object) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a core dependency where it builds
        asyncio.run(main)  # type: ignore[arg-type]
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)  # type: ignore[arg-type]


def reload_tenants(tenancy: Tenancy) -> None:
    """SIGHUP: the tenants file read again and in force, or, when it cannot be used, the tenants loaded
    before kept and one line saying why (never the file's content)."""
    old = tenancy.api_keys
    if old.tenants_file is None:
        log.info("SIGHUP: no tenants file to read again (--tenants, BATCHFLEET_TENANTS_FILE)")
        return
    try:
        new = old.reloaded()
    except AuthError as exc:
        log.warning("SIGHUP: %s; keeping the %d tenant(s) loaded before", exc, len(old.by_name))
        return
    tenancy.use(new)
    log.info("SIGHUP: tenants file %s read again: %d tenant(s), %d key(s)", new.tenants_file, len(new.by_name),
             len(new))


async def _serve(app: web.Application, options: ServeOptions, tick: Callable[[], bool] | None,
                 on_ready: Callable[[str], None] | None, reload: Callable[[], None], early: threading.Event) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Future[None]] = set()

    def on_hup() -> None:  # the file is read in a thread: no disk on the loop
        task = asyncio.ensure_future(asyncio.to_thread(reload))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    before = signal.getsignal(signal.SIGHUP)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    if early.is_set():  # a SIGHUP while serve was starting
        early.clear()
        on_hup()
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, options.host, options.port, backlog=512)
        try:
            await site.start()
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise ServeError(f"cannot serve on {options.host}:{options.port}: {why}") from None
        if on_ready is not None:
            on_ready(f"http://{options.host}:{options.port}/v1")
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await stop.wait()
            if tick is not None and not stop.is_set() and not tick():
                break
    finally:
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        if callable(before) or before == signal.SIG_IGN:  # while the fleet stops, a SIGHUP is what it was
            signal.signal(signal.SIGHUP, before)
