"""Start-up, serving and shutdown of one simulated server, in SGLang's order.

parse flags -> resolve strategy -> (fault: OOM) -> size memory (log lines) -> load "weights"
(first half of SGLANG_SIM_STARTUP_S, port closed) -> HTTP up, warm-up (second half: 503 on the
health and readiness routes) -> "The server is fired up and ready to roll!" -> serve until
SIGTERM/SIGINT -> free the simulated GPU memory, write the record, exit 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

from aiohttp import web

from . import gpus
from .cli import parse_args, sim_version
from .engine import Engine, EngineConfig
from .faults import Faults
from .logs import log
from .memory import StartupError, plan_memory, resolve_strategy, slots_per_request, startup_log_lines
from .metrics import Metrics
from .profiles import get_profile
from .record import Recorder
from .server import ServerState, SimServer

__all__ = ["main"]


def _fatal(line: str) -> int:
    log(line)
    log("Received sigquit from a child process. It usually means the child failed.")
    return 1


def _resolve(argv: list[str]) -> tuple[ServerState, dict[str, Any]]:
    version = sim_version()
    flags = parse_args(argv, version)  # exits 2 like argparse on a bad command line
    profile = get_profile()
    requested = flags.get(version.strategy_flag) or "auto"
    strategy, overlap = resolve_strategy(requested, hybrid=profile.hybrid,
                                         overlap=not flags.get("disable_overlap_schedule"), legacy=version.legacy)
    radix = not flags.get("disable_radix_cache")
    ratio = slots_per_request(strategy, overlap=overlap, radix=radix)
    plan = plan_memory(profile, flags, ratio=ratio)
    name = flags.get("served_model_name") or flags["model_path"]
    return ServerState(version=version.text, legacy=version.legacy, flags=flags, profile=profile, plan=plan,
                       strategy=strategy, overlap=overlap, time_scale=float(os.environ.get(
                           "SGLANG_SIM_TIME_SCALE", "1") or 1), model_name=name), {"radix": radix}


async def _serve(state: ServerState, radix: bool, faults: Faults, argv: list[str]) -> int:
    flags, plan, profile = state.flags, state.plan, state.profile
    gpu = gpus.gpu_index()
    startup_s = float(os.environ.get("SGLANG_SIM_STARTUP_S", "0.3") or 0)
    total_mib = int(profile.gpu_total_gb * 1024)
    gpus.write_usage(gpu, used_mib=int((profile.cuda_context_gb + plan.weight_gb) * 1024), total_mib=total_mib)
    await asyncio.sleep(startup_s / 2)
    for line in startup_log_lines(profile, plan):
        log(line)
    gpus.write_usage(gpu, used_mib=int(plan.used_gb * 1024), total_mib=total_mib)

    metrics = Metrics()
    cfg = EngineConfig(profile=profile, plan=plan, strategy=state.strategy, overlap=state.overlap, radix=radix,
                       decode_log_interval=max(1, int(flags.get("decode_log_interval") or 40)),
                       time_scale=state.time_scale, max_queued=flags.get("max_queued_requests"),
                       dp_size=max(1, int(flags.get("dp_size") or 1)), tp_size=max(1, int(flags.get("tp_size") or 1)))
    engine = Engine(cfg, faults=faults, metrics=metrics)
    recorder = Recorder(version=state.version, argv=argv, flags=flags, strategy=state.strategy,
                        effective=plan.effective_max_running * cfg.dp_size, profile=profile.name, gpu_index=gpu)
    recorder.engine = engine
    engine.on_tick.append(recorder.on_tick)
    server = SimServer(state, engine, recorder)
    # uvicorn's keep-alive timeout, as SGLang sets it (SGLANG_TIMEOUT_KEEP_ALIVE, 5 s): an idle
    # connection is closed by the server, so a client must not send on one it kept longer.
    keepalive_s = float(os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE", "5") or 5)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=keepalive_s)
    await runner.setup()
    site = web.TCPSite(runner, flags["host"], flags["port"])
    try:
        await site.start()
    except OSError as e:
        gpus.release(gpu)
        return _fatal(f"ERROR: [Errno {e.errno}] error while attempting to bind on address "
                      f"({flags['host']!r}, {flags['port']}): {e.strerror}")
    engine.start()
    log(f"Uvicorn running on http://{flags['host']}:{flags['port']} (Press CTRL+C to quit)")
    await asyncio.sleep(startup_s / 2)
    server.ready = recorder.ready = True
    log("The server is fired up and ready to roll!")
    recorder.write()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log("Shutting down the simulated server.")
    server.ready = False
    await engine.stop()
    await runner.cleanup()
    gpus.release(gpu)
    recorder.write()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        state, extra = _resolve(argv)
    except StartupError as e:
        return _fatal(e.log_line)
    except KeyError as e:
        return _fatal(f"ERROR: {e.args[0]}")
    faults = Faults.from_env(gpus.gpu_index())
    log(f"server_args=ServerArgs(model_path='{state.flags['model_path']}', host='{state.flags['host']}', "
        f"port={state.flags['port']}, mem_fraction_static={state.plan.mem_fraction_static}, "
        f"max_running_requests={state.flags.get('max_running_requests')}, "
        f"{'mamba_scheduler_strategy' if state.legacy else 'mamba_radix_cache_strategy'}='{state.strategy}', "
        f"disable_overlap_schedule={not state.overlap}, api_key={state.flags.get('api_key')!r}, ...)")
    if faults.fail_startup:
        return _fatal("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                      f"GPU 0 has a total capacity of {state.profile.gpu_total_gb:.2f} GiB of which 1.12 GiB is free.")
    return asyncio.run(_serve(state, extra["radix"], faults, argv))
