"""Start-up, serving and shutdown of one simulated server, in SGLang's order.

Launching process: parse flags (exit 2) -> model path, parallel layout, strategy (a bad one: a
traceback, exit 1) -> `server_args=...` -> scheduler ranks: a rank whose GPU ordinal is past the
visible devices dies at once (invalid device ordinal); the ranks load the "weights" (first half of
SGLANG_SIM_STARTUP_S, port closed) and size their pools (a failure: CUDA OOM & co, the server
SIGKILLs itself, -9) -> uvicorn: application startup, bind the port (taken: see `_port_taken`) ->
warm-up (second half: 503 on the health and readiness routes) -> "The server is fired up and ready
to roll!" -> serve until SIGTERM/SIGINT -> free the simulated GPU memory, write the record, exit 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from . import gpus
from .cli import parse_args, sim_version
from .engine import Engine, EngineConfig
from .fatal import MainProcessError, SchedulerError, die_in_main, die_in_scheduler, kill_process_tree
from .faults import Faults
from .hub import check_model_path
from .logs import log, uvicorn_log
from .lora import AdapterError, LoraSettings, Registry, adapter_load_s, lora_pool_gb, startup_id
from .memory import MemoryPlan, oom_line, plan_memory, resolve_strategy, slots_per_request, startup_log_lines
from .metrics import Metrics
from .model_kind import ModelKind, embedding_forward_error, resolve_model_kind
from .parallel import Layout, Rank
from .profiles import Profile, get_profile
from .record import Recorder
from .server import ServerState, SimServer

__all__ = ["main"]

WARMUP_PROMPT = "The capital city of France is"


def _startup_s() -> float:
    return float(os.environ.get("SGLANG_SIM_STARTUP_S", "0.3") or 0)


def _missing_gpu(rank: Rank, layout: Layout, visible: list[int]) -> SchedulerError:
    """What a rank whose GPU ordinal is not visible prints: model_runner.py logs the context, then
    torch.cuda.set_device raises (c10's message for cudaErrorInvalidDevice)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return SchedulerError("RuntimeError: No CUDA GPUs are available", after_load=False)
    return SchedulerError(
        "torch.AcceleratorError: CUDA error: invalid device ordinal",
        "GPU device may be out of range, do you have enough GPUs?",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
        "might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        "",
        after_load=False,
        context=(f"Context: self.device='cuda' get_device().gpu_id={rank.ordinal} "
                 f"os.environ.get('CUDA_VISIBLE_DEVICES')={cvd!r} get_parallel().tp_rank={rank.tp} "
                 f"get_parallel().tp_size={layout.tp}"),
    )


def _write_group_usage(group: list[int], profile: Profile, used_gb: float) -> None:
    for g in group:
        gpus.write_usage(g, used_mib=int(used_gb * 1024), total_mib=int(profile.gpu_total_gb * 1024))


async def _warmup_elsewhere(flags: dict[str, Any], layout: Layout) -> str | None:
    """SGLang's warm-up thread, which started before uvicorn failed to bind: it polls the URL of the
    port it asked for (1 s apart, 120 tries) for /model_info, then sends one generation and
    /freeze_gc. With the port taken it talks to whatever holds it. None when that succeeded, else the
    exception it ended on (upstream: srt/entrypoints/http_server.py `_execute_server_warmup`)."""
    url = f"http://{flags['host']}:{flags['port']}"
    headers = {"Authorization": f"Bearer {flags['api_key']}"} if flags.get("api_key") else {}
    tries = int(os.environ.get("SGLANG_SIM_WARMUP_TRIES", "120") or 120)
    last = ""
    async with aiohttp.ClientSession(headers=headers) as session:
        for _ in range(tries):
            await asyncio.sleep(1)
            try:
                async with session.get(url + "/model_info", timeout=aiohttp.ClientTimeout(total=5)) as res:
                    text = await res.text()
                    if res.status == 200:
                        break
                    last = f"AssertionError: res=<Response [{res.status}]>, res.text={text!r}"
            except TimeoutError:
                last = (f"requests.exceptions.ReadTimeout: HTTPConnectionPool(host='{flags['host']}', "
                        f"port={flags['port']}): Read timed out. (read timeout=5)")
            except aiohttp.ClientError as e:
                last = (f"requests.exceptions.ConnectionError: HTTPConnectionPool(host='{flags['host']}', "
                        f"port={flags['port']}): Max retries exceeded with url: /model_info (Caused by "
                        f"NewConnectionError('Failed to establish a new connection: {e}'))")
        else:
            return last
        text = WARMUP_PROMPT if layout.num_dp_ranks == 1 else [WARMUP_PROMPT] * layout.num_dp_ranks
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        try:
            async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=600)) as res:
                if res.status != 200:
                    return f"AssertionError: {await res.text()}"
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"requests.exceptions.ConnectionError: {e}"
        try:
            async with session.post(url + "/freeze_gc", timeout=aiohttp.ClientTimeout(total=10)) as res:
                if res.status >= 400:
                    log(f"post-warmup freeze_gc failed\nrequests.exceptions.HTTPError: {res.status} Error "
                        f"for url: {url}/freeze_gc")
        except (aiohttp.ClientError, TimeoutError) as e:
            log(f"post-warmup freeze_gc failed\nrequests.exceptions.ConnectionError: {e}")
    return None


