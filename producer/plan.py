"""The prefix plan: feed prompts that share a prefix together, to one server, so each server prefills a
shared document, template or system prompt once and reuses it from its radix cache.

SGLang's radix cache reuses a prefix only on the server that holds it, and only while it is still in
its memory. The whole job is in the store before it runs, so the head can order it globally:

- **A key per prompt** (`prefix_key`, at enqueue, no tokenizer): the request's conversation as the
  store holds it (its canonical JSON from `"messages"`, `"prompt"` or `"input"` on: everything a server
  renders after the fixed part of its template) is hashed at anchors of growing length (512 B, 1 KiB,
  2 KiB, ... 128 KiB: 2x apart), each component a 16-bit slice of the running CRC-32 up to that
  anchor, the chain seeded by the model (a LoRA adapter's prompts are cached apart). Prompts sharing
  a prefix up to an anchor share the key's components up to it, so sorting by key puts them next to
  each other, the longest shared prefixes innermost. The key stops at the last anchor within the
  conversation: what follows it cannot make prompts share more, and is not hashed.
- **LoRA adapters** (`adapter_group`): a request on an adapter (`model: "<base>:<adapter>"`) has a key
  of odd length, a 5-byte group (`L` + CRC-32 of the adapter's name) before its prefix components (2
  bytes each: a base model's key is always even). A server's running batch holds at most
  `--max-loras-per-batch` adapters and loading one into a GPU slot costs time, so an adapter's prompts
  are fed together, to one server: the group is the plan's primary sort key, units do not cross an
  adapter (and grow along one, up to `unit_max`, prefix or not), and a unit goes to the queue whose last
  prompt ran the same adapter first. Each server then runs a few adapters in turn, not all at once.
- **The order** (`Store.plan`): the waiting prompts sorted by (adapter group: the base model's first,
  longest expected work of the key's family first, key, input order), built once after an enqueue in
  one sorted pass of SQLite's (bounded memory): inside the feed's transaction for a small store, beside
  the head's loop for a large one (`planbuild.Build`: the feed goes on meanwhile).
- **Units and their servers** (`Dealer`, at feed time): consecutive prompts whose common prefix is at
  least `SHARED_MIN` bytes form a unit (at most `unit_max` prompts); a unit goes whole to one queue:
  of the queues with room, the one whose last prompt shares the longest prefix with it (a template
  whose prompts outnumber a window keeps to the server that holds it), else the next one in turn.
  Each job carries its unit (`grp`), so a worker stealing from another GPU's queue takes whole units
  from its tail (`worker/lua/claim.lua`), splitting one only when it is all that queue has left.
- **What it predicts**: per queue, the bytes of each prompt's conversation it shares with the prompt
  fed to the same queue before it (`shared`) against all its bytes (`total`): the share of prefill the
  servers can skip, which the supervisor weighs against what the radix cache costs (mamba slots).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["ANCHORS", "GROUP_BYTES", "SHARED_MIN", "Dealer", "PlanRow", "Unit", "adapter_group", "common_prefix",
           "conversation", "plan_key", "prefix_key"]

# Bytes of the conversation at which the key takes a component: 2x apart, so a shared prefix is
# resolved to within a factor of 2 of its length (the units are cut on the bytes prompts really share,
# `common_prefix`: the key only sorts), up to 128 KiB (~32K tokens).
ANCHORS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)  # from SHARED_MIN: less is not grouped
# Where the conversation starts in a canonical body (keys sorted: these come after "max_tokens" & co.).
_STARTS = (b'"messages":', b'"prompt":', b'"input":')
_MARKER = {"messages": _STARTS[0], "prompt": _STARTS[1], "input": _STARTS[2]}
# A prefix shorter than this is not worth keeping prompts together for (about 128 tokens).
SHARED_MIN = 512
GROUP_BYTES = 5  # a LoRA adapter's group at the start of its prompts' keys: b"L" + CRC-32 of its name


def _start(canon: bytes) -> int:
    for marker in _STARTS:
        at = canon.find(marker)
        if at >= 0:
            return at
    return 0


def conversation(canon: bytes) -> bytes:
    """The part of a canonical body a server renders after its template's fixed start: from its
    `messages` (chat), `prompt` (completions) or `input` (embeddings) on."""
    return canon[_start(canon):]


_SEEDS: dict[str, int] = {}
_PACK = [struct.Struct(f">{n}H") for n in range(len(ANCHORS) + 1)]
_PACK1 = _PACK[1].pack


def prefix_key(canon: bytes, model: str = "", field: str | None = None) -> bytes:
    """The prompt's plan key (see the module doc): 2 bytes per anchor within its conversation. A
    conversation shorter than the first anchor has an empty key: nothing of it is worth grouping.
    `field`: the body's conversation key when the caller knows it ("messages", "prompt", "input"): one
    search instead of up to three."""
    if len(canon) < ANCHORS[0]:
        return b""
    marker = _MARKER.get(field) if field else None
    at = canon.find(marker) if marker else _start(canon)
    if at < 0:
        at = 0
    n = len(canon) - at
    if n < ANCHORS[0]:
        return b""
    crc = _SEEDS.get(model)
    if crc is None:
        crc = zlib.crc32(model.encode())
        if len(_SEEDS) < 1024:  # the models of a run are few; a run of many is only not cached
            _SEEDS[model] = crc
    crc32 = zlib.crc32
    if n < ANCHORS[1]:  # one component: most prompts of a few hundred tokens (no loop, no list)
        return _PACK1(crc32(canon[at:at + ANCHORS[0]], crc) & 0xFFFF)
    parts = []
    done = at
    for anchor in ANCHORS:
        if anchor > n:
            break
        crc = crc32(canon[done:at + anchor], crc)
        done = at + anchor
        parts.append(crc & 0xFFFF)
    return _PACK[len(parts)].pack(*parts)


def adapter_group(pk: bytes | None) -> bytes:
    """The LoRA adapter group a plan key starts with (b"": the base model, or no key)."""
    return pk[:GROUP_BYTES] if pk and len(pk) % 2 else b""


def plan_key(canon: bytes, body: dict[str, Any]) -> bytes:
    """The plan key of a request whose canonical JSON is `canon` (`body` parsed): `prefix_key`, its
    chain seeded by the model the request names; on a LoRA adapter (`model: "<base>:<adapter>"`, the
    stored form) its adapter group first (module doc)."""
    model = body.get("model")
    field = "messages" if "messages" in body else "prompt" if "prompt" in body else "input" if "input" in body else None
    key = prefix_key(canon, model if isinstance(model, str) else "", field)
    if isinstance(model, str) and ":" in model:
        adapter = model.split(":", 1)[1]
        if adapter:
            return b"L" + zlib.crc32(adapter.encode()).to_bytes(4, "big") + key
    return key


def common_prefix(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` share: blocks of 4 KiB compared at C speed, then a binary
    search within the first block that differs."""
    n = min(len(a), len(b))
    i, step = 0, 4096
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    lo, hi = i, min(i + step, n)
    if a[lo:hi] == b[lo:hi]:
        return hi
    hi -= 1  # a[i:lo] == b[i:lo]; a[i:hi + 1] != b[i:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[i:mid] == b[i:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PlanRow(NamedTuple):
    """A waiting prompt as the feed reads it, in plan order."""

    seq: int
    cid: str
    url: str
    body: bytes  # canonical JSON, as stored and sent
    fp: str  # fingerprint, hex ("" for a row made before fingerprints)
    pos: int = 0  # its place in the plan (0: fed without one)
    cost: int = 0  # its expected work (max_tokens; UNBOUNDED_COST without one)
    group: bytes = b""  # its LoRA adapter's group (`adapter_group`; b"": the base model, or fed without a plan)


