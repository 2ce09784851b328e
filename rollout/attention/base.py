"""The attention-backend seam. A backend builds its metadata once per batch, then serves every
layer's attention for that batch; the KV of the new tokens is written through the pool."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout.forward_batch import ForwardBatch
    from rollout.layers.attention import Attention


class AttentionBackend(ABC):
    # prefill CUDA graphs (`prefill_graphs`): the extend metadata is built from the batch's
    # device tensors only, and padded token rows (`ForwardBatch.padded_tokens`) come out zero
    supports_extend_graphs = False

    @abstractmethod
    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        """Build whatever the kernels need for this batch (called once per step)."""

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] of the new tokens → [num_tokens, heads, head_dim]."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        """q: [batch, heads, head_dim], one token per request → same shape."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "Attention", fb: "ForwardBatch", kv_stored: bool = False) -> torch.Tensor:
        """`kv_stored`: the model already wrote k and v to the pool (the fused rotary kernel)."""
        if not kv_stored:
            fb.token_to_kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        if fb.forward_mode.is_decode:
            return self.forward_decode(q, layer, fb)
        return self.forward_extend(q, layer, fb)

    # Decode launches by context length: a backend whose decode grid depends on the batch's
    # longest context (not only on its size) names a class per launch; the graph runner captures
    # a decode graph per (batch size, class) and replays the batch's class.
    def decode_launch_classes(self, batch: int) -> tuple[int, ...]:
        """For each launch class at this batch size, a longest context that selects it (what
        its graph is captured with). One class unless a backend launches by context length."""
        return (1,)

    def decode_launch_class(self, batch: int, max_seq_len: int) -> int:
        """The class (an index into `decode_launch_classes(batch)`) of a decode batch of `batch`
        rows whose longest context has `max_seq_len` keys."""
        return 0

    # CUDA-graph hooks: backends that support decode graphs override these. Capture and replay
    # get the graph runner's static batch: its tensors are the static inputs the graph reads,
    # already filled (and padded) for this replay, so a backend reads them in place and keeps
    # static buffers only for what it derives from them.
    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture(self, fb: "ForwardBatch") -> None:
        raise NotImplementedError

    def init_forward_metadata_replay(self, fb: "ForwardBatch") -> None:
        raise NotImplementedError
