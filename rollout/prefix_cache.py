"""PrefixCache: a radix tree of token ids over KV slots, kept across generate calls.

Why: multi-turn and agentic rollouts send, turn after turn, a prompt that starts with the last
turn's whole conversation; an evaluation or a rollout with one system prompt sends the same
opening every time. Here the keys and values of a sample that leaves the engine stay in the KV
pool, under its tokens, and a later request whose tokens start the same way points its request
row at those slots and computes only the rest. Slots nobody uses are evicted, least recently
used first, only when the pool needs them, so the cache costs nothing but otherwise-free memory.

Rules the Scheduler keeps (it owns the tree and every call into it):
- KV depends on the weights, so the tree holds one weight version. `invalidate` (a new version)
  frees every node no resident request uses; the ones in use (in-place updates keep their
  requests' KV) turn stale — never matched again, freed with their last holder.
- A node's `holders` counts the resident requests whose rows use its slots (its own or a
  descendant's holders): locked nodes are never evicted. A match always ends on a node boundary
  (an edge matched part-way is split), so a holder uses the whole path from the root.
- The tree owns the slots of its nodes. `insert` takes only the caller's own slots (at or after
  `own_from`; those before are the tree's or a prompt group's) for tokens the tree lacks, and
  hands back the own slots of tokens it already has — duplicates the caller frees."""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(eq=False)
class CacheNode:
    tokens: np.ndarray  # the edge's token ids (int64)
    slots: np.ndarray  # their KV slots, owned by the tree
    parent: Optional["CacheNode"] = None
    children: dict[int, "CacheNode"] = field(default_factory=dict)
    holders: int = 0
    last_used: int = 0
    stale: bool = False  # of an older weight version: freed with its last holder, never matched

    @property
    def is_root(self) -> bool:
        return self.parent is None


class PrefixCache:
    def __init__(self, version: int = 0):
        self.root = CacheNode(_EMPTY, _EMPTY)
        self.version = version
        self.num_tokens = 0  # slots the tree owns (stale nodes included)
        self._clock = itertools.count(1)

    # ---- lookup --------------------------------------------------------------------------------
    def match(self, tokens: np.ndarray) -> tuple[CacheNode, int]:
        """The deepest node whose path is a prefix of `tokens`, and that path's length (0: the
        root). An edge matched part-way is split first, so the match ends on a node."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            n = _common_len(child.tokens, tokens[pos:])
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = now
            node, pos = child, pos + n
        return node, pos

    @staticmethod
    def path_slots(node: CacheNode) -> np.ndarray:
        """The slots of the tokens from the root to `node`, in order."""
        parts = []
        while not node.is_root:
            parts.append(node.slots)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else _EMPTY

    # ---- holders -------------------------------------------------------------------------------
    @staticmethod
    def lock(node: CacheNode) -> None:
        while not node.is_root:
            node.holders += 1
            node = node.parent

    def unlock(self, node: CacheNode) -> np.ndarray:
        """A holder of `node` left; returns the slots of stale nodes it was the last holder of."""
        freed = []
        while not node.is_root:
            node.holders -= 1
            parent = node.parent
            if node.stale and node.holders == 0:
                freed.extend(self._drop_subtree(node))
            node = parent
        return _concat(freed)

    # ---- insert / evict ------------------------------------------------------------------------
    def insert(self, tokens: np.ndarray, slots: np.ndarray, own_from: int = 0
               ) -> tuple[CacheNode, np.ndarray]:
        """Caches `tokens` (their KV in `slots`, a caller's row). Returns the node of the last
        token inserted or found and the caller's own slots (index ≥ own_from) the tree did not
        take (tokens it has already): those stay the caller's to free."""
        node, pos, now = self.root, 0, next(self._clock)
        untaken = []
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                if pos < own_from:  # cannot take another owner's slots: the path ends here
                    break
                leaf = CacheNode(tokens[pos:].copy(), slots[pos:].copy(), node, last_used=now)
                node.children[int(tokens[pos])] = leaf
                self.num_tokens += len(leaf.tokens)
                node, pos = leaf, len(tokens)
                break
            n = _common_len(child.tokens, tokens[pos:])
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = now
            if pos + n > own_from:
                untaken.append(slots[max(pos, own_from):pos + n])
            node, pos = child, pos + n
        if pos < len(tokens):
            untaken.append(slots[max(pos, own_from):])
        return node, _concat(untaken).copy()

    def evict(self, num_tokens: int) -> np.ndarray:
        """Frees at least `num_tokens` slots (fewer if the unlocked nodes hold fewer): whole
        leaves no request uses, least recently used first. Returns their slots."""
        heap = [(x.last_used, i, x) for i, x in enumerate(self._nodes())
                if not x.children and x.holders == 0]
        heapq.heapify(heap)
        order = itertools.count(len(heap))
        freed, count = [], 0
        while heap and count < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[int(leaf.tokens[0])]
            freed.append(leaf.slots)
            count += len(leaf.slots)
            self.num_tokens -= len(leaf.slots)
            if not parent.is_root and not parent.children and parent.holders == 0:
                heapq.heappush(heap, (parent.last_used, next(order), parent))
        return _concat(freed)

    def evictable_tokens(self) -> int:
        return sum(len(x.slots) for x in self._nodes() if x.holders == 0)

    def invalidate(self, version: int) -> np.ndarray:
        """The weights are now `version`: every node no request uses is freed (its slots
        returned), the rest turn stale, and the tree starts empty."""
        freed = []
        for child in list(self.root.children.values()):
            freed.extend(self._retire(child))
        self.root = CacheNode(_EMPTY, _EMPTY)
        self.version = version
        return _concat(freed)

    def clear(self) -> np.ndarray:
        """Every slot of the tree (no request may hold any): the KV pool is being reset."""
        freed = [x.slots for x in self._nodes()]
        self.root, self.num_tokens = CacheNode(_EMPTY, _EMPTY), 0
        return _concat(freed)

    # ---- internals -----------------------------------------------------------------------------
    def _split(self, node: CacheNode, n: int) -> CacheNode:
        """Cuts `node`'s edge after n tokens; returns the new upper node (`node` keeps the
        lower part, so its holders' references stay right)."""
        upper = CacheNode(node.tokens[:n], node.slots[:n], node.parent, {}, node.holders,
                          node.last_used, node.stale)
        node.parent.children[int(node.tokens[0])] = upper
        node.tokens, node.slots, node.parent = node.tokens[n:], node.slots[n:], upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _retire(self, node: CacheNode) -> list[np.ndarray]:
        """Frees the subtree's unused nodes and marks the used ones stale."""
        if node.holders == 0:
            return self._drop_subtree(node)
        node.stale = True
        freed = []
        for child in list(node.children.values()):
            freed.extend(self._retire(child))
        return freed

    def _drop_subtree(self, node: CacheNode) -> list[np.ndarray]:
        del node.parent.children[int(node.tokens[0])]
        stack, freed = [node], []
        while stack:
            x = stack.pop()
            freed.append(x.slots)
            self.num_tokens -= len(x.slots)
            stack.extend(x.children.values())
        return freed

    def _nodes(self) -> list[CacheNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out


def _common_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    parts = [p for p in parts if len(p)]
    return np.concatenate(parts) if parts else _EMPTY
