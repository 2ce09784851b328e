"""Leader → follower step channel for tensor parallelism (no Ray here).

The TP leader (rank 0) owns the Scheduler. Before each forward it sends the step's batch
metadata to the other ranks over the gloo CPU group; each follower rebuilds the ForwardBatch on
its own device and runs the same forward, so all ranks join the same collectives in the same
order. Only the leader samples: the LM head gathers the full logits on every rank, and the
leader's next batch carries the sampled tokens as input ids, so tokens never travel back.

Messages are typed: `BatchMessage` (one step) and `StopMessage` (leave the loop)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.engine import Engine
from rollout.errors import EngineNotReadyError
from rollout.forward_batch import SHARED_FIELDS, ForwardBatch, ForwardMode
from rollout.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Device tensors of a ForwardBatch that followers need (the sampling info stays on the leader).
_TENSOR_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc",
                  "extend_seq_lens", "extend_prefix_lens", "token_req_pool_indices") + SHARED_FIELDS


@dataclass
class BatchMessage:
    """One step's ForwardBatch metadata: the host lists, and the int64 index tensors packed
    into one flat CPU tensor (one device→host copy on the leader, one host→device copy on each
    follower)."""

    forward_mode: ForwardMode
    batch_size: int
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    return_all_logits: bool
    tensor_names: list[str]
    tensor_sizes: list[int]
    flat: torch.Tensor  # int64, the named tensors concatenated in order
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_batch(cls, fb: ForwardBatch) -> "BatchMessage":
        if fb.input_ids_source is not None:  # overlap scheduling, which TP does not run
            raise ValueError("a batch whose input ids are still on the device (overlap "
                             "scheduling) cannot be sent to TP followers")
        if fb.host_indices is not None:  # the builder's host copy: no device→host copy
            h = fb.host_indices
            return cls(fb.forward_mode, fb.batch_size, list(fb.seq_lens_cpu),
                       list(fb.extend_seq_lens_cpu), list(fb.extend_prefix_lens_cpu),
                       fb.return_all_logits, list(h.names), list(h.sizes), h.flat, dict(fb.extras))
        names = [f for f in _TENSOR_FIELDS if getattr(fb, f) is not None]
        parts = [getattr(fb, f).reshape(-1).to(torch.int64) for f in names]
        return cls(fb.forward_mode, fb.batch_size, list(fb.seq_lens_cpu),
                   list(fb.extend_seq_lens_cpu), list(fb.extend_prefix_lens_cpu),
                   fb.return_all_logits, names, [p.numel() for p in parts],
                   torch.cat(parts).cpu(), dict(fb.extras))

    def to_batch(self, device: torch.device) -> ForwardBatch:
        tensors = self.flat.to(device, non_blocking=True).split(self.tensor_sizes)
        return ForwardBatch(
            forward_mode=self.forward_mode, batch_size=self.batch_size,
            seq_lens_cpu=self.seq_lens_cpu, extend_seq_lens_cpu=self.extend_seq_lens_cpu,
            extend_prefix_lens_cpu=self.extend_prefix_lens_cpu,
            return_all_logits=self.return_all_logits, extras=self.extras,
            **dict(zip(self.tensor_names, tensors)))


@dataclass(frozen=True)
class StopMessage:
    """Tells followers to leave their loop (the leader is shutting down)."""


Message = Union[BatchMessage, StopMessage]


class StepChannel:
    """The CPU-group broadcast from rank 0 to the rest of one TP group."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def send(self, msg: Message) -> None:
        dist.broadcast_object_list([msg], group=self.tp.cpu_group, group_src=0)

    def recv(self) -> Message:
        box: list[Optional[Message]] = [None]
        dist.broadcast_object_list(box, group=self.tp.cpu_group, group_src=0)
        return box[0]


class TPLeaderEngine(Engine):
    """The Engine on TP rank 0: each step's batch goes to the followers before the forward."""

    def __init__(self, config: EngineConfig, tp: TPGroup):
        super().__init__(config, tp=tp)
        self._channel = StepChannel(tp)
        self._stopped = False

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self._stopped:  # the followers left their loop: a batch sent now would wait forever
            raise EngineNotReadyError("this TP engine is shut down; create a new one")
        self._channel.send(BatchMessage.from_batch(fb))
        return super().forward(fb)

    def shutdown(self) -> None:
        try:
            with self.gate.exclusive():  # between two steps: the stop never splits a step's messages
                if not self._stopped:
                    self._stopped = True
                    self._channel.send(StopMessage())  # fails if a follower is gone: shut down anyway
        finally:
            super().shutdown()


class TPFollower:
    """A rank > 0: holds its model shard and runs every forward the leader announces."""

    def __init__(self, config: EngineConfig, tp: TPGroup):
        if tp.is_leader:
            raise ValueError("TPFollower is for ranks > 0; rank 0 runs TPLeaderEngine")
        self.tp = tp
        self.runner = ModelRunner(ModelConfig.from_pretrained(config.model_path), config, tp)
        self._channel = StepChannel(tp)
        self.steps = 0

    def run(self) -> None:
        """Serve steps until the leader sends StopMessage (blocks; run it in a thread)."""
        while True:
            msg = self._channel.recv()
            if isinstance(msg, StopMessage):
                logger.info("TP rank %d: stop after %d steps", self.tp.rank, self.steps)
                return
            self.runner.forward(msg.to_batch(self.runner.device))
            self.steps += 1
