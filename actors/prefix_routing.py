"""PrefixRouter: which replica last served the longest start of a prompt.

Why: each replica's engine keeps the KV of the samples it served (rollout/prefix_cache.py), so
the next turn of a conversation — its last prompt, its sample and a tool reply — costs only its
new tokens there, and the whole prompt anywhere else. The controller records every sample it
returns (prompt and output) here under the replica that served it, and when it assigns a
prompt it counts the tokens that replica would find cached as work saved there
(`RolloutController._assign`): a conversation stays where its KV is unless that replica is
busier than the saving.

It is a radix tree of the samples' tokens (prompt ids, or the code points of a text prompt and
its output text) whose value per token is a replica index — the prefix cache's tree with a
replica in place of a KV slot. It only advises: a replica may have evicted what the tree
remembers, and a wrong guess costs a prefill, never a wrong result. A weight update empties it
(every cache is emptied); a replica's rebuild voids that replica's entries (each is tagged with
the replica's rebuild count: older ones are ignored when matched, and age out of the bound)."""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from rollout.prefix_cache import PrefixCache

Prompt = Union[str, Sequence[int]]

# Tokens the tree remembers at most (least recently used dropped first): a few replicas' KV pools.
MAX_TOKENS = 4_000_000


class PrefixRouter:
    def __init__(self, max_tokens: int = MAX_TOKENS):
        self.max_tokens = max_tokens
        self._tree = PrefixCache()
        self._generation: dict[int, int] = {}  # replica -> rebuilds seen (entries before are void)

    def match(self, prompt: Prompt) -> tuple[int, int]:
        """(replica, tokens) for the longest recorded start of `prompt` (-1, 0 if none): the
        replica that served its last token, and how many tokens of the prompt (all but its last,
        which a replica always computes) it would find cached."""
        ids = _ids(prompt)
        node, n = self._tree.match(ids[:len(ids) - 1])
        if n == 0:
            return -1, 0
        tag = int(node.slots[-1])
        replica, generation = divmod(tag, 1 << 20)
        if generation != self._generation.get(replica, 0):
            return -1, 0
        return replica, n

    def record(self, prompt: Prompt, output: Union[str, Sequence[int], None], replica: int) -> None:
        """A sample of `prompt` came back from `replica` (`output`: its token ids, or its text
        for a text prompt)."""
        ids = _ids(prompt)
        if output:
            ids = np.concatenate([ids, _ids(output)])
        tag = replica * (1 << 20) + self._generation.get(replica, 0)
        self._tree.insert(ids, np.full(len(ids), tag, dtype=np.int64))
        if self._tree.num_tokens > self.max_tokens:
            self._tree.evict(self._tree.num_tokens - self.max_tokens)

    def forget_replica(self, replica: int) -> None:
        """The replica was rebuilt: its cache is empty, so nothing recorded for it counts."""
        self._generation[replica] = self._generation.get(replica, 0) + 1

    def clear(self) -> None:
        """New weights: every replica's cache was emptied."""
        self._tree.clear()


def _ids(x: Union[str, Sequence[int]]) -> np.ndarray:
    if isinstance(x, str):
        return np.frombuffer(x.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    return np.asarray(x, dtype=np.int64)
