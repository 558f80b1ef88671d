"""LoRA adapters as SGLang 0.5.23 serves them: flags, adapters, the GPU slot pool, its memory and cost.

(upstream, under sglang/srt/: `arg_groups/lora_hook.py` `check_lora_server_args`,
`arg_groups/argparse_actions.py` `LoRAPathAction`, `lora/lora_registry.py` `LoRARef`, `LoRARegistry`,
`lora/lora_config.py` `LoRAConfig`, `lora/lora_manager.py` `init_lora_adapters`, `init_lora_shapes`,
`validate_new_adapter`, `validate_lora_batch`, `lora/mem_pool.py` `get_lora_A_shape`/`get_lora_B_shape`,
`prepare_lora_batch`, `lora/utils.py` `get_normalized_target_modules`, `get_stacked_multiply`.)

- Flags are checked in the launching process (a traceback, exit 1): `--max-loras-per-batch` > 0, both
  `--max-lora-rank` and `--lora-target-modules` without `--lora-paths`, `all` alone, `--max-loaded-loras`
  >= `--max-loras-per-batch` and >= the startup adapters, overlap loading's cap.
- An adapter is a directory holding `adapter_config.json` (PEFT: `r`, `lora_alpha`, `target_modules`,
  `use_dora`), as SGLang reads it. A path that does not exist is a hub id to SGLang; the simulator,
  offline, takes a valid one as a downloaded adapter of rank 16 on q/k/v/o_proj, and refuses an invalid
  one with huggingface_hub's message. Startup adapters that fail kill the scheduler (-9).
- The GPU pool has `--max-loras-per-batch` slots (the base model holds one from the start), each
  buffer sized for `--max-lora-rank` (else the largest startup rank) on every target module; it is
  allocated before the KV cache is sized, so it costs KV tokens.
- Loading an adapter into a slot (on the forward that first needs it) costs time: the simulator's own
  invented figure, `adapter_load_s`: 0.5 ms + the adapter's bytes on one GPU at 10 GB/s (a host-to-device
  copy from pageable memory). A victim slot is chosen by `--lora-eviction-policy` (lru, fifo) among the
  adapters the forward does not need, not pinned, real adapters before the base model.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .fatal import MainProcessError
from .hub import repo_id_error
from .logs import log
from .parallel import Layout
from .profiles import Profile

__all__ = [
    "Adapter", "AdapterError", "LoraSettings", "Registry", "SlotPool", "adapter_load_s", "lora_pool_gb",
    "normalize_modules", "read_adapter", "startup_id",
]

GB = 1 << 30
LOAD_BASE_S = 0.0005  # per load: the per-module copy launches (invented)
H2D_BYTES_S = 10e9  # host-to-device copy of an adapter's weights (invented)
HUB_RANK = 16  # an adapter named by hub id (the simulator cannot download it)
HUB_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EMBEDDING_NAMES = ("embed_tokens", "lm_head")
_MAPPING = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj", "vocab_emb": "embed_tokens", "embeddings": "embed_tokens"}


class AdapterError(ValueError):
    """An adapter that cannot be loaded (the message is SGLang's)."""


def normalize_modules(modules: Any) -> frozenset[str]:
    """PEFT target modules as SGLang's LoRA buffers name them (q/k/v -> qkv_proj, gate/up -> gate_up_proj;
    a prefixed name by its suffix); "all"/"all-linear" -> {"all"}."""
    if isinstance(modules, str):
        if modules not in ("all", "all-linear"):
            raise AdapterError("Only 'all' or 'all-linear' can be used as the string for target module")
        return frozenset({"all"})
    out = set()
    for m in modules:
        name = str(m).rsplit(".", 1)[-1]
        out.add(_MAPPING.get(name, name))
    return frozenset(out)


def _resolve_all(modules: frozenset[str]) -> frozenset[str]:
    return frozenset(LINEAR) | frozenset(EMBEDDING_NAMES) if "all" in modules else modules


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: SGLang's LoRARef (id, name, path, pinned) with its PEFT config."""

    lora_id: str
    name: str
    path: str
    pinned: bool
    rank: int
    modules: frozenset[str]


def startup_id(name: str, path: str) -> str:
    """`LoRARef.deterministic_id`: uuid5(NAMESPACE_URL, name NUL path)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


def read_adapter(name: str, path: str, *, pinned: bool = False, lora_id: str | None = None) -> Adapter:
    """Read the adapter's PEFT config as `LoRAConfig` does; AdapterError with SGLang's text if it cannot."""
    lora_id = lora_id or uuid.uuid4().hex
    if not os.path.isdir(path):
        error = repo_id_error(path)
        if error is not None:  # snapshot_download(path) refuses it (huggingface_hub's HFValidationError)
            raise AdapterError(error)
        return Adapter(lora_id, name, path, pinned, HUB_RANK, normalize_modules(HUB_MODULES))
    config_path = os.path.join(path, "adapter_config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"[Errno 2] No such file or directory: '{config_path}'") from None
    except (OSError, ValueError) as e:
        raise AdapterError(str(e)) from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter_config.json is not a JSON object: '{config_path}'")
    for key in ("target_modules", "r", "lora_alpha"):
        if key not in config:
            raise AdapterError(repr(key))  # LoRAConfig reads them with [] (a KeyError)
    if config.get("use_dora"):
        raise AdapterError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
    return Adapter(lora_id, name, path, pinned, int(config["r"]), normalize_modules(config["target_modules"]))


def _module_shapes(profile: Profile) -> dict[str, tuple[int, int, int, bool]]:
    """(stack, in, out, column-parallel) of each linear module SGLang wraps (mem_pool.py shapes)."""
    h, q, kv, i = profile.hidden_size, profile.q_dim, profile.kv_dim, profile.intermediate_size
    return {"qkv_proj": (3, h, q + 2 * kv, True), "o_proj": (1, q, h, False),
            "gate_up_proj": (2, h, 2 * i, True), "down_proj": (1, i, h, False)}


def _bytes_per_rank(profile: Profile, layout: Layout, modules: frozenset[str]) -> float:
    """Bytes of one rank of A and B buffers over the target modules and the layers one GPU holds (bf16):
    A = [stack x r, in], B = [out, r]; column-parallel modules shard B's out, row-parallel A's in."""
    tp = layout.attn_tp
    total = 0.0
    for name, (stack, d_in, d_out, column) in _module_shapes(profile).items():
        if name in _resolve_all(modules):
            total += stack * (d_in if column else d_in / tp) + (d_out / tp if column else d_out)
    return total * profile.num_layers / layout.pp * 2


def lora_pool_gb(profile: Profile, layout: Layout, *, slots: int, rank: int, modules: frozenset[str]) -> float:
    """The GPU memory one GPU gives the LoRA buffers: slots x rank x the modules' A and B rows."""
    return slots * rank * _bytes_per_rank(profile, layout, modules) / GB


def adapter_load_s(profile: Profile, layout: Layout, *, rank: int, modules: frozenset[str]) -> float:
    """Model seconds one adapter's load into a GPU slot costs (the simulator's invented figure)."""
    return LOAD_BASE_S + rank * _bytes_per_rank(profile, layout, modules) / H2D_BYTES_S


def _parse_path_item(item: str) -> tuple[str, str, bool]:
    """One `--lora-paths` item: `<PATH>`, `<NAME>=<PATH>` (first `=`), or a JSON object."""
    item = item.strip()
    if item.startswith("{") and item.endswith("}"):
        try:
            obj = json.loads(item)
        except ValueError as e:
            raise MainProcessError(f"json.decoder.JSONDecodeError: {e}") from None
        if "lora_path" not in obj or "lora_name" not in obj:
            raise MainProcessError(f"AssertionError: {item!r} looks like a JSON str, but it does not contain "
                                   "'lora_name' and 'lora_path' keys.")
        return str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False))
    if "=" in item:
        name, path = item.split("=", 1)
        return name, path, False
    return item, item, False


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA flags as 0.5.23 resolves them in the launching process."""

    enabled: bool
    refs: tuple[tuple[str, str, bool], ...] = ()  # (name, path, pinned) of --lora-paths
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    target_modules: frozenset[str] | None = None
    max_loaded_loras: int | None = None
    eviction_policy: str = "lru"
    backend: str = "csgmv"
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> LoraSettings:
        """Raises MainProcessError where check_lora_server_args asserts."""
        paths = flags.get("lora_paths") or []
        refs = tuple(_parse_path_item(p) for p in paths)
        per_batch = flags.get("max_loras_per_batch")
        per_batch = 8 if per_batch is None else int(per_batch)
        if per_batch <= 0:
            raise MainProcessError("AssertionError: max_loras_per_batch must be positive")
        enabled = bool(flags.get("enable_lora")) or bool(refs)
        warnings = ("--enable-lora is set to True because --lora-paths is provided.",) \
            if refs and not flags.get("enable_lora") else ()
        if not enabled:
            return cls(enabled=False, max_loras_per_batch=per_batch)
        given = flags.get("lora_target_modules")
        modules = frozenset(given) if given else None
        if modules and "all" in modules and len(modules) != 1:
            raise MainProcessError("AssertionError: If 'all' is specified in --lora-target-modules, it should be "
                                   "the only module specified.")
        rank = flags.get("max_lora_rank")
        if not refs and not (rank and modules):
            raise MainProcessError(
                "AssertionError: When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
                "and --lora-target-modules for LoRA initialization.")
        loaded = flags.get("max_loaded_loras")
        if flags.get("enable_lora_overlap_loading") and (loaded is None or loaded > 2 * per_batch):
            raise MainProcessError(
                "AssertionError: Enabling LoRA overlap loading requires pinning LoRA adapter weights in CPU memory, "
                "so --max-loaded-loras must be less than or equal to double --max-loras-per-batch: "
                f"{2 * per_batch}")
        if loaded is not None:
            if loaded < per_batch:
                raise MainProcessError(
                    "AssertionError: max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                    f"max_loaded_loras={loaded}, max_loras_per_batch={per_batch}")
            if len(refs) > loaded:
                raise MainProcessError(
                    "AssertionError: The number of LoRA paths should not exceed max_loaded_loras. "
                    f"max_loaded_loras={loaded}, lora_paths={len(refs)}")
        return cls(enabled=True, refs=refs, max_loras_per_batch=per_batch, max_lora_rank=rank,
                   target_modules=modules, max_loaded_loras=loaded,
                   eviction_policy=flags.get("lora_eviction_policy") or "lru",
                   backend=flags.get("lora_backend") or "csgmv", warnings=warnings)

    def server_info(self, flags: dict[str, Any]) -> dict[str, Any]:
        """The resolved LoRA fields of /server_info (the startup adapters as LoRARef dicts; an inferred
        rank or module set stays null, as 0.5.23 does not declare it back)."""
        if not self.enabled:
            return {"enable_lora": flags.get("enable_lora") or None, "lora_paths": flags.get("lora_paths"),
                    "max_loras_per_batch": self.max_loras_per_batch}
        return {
            "enable_lora": True, "enable_lora_overlap_loading": bool(flags.get("enable_lora_overlap_loading")),
            "lora_paths": [{"lora_id": startup_id(n, p), "lora_name": n, "lora_path": p, "pinned": pin}
                           for n, p, pin in self.refs],
            "max_loras_per_batch": self.max_loras_per_batch, "max_loaded_loras": self.max_loaded_loras,
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": sorted(self.target_modules) if self.target_modules else None,
            "lora_eviction_policy": self.eviction_policy, "lora_backend": self.backend,
        }


@dataclass
class Registry:
    """The adapters a server knows (the tokenizer's LoRARegistry and lora_ref_cache) and the shapes of
    its GPU pool (LoRAManager), shared by every DP rank."""

    settings: LoraSettings
    rank: int  # the pool's max rank
    modules: frozenset[str]  # the pool's target modules
    registry: OrderedDict[str, Adapter] = field(default_factory=OrderedDict)  # LRU order, newest last
    ever: dict[str, Adapter] = field(default_factory=dict)  # lora_ref_cache: every name ever loaded
    in_flight: dict[str, int] = field(default_factory=dict)  # lora_id -> requests not finished
    known: dict[str, Adapter] = field(default_factory=dict)  # lora_id -> every adapter ever registered
    pinned_ids: set[str] = field(default_factory=set)  # lora_ids pinned now (the slot pools read it)
    reloads: int = 0

    @classmethod
    def at_startup(cls, settings: LoraSettings) -> Registry:
        """Load the startup adapters and infer the pool's shapes (init_lora_adapters, init_lora_shapes);
        AdapterError (its message prefixed as the scheduler raises it) on the first that fails."""
        adapters = []
        for name, path, pinned in settings.refs:
            try:
                adapters.append(read_adapter(name, path, pinned=pinned, lora_id=startup_id(name, path)))
            except AdapterError as e:
                raise AdapterError(f"RuntimeError: Failed to load LoRA adapter {name}: {e}") from None
        if settings.target_modules:
            modules = _resolve_all(normalize_modules(sorted(settings.target_modules)))
            for a in adapters:
                extra = _resolve_all(a.modules) - modules
                if extra:
                    raise AdapterError(
                        f"ValueError: LoRA adapter '{a.name}' contains target modules {sorted(extra)} that are not "
                        f"included in the specified --lora-target-modules {sorted(modules)}. Please update "
                        "--lora-target-modules to include all required modules: "
                        f"{sorted(modules | extra)}, or use 'all' to enable all supported modules.")
        else:
            modules = frozenset().union(*(_resolve_all(a.modules) for a in adapters))
        rank = settings.max_lora_rank or max((a.rank for a in adapters), default=0)
        reg = cls(settings=settings, rank=rank, modules=modules)
        for a in adapters:
            reg._register(a)
        return reg

    def _register(self, a: Adapter) -> None:
        self.registry[a.name] = self.ever[a.name] = self.known[a.lora_id] = a
        if a.pinned:
            self.pinned_ids.add(a.lora_id)

    @property
    def pinned(self) -> int:
        return len(self.pinned_ids)

    def check_new(self, adapter: Adapter) -> None:
        """validate_new_adapter: a duplicate name, a shape the pool cannot hold, too many pinned."""
        if adapter.name in self.registry:
            raise AdapterError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
        if adapter.rank > self.rank or not ("all" in adapter.modules or adapter.modules <= self.modules):
            raise AdapterError(
                f"LoRA adapter {adapter.name} with rank {adapter.rank} is incompatible with the current LoRA memory "
                "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        if adapter.pinned and self.pinned >= self.settings.max_loras_per_batch - 1:
            raise AdapterError(
                f"Failed to load LoRA adapter {adapter.name} as a pinned adapter. It is not allowed to pin all slots "
                "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase "
                "your `--max-loras-per-batch` or load it as unpinned LoRA adapters.")

    def load(self, name: str, path: str, *, pinned: bool = False) -> list[str]:
        """/load_lora_adapter: register it; past --max-loaded-loras unload the least recently used unpinned
        adapters (returned, by name). AdapterError on failure."""
        log(f"Start load Lora adapter. Lora name={name}, path={path}")
        adapter = read_adapter(name, path, pinned=pinned)
        self.check_new(adapter)
        self._register(adapter)
        evicted = []
        cap = self.settings.max_loaded_loras
        while cap is not None and len(self.registry) > cap:
            victim = next((n for n, a in self.registry.items() if not a.pinned), None)
            if victim is None:
                raise AdapterError("Didn't find any LoRA adapters when trying to evict LRU LoRA adapter.")
            log(f"Unloading least recently used LoRA adapter '{victim}' (current number of adapters: "
                f"{len(self.registry)}, max allowed: {cap})")
            self.unregister(victim)
            evicted.append(victim)
        return evicted

    def unregister(self, name: str) -> Adapter:
        """/unload_lora_adapter's first step; AdapterError for an unknown name."""
        adapter = self.registry.pop(name, None)
        if adapter is None:
            raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                               f"odict_keys({list(self.registry)!r})")
        self.pinned_ids.discard(adapter.lora_id)
        return adapter

    def resolve(self, names: list[str | None]) -> tuple[list[Adapter | None], list[str]]:
        """The adapters of one request's items (tokenizer_manager `_resolve_lora_path`): an evicted or
        unloaded name is reloaded implicitly; returns them and the names reloaded. ValueError (400)
        for a name never loaded or more distinct names than --max-loaded-loras."""
        unique = {n for n in names if n is not None}
        cap = self.settings.max_loaded_loras
        if cap is not None and len(set(names)) > cap:
            raise ValueError(f"Received request with {len(set(names))} unique loras requested but max loaded loras "
                             f"is {cap}")
        reloaded = []
        for name in sorted(unique - set(self.registry)):
            old = self.ever.get(name)
            if old is None:
                raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                 f"All loaded adapters: dict_keys({list(self.ever)!r}).")
            try:
                self.load(old.name, old.path, pinned=old.pinned)
            except AdapterError as e:
                raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {e}") from None
            reloaded.append(name)
        out: list[Adapter | None] = []
        for n in names:
            if n is None:
                out.append(None)
                continue
            self.registry.move_to_end(n)  # lookups count as accesses (LRU)
            out.append(self.registry[n])
        self.reloads += len(reloaded)
        return out, reloaded

    def hold(self, lora_id: str | None) -> None:
        """A request on the adapter entered the scheduler (an unload waits for it; `release` at its end)."""
        if lora_id is not None:
            self.in_flight[lora_id] = self.in_flight.get(lora_id, 0) + 1

    def release(self, lora_id: str | None) -> None:
        if lora_id is not None and self.in_flight.get(lora_id):
            self.in_flight[lora_id] -= 1