async def _port_taken(error: OSError, flags: dict[str, Any], layout: Layout, group: list[int]) -> int:
    """uvicorn could not bind: it logs the error, shuts the application down and exits 1. SGLang's
    lifespan shutdown first waits for its warm-up thread, which reaches whatever holds the port: an
    HTTP server that answers makes it log "fired up and ready to roll" (then exit 1), anything else
    makes it give up after its tries and SIGKILL the process (-9)."""
    uvicorn_log("ERROR", str(error))
    uvicorn_log("INFO", "Waiting for application shutdown.")
    failure = await _warmup_elsewhere(flags, layout)
    if failure is not None:
        log(f"Initialization failed. warmup error: Traceback (most recent call last):\n{failure}")
        kill_process_tree(include_parent=True)
    log("The server is fired up and ready to roll!")
    uvicorn_log("INFO", "Application shutdown complete.")
    for g in group:
        gpus.release(g)
    kill_process_tree(include_parent=False)
    return 1


async def _serve(state: ServerState, radix: bool, faults: Faults, argv: list[str], layout: Layout,
                 group: list[int]) -> int:
    flags, plan, profile = state.flags, state.plan, state.profile
    startup_s = _startup_s()
    t0 = time.monotonic()
    _write_group_usage(group, profile, profile.cuda_context_gb + plan.weight_gb)
    await asyncio.sleep(startup_s / 2)
    load_s = time.monotonic() - t0
    lines = startup_log_lines(profile, plan, load_s=load_s)
    lines[1:1] = _lora_lines(state, plan)
    for rank in layout.ranks():
        for line, rank0_only in lines:
            if not rank0_only or rank.tp == 0:
                log(line, prefix=rank.prefix(layout))
    _write_group_usage(group, profile, plan.used_gb)

    metrics = Metrics()
    cfg = EngineConfig(profile=profile, plan=plan, strategy=state.strategy, overlap=state.overlap, radix=radix,
                       decode_log_interval=max(1, int(flags.get("decode_log_interval") or 40)),
                       time_scale=state.time_scale, max_queued=flags.get("max_queued_requests"), layout=layout,
                       page_size=int(flags.get("page_size") or 1),
                       track_interval=int(flags.get("mamba_track_interval") or 256),
                       embedding=state.kind.is_embedding, prefill_max_requests=flags.get("prefill_max_requests"),
                       lora=state.lora, lora_load_s=_load_cost(state),
                       priority_scheduling=bool(flags.get("enable_priority_scheduling")),
                       low_priority_first=bool(flags.get("schedule_low_priority_values_first")))
    engine = Engine(cfg, faults=faults, metrics=metrics)
    if os.environ.get("SGLANG_SIM_RECORD_REQUESTS") == "1":
        engine.request_log = []
    recorder = Recorder(version=state.version, argv=argv, flags=flags, strategy=state.strategy,
                        effective=plan.effective_max_running * layout.num_dp_ranks, profile=profile.name,
                        gpu_indices=group)
    recorder.engine = engine
    engine.on_tick.append(recorder.on_tick)
    server = SimServer(state, engine, recorder)
    # uvicorn's keep-alive timeout, as SGLang sets it (SGLANG_TIMEOUT_KEEP_ALIVE, 5 s): an idle
    # connection is closed by the server, so a client must not send on one it kept longer.
    keepalive_s = float(os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE", "5") or 5)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=keepalive_s)
    await runner.setup()
    # uvicorn's listen backlog (2048; aiohttp's own is 128): a client opening a thousand connections at
    # once must not overflow the accept queue (the kernel then drops or resets them).
    site = web.TCPSite(runner, flags["host"], flags["port"], backlog=2048)
    uvicorn_log("INFO", f"Started server process [{os.getpid()}]")
    uvicorn_log("INFO", "Waiting for application startup.")
    uvicorn_log("INFO", "Application startup complete.")
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        return await _port_taken(e, flags, layout, group)
    engine.start()
    uvicorn_log("INFO", f"Uvicorn running on http://{flags['host']}:{flags['port']} (Press CTRL+C to quit)")
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
    for g in group:
        gpus.release(g)
    recorder.write()
    return 0


def _lora_lines(state: ServerState, plan: MemoryPlan) -> list[tuple[str, bool]]:
    """What LoRAManager logs while it loads the startup adapters into CPU memory (each rank)."""
    if state.lora is None:
        return []
    avail = plan.memory_before_load_gb - plan.weight_gb
    lines = [(f"Using {state.lora_settings.backend} as backend of LoRA kernels.", False)]
    for name, path, pinned in state.lora_settings.refs:
        ref = f"LoRARef(lora_id={startup_id(name, path)}, lora_name={name}, lora_path={path}, pinned={pinned})"
        lines += [(f"LoRA adapter loading starts: {ref}. avail mem={avail:.2f} GB", False),
                  (f"LoRA adapter loading completes: {ref}. avail mem={avail:.2f} GB", False)]
    return lines


def _load_cost(state: ServerState) -> Any:
    """lora_id -> model seconds of one load of that adapter into a GPU slot (lora.adapter_load_s)."""
    reg = state.lora
    if reg is None:
        return None
    costs: dict[str, float] = {}

    def cost(lora_id: str) -> float:
        if lora_id not in costs:
            a = reg.known[lora_id]
            costs[lora_id] = adapter_load_s(state.profile, state.layout, rank=a.rank, modules=a.modules)
        return costs[lora_id]

    return cost


def _plan(profile: Profile, flags: dict[str, Any], layout: Layout, ratio: int, faults: Faults, kind: ModelKind,
          lora: LoraSettings) -> tuple[MemoryPlan, Registry | None]:
    """The scheduler's start-up after the weights: the pooler's first forward on an embedding server, the
    LoRA adapters and their GPU pool, then the KV cache (SchedulerError where a rank dies)."""
    if kind.is_embedding:
        error = embedding_forward_error(profile)
        if error is not None:
            raise error
    registry, lora_gb = None, 0.0
    if lora.enabled:
        try:
            registry = Registry.at_startup(lora)
        except AdapterError as e:
            raise SchedulerError(str(e), after_load=True) from None
        lora_gb = lora_pool_gb(profile, layout, slots=lora.max_loras_per_batch, rank=registry.rank,
                               modules=registry.modules)
    plan = plan_memory(profile, flags, ratio=ratio, layout=layout, lora_gb=lora_gb)
    if faults.fail_startup:
        faults.fire()
        raise SchedulerError(oom_line(gpu=layout.ranks()[0].ordinal, tried_gb=2.0, total_gb=profile.gpu_total_gb,
                                      free_gb=1.12), after_load=True)
    return plan, registry


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    version = sim_version()
    flags = parse_args(argv, version)  # exits 2 like argparse on a bad command line
    try:
        profile = get_profile()
    except KeyError as e:
        print(f"sglang_sim: {e.args[0]}", file=sys.stderr)
        return 2
    try:
        check_model_path(flags["model_path"])
        layout = Layout.from_flags(flags)
        requested = flags.get(version.strategy_flag) or "auto"
        strategy, overlap = resolve_strategy(requested, hybrid=profile.hybrid,
                                             overlap=not flags.get("disable_overlap_schedule"), legacy=version.legacy,
                                             page_size=flags.get("page_size"))
        kind = resolve_model_kind(profile, flags)
        lora = LoraSettings.from_flags(flags)
    except MainProcessError as e:
        return die_in_main(e)
    for warning in lora.warnings:
        log(warning)
    radix = not flags.get("disable_radix_cache")
    ratio = slots_per_request(strategy, overlap=overlap, radix=radix)
    log(f"server_args=ServerArgs(model_path='{flags['model_path']}', host='{flags['host']}', "
        f"port={flags['port']}, tp_size={layout.tp}, pp_size={layout.pp}, dp_size={layout.dp}, "
        f"attn_dp_size={layout.attn_dp}, mem_fraction_static={flags.get('mem_fraction_static')}, "
        f"max_running_requests={flags.get('max_running_requests')}, "
        f"{'mamba_scheduler_strategy' if version.legacy else 'mamba_radix_cache_strategy'}='{strategy}', "
        f"disable_overlap_schedule={not overlap}, is_embedding={kind.is_embedding}, "
        f"enable_lora={lora.enabled or None}, api_key={flags.get('api_key')!r}, ...)")

    visible = gpus.visible_devices()
    ranks = layout.ranks()
    group = [visible[r.ordinal] for r in ranks if r.ordinal < len(visible)]
    faults = Faults.from_env(group or [gpus.gpu_index()])
    missing = [r for r in ranks if r.ordinal >= len(visible)]
    if missing:
        die_in_scheduler([(_missing_gpu(missing[0], layout, visible), missing[0].prefix(layout))])
    try:
        plan, registry = _plan(profile, flags, layout, ratio, faults, kind, lora)
    except SchedulerError as e:
        if e.after_load:  # the ranks held their weights (nvidia-smi shows them) until they died
            weight_gb = min(profile.weight_gb / layout.tp / layout.pp, profile.gpu_total_gb)
            _write_group_usage(group, profile, profile.cuda_context_gb + weight_gb)
            time.sleep(_startup_s() / 2)
        die_in_scheduler([(e, ranks[0].prefix(layout))])
    name = flags.get("served_model_name") or flags["model_path"]
    state = ServerState(version=version.text, legacy=version.legacy, flags=flags, profile=profile, plan=plan,
                        strategy=strategy, overlap=overlap, time_scale=float(os.environ.get(
                            "SGLANG_SIM_TIME_SCALE", "1") or 1), model_name=name, layout=layout, kind=kind,
                        lora_settings=lora, lora=registry)
    return asyncio.run(_serve(state, radix, faults, argv, layout, group))
