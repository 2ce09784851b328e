"""The samples of one prompt share the KV cache of its prompt.

Why: RL rollouts ask for many samples of each prompt (GRPO groups of 8-64), as `n` or by giving
the prompt again (`request_builder.prompt_groups`: every sample of one `generate` call whose
prompt has the same tokens). Prefilled one by one, each sample computes the same prompt again
and holds its own copy of the same keys and values. Here the first sample admitted (the group's
leader) prefills the whole prompt; the KV slots of all its tokens but the last become the
group's, and every later sample of the prompt (a follower) points its request row at them and
computes only the last prompt token — its own logits for its own first draw — as an extend
after that cached prefix. A prompt of L tokens sampled n times then costs L + n - 1 prefill
tokens and L - 1 + n slots of prompt KV, not n·L of each.

The Scheduler owns the group's state (`slots`, `holders`, `version`, the lead); a request
only points at its group (`Request.group`) and says how many leading slots of its row are the
group's (`Request.shared_len`). The shared slots go back to the allocator when the last
holder leaves (finished, aborted or retracted). Followers join in their leader's step (every
layer writes all of a step's new keys and values to the cache before its attention reads
any, so the leader's prompt is there when they attend to it) or in a later one, but only
while the shared KV was computed with the current weights; otherwise a sample prefills its
prompt alone, or — when no sample holds the prompt's KV any more — leads anew.

With the prefix cache on (`prefix_cache`), the leader hands the prompt's slots to the cache's
tree in its step, and the group holds the tree's node instead (`node`, locked by each holder):
samples admitted later find the prompt there like any other cached prefix, and the samples'
own tokens can join the tree after it when they leave. The group then owns only the slots the
tree already had other copies of (a prompt computed twice in one step), freed with its last
holder."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from rollout.prefix_cache import CacheNode


@dataclass(eq=False)
class PromptGroup:
    prefix_len: int  # the prompt's tokens whose KV its samples share: all but the last
    slots: Optional[np.ndarray] = None  # their KV slots, while any sample holds them
    holders: int = 0  # resident samples whose rows point at `slots`
    version: int = -1  # the weight version `slots` was computed with
    lead_step: int = -1  # the scheduler step whose prefill computes `slots`
    lead_row: int = -1  # the leader's request row in that step
    node: Optional[CacheNode] = None  # with the prefix cache: the tree's node of the prompt

    def admission_prefix(self, step: int, version: int) -> int:
        """Cached leading tokens of a sample of this prompt admitted at scheduler step `step`
        under weight `version`: `prefix_len` (it follows: in its leader's step, or after it
        while the KV is held and of these weights), else 0 (it prefills its prompt: leading
        when `vacant`, alone otherwise)."""
        if self.lead_step == step or (self.node is None and self.slots is not None
                                      and self.version == version):
            return self.prefix_len
        return 0

    @property
    def vacant(self) -> bool:
        """No sample holds the prompt's KV, and none is computing it: the next admitted leads."""
        return self.slots is None and self.holders == 0

    def reserve_lead(self, step: int, row: int) -> None:
        """The sample on request row `row` leads in step `step`: the group's others admitted in
        it follow that row."""
        self.lead_step, self.lead_row = step, row

    def lead(self, slots: np.ndarray, version: int, node: Optional[CacheNode] = None) -> None:
        """The leader's batch took these slots for the prompt's first `prefix_len` tokens (with
        the prefix cache: `node` holds the prompt, and `slots` are the group's duplicates)."""
        self.slots, self.holders, self.version, self.node = slots, 1, version, node

    def follow(self) -> None:
        self.holders += 1

    def leave(self) -> Optional[np.ndarray]:
        """A holder left; the shared slots to free when it was the last one (else None)."""
        self.holders -= 1
        if self.holders:
            return None
        slots, self.slots, self.node = self.slots, None, None
        return slots


def new_group(prompt_len: int, samples: int) -> Optional[PromptGroup]:
    """The group of a prompt sampled `samples` times; None where nothing is shared (one sample,
    or a one-token prompt whose only token each sample computes itself)."""
    if samples < 2 or prompt_len < 2:
        return None
    return PromptGroup(prefix_len=prompt_len - 1)
