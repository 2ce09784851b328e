"""Request: one sample being generated. It owns its tokens, logprobs and KV row.

`kv_len`, `position`, `last_id` and `ends_by_length_when_applied` are read for every running
request on every step, so they are written out over the lists (no property calling another)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from rollout.prefix_cache import CacheNode
from rollout.prompt_group import PromptGroup
from rollout.routing_record import RoutingReadback
from rollout.sampling_params import SamplingParams
from rollout.stop_strings import StopStrings


@dataclass(eq=False)  # identity: list.remove / `in` never compare token lists
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int  # prompt + generated tokens may not exceed this (context or KV capacity)
    prompt_index: int = 0  # position of its prompt in the generate() call
    sample_index: int = 0  # which of the prompt's n samples
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    row: Optional[int] = None  # KV row while resident
    num_retractions: int = 0
    # Steps launched with this request whose sampled token is not applied yet (overlap
    # scheduling: at most the one in flight, briefly two while the next is queued behind it).
    pending: int = 0
    kv_allocated: int = 0  # KV slots its row holds (freed when it leaves, pending or not)
    # prompt_ids as a read-only int64 array (the request builder's, shared by a prompt's samples)
    prompt_array: Optional[np.ndarray] = field(default=None, repr=False)
    # the prompt's samples sharing its KV (prompt_group; None: not shared), and how many leading
    # slots of this request's row are that group's while resident (not its own to free)
    group: Optional[PromptGroup] = field(default=None, repr=False)
    shared_len: int = 0  # leading slots of its row that are not its own: the group's or the cache's
    group_member: bool = False  # holds its group's prompt KV while resident
    # the prefix cache's node its row's leading slots come from (locked while resident), the
    # weights' epoch its KV was computed under (`Scheduler.kv_epoch`), and how many tokens it
    # found cached (last admission)
    cache_node: Optional[CacheNode] = field(default=None, repr=False)
    kv_version: int = -1
    cached_tokens: int = 0
    # its own slots of tokens the tree already had when its prefill went in (freed when it leaves)
    dup_slots: Optional[np.ndarray] = field(default=None, repr=False)
    stop_strings: Optional[StopStrings] = field(default=None, repr=False)  # params.stop's checker
    matched_stop: Union[int, str, None] = None  # the stop token id or stop string that ended it
    # its tokens' experts, read back when it finished (`routing_record`; recorded engines only)
    routed_experts: Optional[RoutingReadback] = field(default=None, repr=False)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_ids(self) -> Union[np.ndarray, list[int]]:
        """The tokens a prefill of this request computes: `all_ids`, as the prompt's array while
        nothing is generated (the batch builder copies it, converting no ints)."""
        if self.prompt_array is not None and not self.output_ids:
            return self.prompt_array
        return self.all_ids

    def prefill_ids_from(self, start: int) -> Union[np.ndarray, list[int]]:
        """The tokens a prefill computes after `start` cached ones (`prefill_ids[start:]`)."""
        ids = self.prefill_ids
        return ids[start:] if start else ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_id(self) -> int:
        """The last token applied (a decode step's input id when nothing is pending)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is cached while running: all but the last sampled one (counting the
        tokens sampled on the device but not applied yet)."""
        sampled = len(self.prompt_ids) + len(self.output_ids) + self.pending
        return sampled - 1 if self.output_ids or self.pending else sampled

    @property
    def ends_by_length_when_applied(self) -> bool:
        """Its pending tokens will finish it on length: no further step needs it."""
        pending = self.pending
        if not pending:
            return False
        n_out = len(self.output_ids) + pending
        return n_out >= self.params.max_new_tokens or len(self.prompt_ids) + n_out >= self.max_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, version: int,
               top: Optional[list[tuple[int, float]]] = None) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.token_versions.append(version)
        if top is not None:
            self.top_logprobs.append(top)

    def check_finished(self, eos_ids: frozenset[int]) -> None:
        last = self.output_ids[-1]
        if last in self.params.stop_token_ids or (not self.params.ignore_eos and last in eos_ids):
            self.finish_reason, self.matched_stop = "stop", last
        elif (self.stop_strings is not None
              and (text := self.stop_strings.match(self.output_ids)) is not None):
            self.finish_reason, self.matched_stop = "stop", text
        elif (len(self.output_ids) >= self.params.max_new_tokens
              or len(self.prompt_ids) + len(self.output_ids) >= self.max_len):
            self.finish_reason = "length"
