"""When SGLang 0.5.23 matches a request against the radix tree and what it inserts, per model kind
and `--mamba-radix-cache-strategy` (the tree itself: prefix_cache.py).

A request, once admitted, locks one node (`req.cache_node`); the tree owns its first `req.cache_len`
tokens (SGLang's `cache_protected_len`) and the rest of its KV is its own (private). Upstream:
`Req.init_next_round_input` and `mem_cache/common.py` `match_kv_cache` (match, key limit),
`checkpoint_kv_cache`, `release_kv_cache`; `UnifiedRadixCache.checkpoint_into_tree` (insert, lock
move); `components/mamba.py` `prepare_for_caching_req`, `_select_finished_checkpoint`,
`finalize_match_result_in_tree_core` (branching point); `ScheduleBatch
._mamba_radix_cache_v2_req_prepare_for_extend` (where extra_buffer tracks a state in a prefill) and
`prepare_for_decode` (every `mamba_track_grid` tokens in decode).

- Match: the request's tokens so far (prompt, plus output kept by a retracted request) up to one
  short of their length (`_compute_max_prefix_len`), cut to pages. Plain models reuse the whole KV
  match; hybrid models only up to the deepest node holding a mamba state.
- Plain models insert the KV at each chunk end and at the end of prefill (the tokens so far), and at
  finish the prompt and output (`owned_kv_len` = prompt + output - 1, the last token has no KV yet).
- `no_buffer` does the same, with a copy of the request's live state at each insert's end.
- `extra_buffer`, `extra_buffer_lazy`: a prefill extend [p, e) of at least one checkpoint grid
  g = lcm(max(64, page), page) tracks the state at p + floor((e - p) / g) * g, or at the branching
  point b = floor(kv_match / g) * g of the request's match if b lies in (p, e) on that grid and
  beyond the reused state; the KV and state are inserted up to there (the rest of the prompt stays
  private). Decode tracks the state at multiples of T = lcm(g, --mamba-track-interval); at finish the
  last one reached after the prefill is inserted (prompt and output up to it), else nothing. Lazy
  keeps that decode checkpoint only if a mamba slot was free (it never evicts for it).
- Retraction and abort insert nothing (`release_kv_cache(checkpoint=False)`).
- Each LoRA adapter has its own namespace of the tree (`Req.extra_key` holds the lora_id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .prefix_cache import RadixTree

if TYPE_CHECKING:
    from .engine import Request

__all__ = ["CacheConfig", "RequestCache"]

FLA_CHUNK = 64  # the linear-attention kernels' chunk (FLA CHUNK_SIZE), the profiles' mamba_chunk_size


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool  # not --disable-radix-cache
    hybrid: bool  # the model has mamba state
    strategy: str  # resolved --mamba-radix-cache-strategy
    page: int = 1  # --page-size
    chunk: int = 8192  # chunked_prefill_size
    track_interval: int = 256  # --mamba-track-interval


class RequestCache:
    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.tree = RadixTree(cfg.page)
        self.states = cfg.hybrid  # matches must end on a mamba state
        self.extra = cfg.hybrid and cfg.strategy.startswith("extra_buffer")
        self.lazy = cfg.hybrid and cfg.strategy == "extra_buffer_lazy"
        self.grid = math.lcm(max(FLA_CHUNK, cfg.page), cfg.page)  # mamba_checkpoint_grid
        self.track = math.lcm(self.grid, max(1, cfg.track_interval))  # mamba_track_grid

    @staticmethod
    def _fill(req: Request) -> list[str]:
        return req.prompt_words + req.output_words[: req.generated] if req.generated else req.prompt_words

    @property
    def protected(self) -> int:
        return self.tree.protected

    def admit(self, req: Request) -> tuple[int, int]:
        """Match and lock; returns (reused tokens, tokens the lock moved from evictable to protected)."""
        req.prefix_len, req.cache_len, req.branching = 0, 0, None
        if not self.cfg.enabled:
            return 0, 0
        words = self._fill(req)
        m = self.tree.match(words, len(words) - 1, need_state=self.states, ns=req.adapter)
        moved = self.tree.unlocked_len(m.node)
        self.tree.lock(m.node)
        req.cache_node, req.cache_len, req.prefix_len = m.node, m.length, m.length
        if self.extra:
            b = m.full // self.grid * self.grid
            req.branching = b if b > m.length else None
        return m.length, moved

    def release(self, req: Request) -> None:
        """Unlock without inserting (retraction, abort, a batch put back)."""
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_len = None, 0

    def _move_lock(self, req: Request, words: list[str], length: int, *, state: bool) -> None:
        # the request's locked node ends its first cache_len words: the walk starts there
        node = self.tree.insert(words, length, state=state, start=req.cache_node, ns=req.adapter)
        self.tree.lock(node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_len = node, node.depth

    def prefilled(self, req: Request) -> None:
        """The request's prefill (every chunk of it) ran: checkpoint each chunk end as 0.5.23 does."""
        words = self._fill(req)
        end = req.prefill_end = len(words)
        if not self.cfg.enabled:
            return
        page, chunk = self.cfg.page, max(1, self.cfg.chunk)
        pos = req.prefix_len
        while pos < end:
            nxt = end if pos + chunk >= end else (pos + chunk) // page * page
            if nxt <= pos:
                nxt = end
            self._checkpoint(req, words, pos, nxt)
            pos = nxt

    def _checkpoint(self, req: Request, words: list[str], start: int, end: int) -> None:
        if not self.extra:
            self._move_lock(req, words, end, state=self.states)
            return
        extend = end - start
        if extend < self.grid:  # no state tracked in this extend: nothing is inserted
            return
        at = start + extend // self.grid * self.grid
        b = req.branching
        if b is not None and start < b < end and (b - start) % self.grid == 0:
            at = b
        self._move_lock(req, words, at, state=True)

    def finished(self, req: Request, *, slot_free: bool = True) -> None:
        """Insert what 0.5.23 keeps of a finished request, then unlock it."""
        if self.cfg.enabled and req.generated > 0:
            words = req.prompt_words + req.output_words[: req.generated - 1]
            owned = len(words)
            if not self.states:
                self._move_lock(req, words, owned, state=False)
                prompt = len(req.prompt_words) // self.cfg.page * self.cfg.page
                if 0 < prompt < owned // self.cfg.page * self.cfg.page and req.prefill_end != len(req.prompt_words):
                    # a node boundary at the prompt's end (the end-of-prefill insert made it already
                    # unless the request was re-admitted with output)
                    self.tree.insert(req.prompt_words, prompt, ns=req.adapter)
            elif not self.extra:
                self._move_lock(req, words, owned, state=True)
            else:
                last = owned // self.track * self.track
                if last > req.prefill_end and (slot_free or not self.lazy):
                    self._move_lock(req, words, last, state=True)
        self.release(req)

    def private_tokens(self, req: Request) -> int:
        return req.prompt_tokens + req.generated - req.cache_len
