"""The experts each token was routed to, kept per KV slot, for MoE RL's routing replay.

RL on a mixture-of-experts policy drifts when the trainer's forward routes a token to other
experts than the rollout did (bf16 near-ties, other kernels); replaying the rollout's routing in
the trainer removes that source of mismatch. So with `EngineConfig.record_routed_experts` every
sparse layer writes the expert ids of the tokens it computes at their KV slots
(`RoutingPool.record`, one device scatter a layer, or on the decode paths the routing kernel's
own store into `layer`; captured in the decode graphs), and a sample's routing is read back
when it finishes, by its slots (`read`). Keyed by slot, a token's
routing is there whoever computed it: a shared prompt's lead sample, an earlier call whose KV the
prefix cache kept, a retracted sample's recomputation."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class RoutingPool:
    """[sparse layers, KV slots, top_k] expert ids (int16) on the KV cache's device."""

    def __init__(self, num_layers: int, num_slots: int, top_k: int, device: torch.device):
        self.ids = torch.zeros(num_layers, num_slots, top_k, dtype=torch.int16, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, top_k: int) -> int:
        return num_layers * top_k * 2

    def layer(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s ids [slots, top_k], which the decode routing kernel writes itself."""
        return self.ids[layer]

    def record(self, layer: int, loc: torch.Tensor, experts: torch.Tensor) -> None:
        """Layer `layer`'s expert ids [T, top_k] of the tokens at KV slots `loc` [T] (a graph's
        padded rows write the dummy slot 0)."""
        self.ids[layer].index_copy_(0, loc.long(), experts.to(torch.int16))

    def read(self, slots: np.ndarray) -> "RoutingReadback":
        """The ids at `slots` (a sample's tokens, in order): copied to the host without waiting,
        so a finishing sample costs no sync of the step pipeline."""
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        if self.ids.device.type != "cuda":
            return RoutingReadback(self.ids.index_select(1, index).transpose(0, 1).contiguous(), None)
        # pinned, so neither copy waits for the step in flight (a pageable one would)
        index = index.pin_memory().to(self.ids.device, non_blocking=True)
        rows = self.ids.index_select(1, index).transpose(0, 1)  # [tokens, layers, top_k]
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return RoutingReadback(host, done)


class RoutingReadback:
    """A pending copy of a sample's routing; `array()` waits for it (by the time an output is
    built, a later step's tokens were read, so it is long done)."""

    def __init__(self, host: torch.Tensor, done: Optional["torch.cuda.Event"]):
        self._host, self._done = host, done

    def array(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host.numpy()