@dataclass(slots=True)
class Unit:
    """Prompts fed together to one queue; `grp` names it in their jobs (its first prompt's seq)."""

    rows: list[PlanRow] = field(default_factory=list)
    # bytes each row shares with the row before it (the first: with the last row its queue was fed);
    # once dealt, what is shorter than SHARED_MIN counts 0
    shared: list[int] = field(default_factory=list)
    size: int = 0  # bytes of its rows' conversations
    # once dealt: the first unit of the chain this one continues on its queue (its first prompt shares at
    # least SHARED_MIN bytes with the last prompt fed there: a template's prompts cut at unit_max), 0: none
    family: int = 0

    @property
    def grp(self) -> str:
        """Its name in its jobs: its first prompt's seq, then `/` and its family's when it continues one
        (the worker sends one leader per family); "" for a unit of one prompt that continues nothing."""
        first = self.rows[0].seq
        if self.family and self.family != first:
            return f"{first}/{self.family}"
        return str(first) if len(self.rows) > 1 else ""


@dataclass(slots=True)
class _QueueLast:
    conversation: bytes | None = None  # the last prompt fed to the queue (its conversation)
    group: bytes = b""  # ... and its LoRA adapter's group
    family: int = 0  # ... and the chain of units it belongs to (`Unit.family`)