class SlotPool:
    """One DP rank's GPU LoRA pool (LoRAMemoryPool): `slots` buffers, the base model in one from the start."""

    def __init__(self, slots: int, policy: str, pinned_ids: set[str]) -> None:
        self.slots, self.policy = slots, policy
        self.pinned_ids = pinned_ids  # shared with the server: adapters pinned now
        self._clock = 0
        self.resident: dict[str | None, list[int]] = {None: [0, 0]}  # id -> [loaded at, last used]

    def fits(self, ids: set[str | None], new: str | None) -> bool:
        """validate_lora_batch: the batch's distinct adapters (the base counts) fit the slots, pinned aside."""
        want = ids | {new}
        if len(want) > self.slots:
            return False
        if not self.pinned_ids:
            return True
        pinned = sum(1 for i in want if i in self.pinned_ids)
        return len(want) - pinned <= self.slots - len(self.pinned_ids)

    def drop(self, lora_id: str) -> None:
        self.resident.pop(lora_id, None)

    def ensure(self, ids: set[str | None]) -> list[tuple[str, str | None]]:
        """prepare_lora_batch for one forward: mark its adapters used, load the missing ones. Returns
        (loaded id, evicted id or None) per load (the base model is loaded for free)."""
        self._clock += 1
        for i in ids:
            if i in self.resident:
                self.resident[i][1] = self._clock
        loads: list[tuple[str, str | None]] = []
        for i in sorted(ids - set(self.resident), key=lambda x: (x is not None, x or "")):
            victim = None
            if len(self.resident) >= self.slots:
                candidates = [u for u in self.resident if u not in ids and u not in self.pinned_ids]
                real = [u for u in candidates if u is not None]
                candidates = real or candidates
                if not candidates:
                    raise RuntimeError("No available buffer slots found. Please ensure the number of active "
                                       "(pinned) loras is less than max_loras_per_batch.")
                slot = 0 if self.policy == "fifo" else 1
                victim = min(candidates, key=lambda u: self.resident[u][slot])
                del self.resident[victim]
            self.resident[i] = [self._clock, self._clock]
            if i is not None:
                loads.append((i, victim))
        return loads
