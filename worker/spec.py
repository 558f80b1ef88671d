"""Spec following: which `ServerSpec` the supervisor asks of this worker's server.

The control hash is data written by another process (maybe another version, maybe a forger): a
spec that does not decode or is not on `ServerSpec`'s allow-list is refused with one `spec_refused`
event per value, and the worker keeps what it runs (or its configuration at first start).

**The fleet's memory.** When the control hash asks nothing of this worker, it starts on the spec an
earlier run verified as best for its kind of server (`Keys.MEMORY`, written by the supervisor), so a
second run needs no restart at all. Its kind (model, GPU name and memory, SGLang version, shape) is
known completely only once a server has started (the version is the server's word): the worker keeps
the kind of its last server in its state directory (`kind-<queue>.json`, with the configuration it
was started with) and uses it when the configuration is the same. A host that never ran one starts
on its configuration, and the supervisor moves it once it has said what it is. `--fresh-start`
(`Keys.CONTROL_FRESH` in the control hash) turns this off for the run.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import redis
import redis.asyncio as aioredis

from batchfleet.config import Config
from batchfleet.keys import Keys
from batchfleet.records import EventKind, RecordError, ServerSpec, WorkerStatus, decode
from batchfleet.redact import private_file

from .events import EventLog
from .redislink import LINK

__all__ = ["SpecFollower"]

log = logging.getLogger("batchfleet.worker")


class SpecFollower:
    def __init__(self, config: Config, client: aioredis.Redis, keyspace: Keys, *, worker: str, queue: str, gpu: int,
                 events: EventLog, current: Callable[[], ServerSpec | None]) -> None:
        self.config = config
        self.r = client
        self.k = keyspace
        self.worker = worker
        self.queue = queue
        self.gpu = gpu
        self.events = events
        self.current = current  # the spec the running server serves, None while none runs
        self._refused: bytes | None = None  # the last spec refused from Redis (said once)
        self._remembered: ServerSpec | None = None  # the fleet's memory for this worker's kind, looked up once
        self._looked_up = False
        # The GPU part of its queue ("gpu3" of "run.gpu3" or "hosta.gpu3"): the same server of the host from
        # run to run, whose queue names carry the run's
        self._slot = queue.rsplit(".", 1)[-1]
        self._kind_path = config.state_dir / f"kind-{self._slot}.json"
        self._kind_saved: str | None = None

    async def desired(self) -> ServerSpec:
        """What the supervisor asks of this worker's server; the configuration when it asks nothing."""
        try:
            mine, legacy, fleet, fresh = await self.r.hmget(
                self.k.control, Keys.control_queue(self.queue), Keys.control_worker(self.worker), Keys.CONTROL_FLEET,
                Keys.CONTROL_FRESH)
        except (redis.RedisError, OSError) as exc:
            # Redis away: keep serving what runs now (or the configuration at first start).
            LINK.lost("reading the desired server spec (keeping the current one)", exc)
            return self._kept()
        for field, raw in (("override", mine), ("override", legacy), ("fleet", fleet)):
            if not raw:
                continue
            try:
                return ServerSpec.from_json(raw)
            except RecordError as exc:
                # Data, not an instruction: refuse it (once per value), keep what runs now.
                kept = self._kept()
                if raw != self._refused:
                    self._refused = raw
                    await self.events.emit(EventKind.SPEC_REFUSED, f"gpu{self.gpu}: refused the {field} server spec in "
                                           f"Redis: {exc}; keeping {kept.describe()}", reason=str(exc))
                return kept
        if not fresh and not self._looked_up:
            await self._recall()
        return self._remembered if self._remembered is not None and not fresh else self.configured()

    # --- the fleet's memory -------------------------------------------------------------------------
    def _fingerprint(self) -> list[str]:
        c = self.config
        fp = [c.model_path or "", c.sglang_cmd, c.server_args, self._slot]
        if c.lora_paths or c.max_loras_per_batch:  # LoRA's slots take memory: another kind of server
            fp += [",".join(c.lora_paths), str(c.max_loras_per_batch or "")]
        return fp

    async def _recall(self) -> None:
        """Once: the spec the fleet's memory holds for this worker's kind (as its last server was)."""
        self._looked_up = True
        try:
            saved = json.loads(self._kind_path.read_text())
            field = saved["field"] if saved.get("config") == self._fingerprint() else None
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return
        if not isinstance(field, str):
            return
        try:
            raw = await self.r.hget(Keys.MEMORY, field)
        except (redis.RedisError, OSError) as exc:
            LINK.lost("reading the fleet's memory (starting on the configuration)", exc)
            return
        if not raw:
            return
        try:
            entry = json.loads(raw)
            spec = decode(ServerSpec, entry.get("spec"))
        except (ValueError, AttributeError, RecordError) as exc:
            log.warning("gpu%d: the fleet's memory for %s does not decode (%s): starting on the configuration",
                        self.gpu, field[:200], exc)
            return
        self._remembered = ServerSpec(strategy=spec.strategy, mem_fraction_static=spec.mem_fraction_static,
                                      max_running_requests=spec.max_running_requests)
        log.info("gpu%d: starting on %s, which run %s verified as best for %s (the fleet's memory; "
                 "--fresh-start ignores it)", self.gpu, self._remembered.describe(), str(entry.get("run"))[:60],
                 field[:200])

    def note_kind(self, status: WorkerStatus) -> None:
        """After a publish: keep this server's kind in the state directory (when complete and new), for
        the next start of a worker with the same configuration on this host."""
        model = next((status.server_flags[i + 1] for i, f in enumerate(status.server_flags[:-1])
                      if f in ("--model-path", "--model")), "")
        field = Keys.memory_field(model, status.gpu_name, status.gpu_memory_mib,
                                  status.facts.version if status.facts else "", status.shape)
        if field is None or field == self._kind_saved:
            return
        tmp = self._kind_path.with_suffix(f".{os.getpid()}.tmp")
        try:
            with private_file(tmp, "w") as f:
                f.write(json.dumps({"config": self._fingerprint(), "field": field}))
            Path(tmp).replace(self._kind_path)
        except OSError as exc:
            log.warning("gpu%d: could not keep the server's kind in %s: %s", self.gpu, self._kind_path, exc)
            return
        self._kind_saved = field

    def _kept(self) -> ServerSpec:
        current = self.current()
        return current if current is not None else self.configured()

    def configured(self) -> ServerSpec:
        return ServerSpec(strategy=self.config.strategy, mem_fraction_static=self.config.mem_fraction_static,
                          max_running_requests=self.config.max_running_requests)