class Dealer:
    """Deals rows in plan order to queues as units (module doc). It remembers the last prompt each
    queue got for as long as it lives (the head's life): affinity across feed passes."""

    def __init__(self, unit_max: int = 64) -> None:
        self.unit_max = unit_max
        self.last: dict[str, _QueueLast] = {}
        self.shared: dict[str, int] = {}  # queue -> bytes its prompts share with the one before them there
        self.total: dict[str, int] = {}  # queue -> bytes of its prompts' conversations
        self._turn = -1

    def deal_rows(self, rows: Sequence[PlanRow], room: dict[str, int]) -> dict[str, list[Unit]]:
        """queue -> its share of `rows` (a prefix of them in all) as units, only queues that got some: rows
        in plan order (`pos`) as the plan's units (`units`, `deal`), others one a unit, to the queues with
        room in turn (no prediction: nothing shared, no size)."""
        if rows[0].pos:
            return {q: units for q, units in self.deal(self.units(rows), room).items() if units}
        out: dict[str, list[Unit]] = {q: [] for q in room}
        left, order, i = dict(room), list(room), 0
        for row in rows:
            while left[order[i % len(order)]] == 0:
                i += 1
            q = order[i % len(order)]
            out[q].append(Unit(rows=[row], shared=[0]))
            left[q] -= 1
            i += 1
            if not any(left.values()):
                break
        return {q: units for q, units in out.items() if units}

    def units(self, rows: Sequence[PlanRow]) -> list[Unit]:
        """Cut rows (in plan order) into units: a unit grows while each row shares at least SHARED_MIN
        bytes with the one before it, up to `unit_max` rows."""
        out: list[Unit] = []
        unit: Unit | None = None
        prev: bytes | None = None
        group = b""
        for row in rows:
            text = conversation(row.body)
            shared = common_prefix(prev, text) if prev is not None else 0
            # a LoRA adapter's rows stay together (prefix or not); no unit crosses from one adapter to another
            together = row.group == group and (shared >= SHARED_MIN or bool(group))
            if unit is None or not together or len(unit.rows) >= self.unit_max:
                unit = Unit()
                out.append(unit)
            unit.rows.append(row)
            unit.shared.append(shared)
            unit.size += len(text)
            prev, group = text, row.group
        return out

    def deal(self, units: Sequence[Unit], room: dict[str, int]) -> dict[str, list[Unit]]:
        """Each unit, whole, to one queue with room (`room[q]`: prompts it may still take; a unit may
        take a queue past it): the one whose last prompt shares the most with the unit's first, when
        that is at least SHARED_MIN bytes, else the next with room in turn. Stops when no queue has
        room; the units not dealt are the caller's to feed later."""
        self._turn = -1
        dealt: dict[str, list[Unit]] = {q: [] for q in room}
        left = dict(room)
        for unit in units:
            open_ = [q for q, n in left.items() if n > 0]
            if not open_:
                break
            first = conversation(unit.rows[0].body)
            q = self._best(open_, first, unit.rows[0].group)
            dealt[q].append(unit)
            left[q] -= len(unit.rows)
            self._account(q, unit, first)
        return dealt

    def _best(self, queues: list[str], first: bytes, group: bytes = b"") -> str:
        if group:  # a LoRA adapter's unit: to a queue whose last prompt ran the same adapter
            for q in queues:
                last = self.last.get(q)
                if last is not None and last.group == group:
                    return q
        best, best_shared = None, SHARED_MIN - 1
        for q in queues:
            last = self.last.get(q)
            if last is not None and last.conversation is not None:
                shared = common_prefix(last.conversation, first)
                if shared > best_shared:
                    best, best_shared = q, shared
        if best is not None:
            return best
        self._turn += 1  # nothing shared: the next queue with room, in turn (the longest work spreads out)
        return queues[self._turn % len(queues)]

    def _account(self, q: str, unit: Unit, first: bytes) -> None:
        """The prediction: each row's shared bytes with the one fed to this queue before it."""
        last = self.last.setdefault(q, _QueueLast())
        unit.shared[0] = common_prefix(last.conversation, first) if last.conversation is not None else 0
        unit.family = last.family if unit.shared[0] >= SHARED_MIN and last.family else unit.rows[0].seq
        last.family = unit.family
        unit.shared = [n if n >= SHARED_MIN else 0 for n in unit.shared]  # less is not worth a cache's while
        self.shared[q] = self.shared.get(q, 0) + sum(unit.shared)
        self.total[q] = self.total.get(q, 0) + unit.size
        last.conversation = conversation(unit.rows[-1].body)
        last.group = unit.rows[-1].group
