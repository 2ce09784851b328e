"""Triton attention backend (GPU default): the kernels of `triton_kernels` over the paged KV cache.

Metadata is built once per batch by `init_forward_metadata` and read by every layer. Decode
supports CUDA graphs: the request rows and seq_lens a graph reads are the graph runner's static
input rows themselves (the static batch the capture/replay hooks receive), which the runner fills
before each replay, so a replay copies nothing here; `init_cuda_graph_state` allocates the split
scratch for the largest graph batch. On CPU the same kernels run under TRITON_INTERPRET=1 (tests)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from rollout.attention.base import AttentionBackend
from rollout.attention.triton_kernels.decode import (DecodeConfig, DecodeLaunch, DecodeScratch,
                                                      decode_attention, decode_buffers,
                                                      decode_launch, launch_table_from_env)
from rollout.attention.triton_kernels.extend import (ExtendBlocks, ExtendConfig, extend_attention,
                                                      extend_blocks, extend_config)

if TYPE_CHECKING:
    from rollout.forward_batch import ForwardBatch
    from rollout.layers.attention import Attention


@dataclass
class DecodeMetadata:
    req_pool_indices: torch.Tensor  # [bs] request row of each query
    seq_lens: torch.Tensor  # [bs] keys per request, the new token included
    scratch: DecodeScratch  # the splits' partials and arrival counters, shared by all layers
    config: DecodeConfig  # the kernel's launch, from the batch size and its longest context


@dataclass
class ExtendMetadata:
    req_pool_indices: torch.Tensor  # [bs]
    extend_start_loc: torch.Tensor  # [bs] first row of each request in the flat q
    extend_seq_lens: torch.Tensor  # [bs]
    extend_prefix_lens: torch.Tensor  # [bs]
    max_extend_len: int  # host int: sizes the launch grid
    zero_padding: bool = False  # rows past the extend lengths are padding: a zeroed output
    # a CUDA graph's batch (zero_padding): the programs from a device table (`extend_blocks`)
    # for this launch, not the grid; made at the batch's first layer
    blocks: Optional[ExtendBlocks] = None
    config: Optional[ExtendConfig] = None


class TritonBackend(AttentionBackend):
    supports_extend_graphs = True

    def __init__(self, runner) -> None:
        mc = runner.model_config
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.num_heads = mc.num_attention_heads // runner.tp.size
        self.num_kv_heads = mc.num_key_value_heads // runner.tp.size  # as the KV pool's
        self.head_dim = mc.head_dim
        self.device = runner.device
        # At most this many KV splits (the scratch's size); `decode_launch` picks per batch. The
        # interpreter runs one program at a time, where extra splits only cost time.
        self.num_kv_splits = 8 if self.device.type == "cuda" else 2
        self.launch_table = launch_table_from_env()  # None: decode_launch's own
        self.launches: dict[int, DecodeLaunch] = {}  # by batch size
        self.meta: DecodeMetadata | ExtendMetadata | None = None
        self.graph_scratch: Optional[DecodeScratch] = None  # for max_bs

    # ---- per-batch metadata ---------------------------------------------------------------
    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if fb.forward_mode.is_decode:
            scratch = decode_buffers(fb.batch_size, self.num_heads, self.head_dim,
                                     self.num_kv_splits, self.device)
            self.meta = self._decode_metadata(fb, scratch)
        else:
            self.meta = self._extend_metadata(fb)

    def _decode_metadata(self, fb: "ForwardBatch", scratch: DecodeScratch) -> DecodeMetadata:
        config = self.decode_launch(fb.batch_size).config(fb.max_seq_len)
        return DecodeMetadata(fb.req_pool_indices, fb.seq_lens, scratch, config)

    def _extend_metadata(self, fb: "ForwardBatch") -> ExtendMetadata:
        ext, prefix = fb.extend_seq_lens, fb.extend_prefix_lens
        if ext is None:  # built by hand without the device copies: make them once here
            ext = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64, device=self.device)
        if prefix is None:
            prefix = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64, device=self.device)
        start = torch.cumsum(ext, 0) - ext
        return ExtendMetadata(fb.req_pool_indices, start, ext, prefix, fb.max_extend_len,
                              fb.padded_tokens)

    # ---- attention ------------------------------------------------------------------------
    def forward_extend(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        m, pool = self.meta, fb.token_to_kv_pool
        if m.zero_padding and m.blocks is None:
            # a graph's static batch: its host lengths are its sizes, not the batch's, so the
            # programs come from the device lengths (a grid would be its requests x its tokens)
            group = q.shape[1] // pool.k_buffers[layer.layer_id].shape[1]
            m.config = extend_config(q.shape[2], q.dtype, group)
            m.blocks = extend_blocks(m.extend_seq_lens, q.shape[0], m.config.block_m)
        return extend_attention(
            q, pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id], self.req_to_token,
            m.req_pool_indices, m.extend_start_loc, m.extend_seq_lens, m.extend_prefix_lens,
            m.max_extend_len, layer.scaling, out=_zeros(q) if m.zero_padding else None,
            config=m.config, blocks=m.blocks)

    def forward_decode(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        m, pool = self.meta, fb.token_to_kv_pool
        return decode_attention(
            q, pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id], self.req_to_token,
            m.req_pool_indices, m.seq_lens, layer.scaling, buffers=m.scratch, config=m.config)

    def decode_launch(self, batch: int) -> DecodeLaunch:
        """The decode kernel's launches for a batch size (`decode.decode_launch`). Off CUDA the
        interpreter's: every split at once (launch parameters unused) and, at one and two
        requests, blocks of 16 keys past 17 keys, so that CPU specs reach both launch classes."""
        launch = self.launches.get(batch)
        if launch is None:
            if self.device.type != "cuda":
                splits = self.num_kv_splits
                long = DecodeConfig(splits, block_n=16) if batch <= 2 else None
                launch = DecodeLaunch(DecodeConfig(splits), long, long_above=17)
            else:
                launch = decode_launch(batch, self.num_kv_splits, self.launch_table,
                                       kv_heads=self.num_kv_heads)
            self.launches[batch] = launch
        return launch

    def decode_launch_classes(self, batch: int) -> tuple[int, ...]:
        return self.decode_launch(batch).launch_classes()

    def decode_launch_class(self, batch: int, max_seq_len: int) -> int:
        return self.decode_launch(batch).launch_class(max_seq_len)

    # ---- CUDA graphs (decode only) ----------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """The split scratch for graphs of up to `max_bs` requests; a graph of size bs uses [:bs]
        (its arrival counters too: only one graph replays at a time)."""
        self.graph_scratch = decode_buffers(max_bs, self.num_heads, self.head_dim, self.num_kv_splits,
                                            self.device)

    def init_forward_metadata_capture(self, fb: "ForwardBatch") -> None:
        self.init_forward_metadata_replay(fb)

    def init_forward_metadata_replay(self, fb: "ForwardBatch") -> None:
        """fb is the graph runner's static batch, already filled and padded: its request rows and
        seq_lens are the buffers the graph reads, so the metadata is those views (nothing copied)
        plus the graph's scratch and the launch of its class (fb's seq_lens_cpu: the real batch's,
        padded with 1, or at capture the class's longest context)."""
        if self.graph_scratch is None:
            raise RuntimeError("init_cuda_graph_state must be called before capturing graphs")
        bs = fb.batch_size
        scratch = DecodeScratch(*(t[:bs] for t in self.graph_scratch))
        self.meta = self._decode_metadata(fb, scratch)


def _zeros(q: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(q, memory_format=torch.contiguous_format)
