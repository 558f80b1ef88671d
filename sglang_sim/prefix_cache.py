"""A modest radix (prefix) cache model: shared prompt prefixes hit, diverse prompts hit little.

Prompts are cut into blocks of BLOCK words; a block is identified by the hash of everything up
to and including it, so a hit means the whole prefix matched. Finished requests insert their
prompt blocks; an LRU bound keeps the cache to a share of the KV pool. Cached (evictable) tokens
are counted as free, as in SGLang's usage figures.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BLOCK", "PrefixCache"]

BLOCK = 16


def _chain(words: list[str]) -> list[int]:
    hashes, h = [], 0
    for i in range(0, len(words) - len(words) % BLOCK, BLOCK):
        h = hash((h, tuple(words[i : i + BLOCK])))
        hashes.append(h)
    return hashes


class PrefixCache:
    def __init__(self, capacity_tokens: int, *, enabled: bool) -> None:
        self.enabled = enabled
        self.max_blocks = max(1, capacity_tokens // BLOCK)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, words: list[str]) -> int:
        """Tokens of the longest cached prefix (never the whole prompt: the last token is recomputed)."""
        if not self.enabled:
            return 0
        hit = 0
        for h in _chain(words):
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hit += BLOCK
        return min(hit, len(words) - 1)

    def insert(self, words: list[str]) -> None:
        if not self.enabled:
            return
        for h in _chain(words):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def flush(self) -> None:
        self._blocks.clear()
