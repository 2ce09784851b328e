"""ForwardBatch: the only interface between the Scheduler and the ModelRunner."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

if TYPE_CHECKING:
    from rollout.attention.base import AttentionBackend
    from rollout.memory import ReqToTokenPool, TokenToKVPool
    from rollout.sampling_info import SamplingBatchInfo


# The int64 index tensors of a batch, in the order of HostIndices.flat: first the per-token
# ones, then the per-request ones.
INDEX_FIELDS = ("input_ids", "positions", "out_cache_loc", "token_req_pool_indices",
                "req_pool_indices", "seq_lens", "extend_seq_lens", "extend_prefix_lens")
NUM_TOKEN_FIELDS = 4
# An EXTEND batch's last-token rows (`ForwardBatch.logits_rows`), packed after INDEX_FIELDS.
LOGITS_ROWS = "logits_rows"
# KV slots of tokens another request computes (a prompt's KV shared by its samples,
# `prompt_group`) that a request's row starts to reference in this batch, packed last:
# req_to_token gets them with the new tokens' slots
SHARED_FIELDS = ("shared_token_rows", "shared_positions", "shared_slots")


@dataclass(frozen=True)
class HostIndices:
    """The batch's index tensors as built on the host, packed: copied to the device in one go,
    and what a TP leader sends its followers (no device→host copy on the step)."""

    names: tuple[str, ...]
    sizes: list[int]
    flat: torch.Tensor  # int64, CPU


class ForwardMode(Enum):
    EXTEND = auto()  # prefill, or prefill of a suffix after a cached prefix
    DECODE = auto()  # one new token per request
    MIXED = auto()  # chunked prefill together with decodes
    IDLE = auto()  # no work on this rank; still joins the collectives
    TARGET_VERIFY = auto()  # reserved: speculative decoding
    DRAFT_EXTEND = auto()  # reserved: speculative decoding

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One step's tokens and where their KV lives. Tensors are on the runner's device.

    Per request i: `seq_lens[i]` tokens are in the KV cache after this step, the last
    `extend_seq_lens[i]` of which are computed now (1 in DECODE), after `extend_prefix_lens[i]`
    already-cached tokens. `input_ids`/`positions`/`out_cache_loc` are flat over those tokens."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [batch] int64
    seq_lens: torch.Tensor  # [batch] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    sampling_info: Optional["SamplingBatchInfo"] = None
    return_all_logits: bool = False  # prompt logprobs: logits for every token, not just the last
    # the caller reads the logits before it runs another forward (the engine samples at once):
    # a decode graph may return its output buffer instead of a copy
    logits_read_at_once: bool = False
    # rows past the request's extend length are padding (a prefill CUDA graph's static batch):
    # the attention backend leaves them zero
    padded_tokens: bool = False
    req_to_token_pool: Optional["ReqToTokenPool"] = None
    token_to_kv_pool: Optional["TokenToKVPool"] = None
    attn_backend: Optional["AttentionBackend"] = None
    extend_seq_lens: Optional[torch.Tensor] = None  # [batch] int64
    extend_prefix_lens: Optional[torch.Tensor] = None  # [batch] int64
    token_req_pool_indices: Optional[torch.Tensor] = None  # [num_tokens]: request row per token
    # [batch]: each request's last token, the rows `logits_indices` returns (None: computed there)
    logits_rows: Optional[torch.Tensor] = None
    # SHARED_FIELDS: req_to_token[shared_token_rows[i], shared_positions[i]] = shared_slots[i],
    # slots whose KV was computed for another request: in an earlier step, or in this one (every
    # layer stores the step's new KV before its attention reads any). None: none
    shared_token_rows: Optional[torch.Tensor] = None
    shared_positions: Optional[torch.Tensor] = None
    shared_slots: Optional[torch.Tensor] = None
    host_indices: Optional[HostIndices] = None
    # overlap scheduling: the device tokens the previous step is still sampling, one per row in
    # this batch's order — its input ids, which `input_ids` does not hold yet. The runner takes
    # them in (`resolve_input_ids`, or a decode graph's input kernel reading them directly)
    input_ids_source: Optional[torch.Tensor] = None
    # some rows' input ids were copied into `input_ids` on the device (from the previous step's
    # tokens, in another row order): the host's ids do not hold them
    input_ids_copied_on_device: bool = False
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_seq_lens_cpu, default=0)

    def stacked(self, names: Sequence[str]) -> Optional[torch.Tensor]:
        """The named index fields as one [len(names), n] view when they are consecutive, equally
        long segments of one tensor (as the batch builders lay out a step's indices), else None:
        a CUDA graph's static inputs then take them in one copy."""
        first = getattr(self, names[0])
        if first is None or first.dim() != 1 or first.stride(0) != 1:
            return None
        n, base, storage = first.numel(), first.storage_offset(), first.untyped_storage().data_ptr()
        for i, name in enumerate(names):
            t = getattr(self, name)
            if (t is None or t.dtype != first.dtype or t.dim() != 1 or t.stride(0) != 1
                    or t.numel() != n or t.untyped_storage().data_ptr() != storage
                    or t.storage_offset() != base + i * n):
                return None
        return first.as_strided((len(names), n), (n, 1))

    def copy_indices(self, dst: torch.Tensor, names: Sequence[str]) -> int:
        """dst[i, :n] = the index field names[i] (all of one length n, returned): one copy when
        they are `stacked`, else one per field. How a CUDA graph's static inputs are filled."""
        src = self.stacked(names)
        if src is not None:
            dst[:, :src.shape[1]].copy_(src, non_blocking=True)
            return src.shape[1]
        n = getattr(self, names[0]).numel()
        for row, name in zip(dst, names):
            row[:n].copy_(getattr(self, name), non_blocking=True)
        return n

    def resolve_input_ids(self) -> None:
        """Copy `input_ids_source` into `input_ids` (on the stream, no host sync)."""
        if self.input_ids_source is not None:
            self.input_ids.copy_(self.input_ids_source, non_blocking=True)
            self.input_ids_source = None

    def logits_indices(self) -> Optional[torch.Tensor]:
        """Rows of the hidden states whose logits are needed (None: all of them)."""
        if self.forward_mode.is_decode or self.return_all_logits:
            return None
        if self.logits_rows is not None:  # packed with the batch's indices: already on the device
            return self.logits_rows
        last = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum_(0).sub_(1)
        if self.input_ids.device.type == "cuda":  # pinned + non_blocking: device tensor() would sync
            last = last.pin_memory().to(self.input_ids.device, non_blocking=True)
        return last
