"""SGLang 0.5.23's radix tree over the simulator's tokens (words), as `UnifiedRadixCache` keeps it.

(upstream: srt/mem_cache/unified_radix_cache.py, srt/mem_cache/unified_cache/unified_tree_core.py
`UnifiedTreeCore`, components/full.py `FullComponent`, components/mamba.py `MambaComponent`.)

- A compressed radix tree: a node holds the run of words since its parent (its edge); children are
  found by their first page. Keys are cut to whole pages (`--page-size`, 1 by default on CUDA) and a
  match is rounded down to a page, so with page 1 the match is per token.
- A match walks as far as the words agree, splitting the node it stops inside (SGLang splits during
  the match too), and ends at the deepest node every component accepts: for the KV alone any node;
  with mamba states only a node that holds one (`create_match_validator`). `full` is how far the KV
  matched, whether or not a state sits there (`full_kv_hit_length`).
- Full KV is locked by path (a lock on a node counts on it and every ancestor): tokens of locked
  nodes are protected, the others evictable. A mamba state is locked on its node alone.
- `evict_tokens` frees whole unlocked leaves, least recently used first (last access of the node;
  a match refreshes the path to the node it returns, an insert every node it walks), a parent
  becoming an unlocked leaf joins the candidates; a leaf's state goes with it.
- Namespaces: a request served with a LoRA adapter matches and inserts under that adapter's own
  root (SGLang appends the lora_id to `Req.extra_key`), so no prefix is shared across adapters or
  with the base model; the pool, the locks and the LRU are the tree's, whatever the namespace.
- `evict_states` frees unlocked mamba states in their own LRU order (a match refreshes only the state
  it returns, an insert the state it stores): an unlocked leaf is deleted whole (its KV too), an inner
  node only loses its state (a tombstone: its KV stays matchable for the KV, not for a state).
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

__all__ = ["Match", "Node", "RadixTree"]

_STRIDE = 64  # words compared per slice while looking for where two runs part


class Node:
    __slots__ = ("access", "children", "depth", "is_root", "key", "lock", "parent", "state", "state_access",
                 "state_lock")

    def __init__(self, parent: Node | None, key: list[str], depth: int) -> None:
        self.parent = parent
        self.key = key
        self.depth = depth  # words from the root to the end of this node
        self.children: dict = {}
        self.lock = 0  # path lock: requests holding this node or a descendant
        self.access = 0
        self.state = False  # holds a mamba state at `depth`
        self.state_lock = 0
        self.state_access = 0
        self.is_root = False


class Match(NamedTuple):
    node: Node  # the deepest node every component accepts (the root when nothing matched)
    length: int  # its depth: the reusable prefix
    full: int  # how far the KV matched (>= length)


def _common(edge: list[str], words: list[str], off: int, end: int) -> int:
    """How many words of `edge` equal words[off:end] from the start (C-speed slices, then a short scan)."""
    n = min(len(edge), end - off)
    if (edge if n == len(edge) else edge[:n]) == words[off : off + n]:
        return n
    i = 0
    while i + _STRIDE <= n and edge[i : i + _STRIDE] == words[off + i : off + i + _STRIDE]:
        i += _STRIDE
    while i < n and edge[i] == words[off + i]:
        i += 1
    return i


class RadixTree:
    def __init__(self, page: int = 1) -> None:
        self.page = max(1, page)
        self._clock = itertools.count(1)
        self.flush()

    def flush(self) -> None:
        self.root = self._new_root()
        # One root per namespace (a LoRA adapter: SGLang adds the lora_id to every key's extra_key, so
        # entries of different adapters never match each other); None is the base model's.
        self._roots: dict[str | None, Node] = {None: self.root}
        self.total = 0  # tokens held by the tree
        self.protected = 0  # ... in locked nodes
        self.states = 0  # mamba states held by the tree
        self._leaves: set[Node] = set()
        # (access, seq, leaf) whenever a leaf's access changes or a node becomes a leaf: a heap kept across
        # evictions (rebuilding one from every leaf per eviction costs ~1 us a leaf, and a full pool of
        # short prompts holds tens of thousands); an entry whose leaf was touched since, deleted or grew
        # children is stale and skipped when popped
        self._lru: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()
        self._state_nodes: set[Node] = set()

    @staticmethod
    def _new_root() -> Node:
        root = Node(None, [], 0)
        root.lock = 1  # never evicted
        root.is_root = True
        return root

    def root_of(self, ns: str | None) -> Node:
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = self._new_root()
        return root

    @property
    def evictable(self) -> int:
        return self.total - self.protected

    def _child_key(self, words: list[str], off: int) -> object:
        return words[off] if self.page == 1 else tuple(words[off : off + self.page])

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node` after n words: a new parent takes them (and the lock count); the state stays below."""
        parent = node.parent
        assert parent is not None
        head = Node(parent, node.key[:n], node.depth - len(node.key) + n)
        head.lock, head.access = node.lock, node.access
        parent.children[self._child_key(node.key, 0)] = head
        node.key = node.key[n:]
        node.parent = head
        head.children[self._child_key(node.key, 0)] = node
        return head

    def _walk(self, words: list[str], end: int, need_state: bool, start: Node) -> tuple[Node, Node, int]:
        """(deepest accepted node, last node walked, KV match length) for words[:end], from a root or
        from `start`, a node whose path is words[:start.depth]."""
        node = best = start
        off = node.depth
        while off < end:
            child = node.children.get(self._child_key(words, off))
            if child is None:
                break
            n = _common(child.key, words, off, end)
            n -= n % self.page
            if n == 0:
                break
            parted = n < len(child.key)
            if parted:
                child = self._split(child, n)
            node, off = child, off + n
            if not need_state or node.state:
                best = node
            if parted:
                break
        return best, node, off

    def match(self, words: list[str], limit: int, *, need_state: bool = False, ns: str | None = None) -> Match:
        end = min(len(words), limit)
        end -= end % self.page
        best, _, full = self._walk(words, end, need_state, self.root_of(ns))
        now = next(self._clock)
        n: Node | None = best
        while n is not None:
            n.access = now
            n = n.parent
        if best.state:
            best.state_access = now
        if not best.children and not best.is_root:
            self._push_leaf(best)
        return Match(best, best.depth, full)

    def _push_leaf(self, leaf: Node) -> None:
        heapq.heappush(self._lru, (leaf.access, next(self._seq), leaf))

    def insert(self, words: list[str], length: int, *, state: bool = False, start: Node | None = None,
               ns: str | None = None) -> Node:
        """Make words[:length] (cut to pages) a path of namespace `ns`; a state at its end when asked.
        Returns the node ending at that length (the root for 0). `start`: a node on that path (a
        request's locked node, whose path is its first words), to walk from instead of the root."""
        length -= length % self.page
        if start is None or start.depth > length or (start.parent is None and not start.is_root):
            start = self.root_of(ns)
        _, node, off = self._walk(words, length, False, start)
        now = next(self._clock)
        n: Node | None = node
        while n is not None:
            n.access = now
            n = n.parent
        if off < length:
            leaf = Node(node, words[off:length], length)
            leaf.access = now
            if not node.is_root and not node.children:
                self._leaves.discard(node)
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._leaves.add(leaf)
            self.total += length - off
            node = leaf
        if not node.children and not node.is_root:
            self._push_leaf(node)
        if state and not node.is_root:
            if not node.state:
                node.state = True
                self.states += 1
                self._state_nodes.add(node)
            node.state_access = now
        return node

    # ---- locks -----------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        if node.is_root:
            return
        node.state_lock += 1
        n: Node | None = node
        while n is not None and not n.is_root:
            if n.lock == 0:
                self.protected += len(n.key)
            n.lock += 1
            n = n.parent

    def unlock(self, node: Node) -> None:
        if node.is_root:
            return
        node.state_lock -= 1
        n: Node | None = node
        while n is not None and not n.is_root:
            n.lock -= 1
            if n.lock == 0:
                self.protected -= len(n.key)
            n = n.parent

    def unlocked_len(self, node: Node) -> int:
        """Tokens on the path to `node` that a lock on it would move from evictable to protected."""
        total, n = 0, node
        while not n.is_root and n.lock == 0:
            total += len(n.key)
            n = n.parent  # type: ignore[assignment]
        return total

    # ---- eviction --------------------------------------------------------------------------
    def _delete_leaf(self, leaf: Node) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._child_key(leaf.key, 0)]
        leaf.parent = None  # detached
        self._leaves.discard(leaf)
        self.total -= len(leaf.key)
        if leaf.state:
            leaf.state = False
            self.states -= 1
            self._state_nodes.discard(leaf)
        if not parent.is_root and not parent.children:
            self._leaves.add(parent)
            self._push_leaf(parent)

    def evict_tokens(self, n: int) -> int:
        """Free at least n tokens (whole leaves, LRU first) if the unlocked part holds them; returns freed."""
        freed = 0
        if n <= 0:
            return 0
        heap = self._lru
        if len(heap) > 4 * len(self._leaves) + 1024:  # mostly stale entries: rebuild from the leaves
            heap[:] = [(leaf.access, next(self._seq), leaf) for leaf in self._leaves]
            heapq.heapify(heap)
        locked = []
        while freed < n and heap:
            entry = heapq.heappop(heap)
            access, _, leaf = entry
            if leaf.access != access or leaf.children or leaf.parent is None:
                continue  # stale: touched since, grew children or deleted
            if leaf.lock:
                locked.append(entry)  # not evictable now; it keeps its place for later
                continue
            freed += len(leaf.key)
            self._delete_leaf(leaf)  # a parent left without children joins the heap
        for entry in locked:
            heapq.heappush(heap, entry)
        return freed

    def evict_states(self, n: int) -> int:
        """Free up to n unlocked mamba states, LRU first; returns how many."""
        freed = 0
        if n <= 0:
            return 0
        heap = [(s.state_access, id(s), s) for s in self._state_nodes if s.state_lock == 0]
        heapq.heapify(heap)
        while freed < n and heap:
            _, _, node = heapq.heappop(heap)
            if not node.state or node.state_lock:
                continue
            freed += 1
            if not node.children and node.lock == 0:
                self._delete_leaf(node)
            else:
                node.state = False
                self.states -= 1
                self._state_nodes.discard(node)
        return freed
