"""CUDA graphs for one-request prefills, by padded token count.

An eager prefill of one short prompt is bound by the host, not the GPU: for the Qwen2-1.5B
shape, 128 prompt tokens take ~2 ms of GPU work but 15-29 ms of wall time: ~145 Triton
launches through Triton's Python launcher, 84 cuBLAS calls and the model's Python around them.
At batch 1 that was 8-14% of a 128-token `generate`. Replaying a graph is one launch: that
prefill takes 3.3 ms (batch-1 generate +9-11%, docs/BENCHMARKS.md).

The graph of T tokens runs any one-request EXTEND batch of n <= T new tokens (after any cached
prefix, so the chunks of a long prompt qualify too). Its static inputs are a [3, T] token table
(ids, positions, KV slots) and the request's [4] row (request row, seq_len, extend length n,
prefix length). Rows n..T are padding: token 0 at position 0 writing its KV to the dummy slot 0;
the extend attention computes only the request's n rows (its length is n), and the backend
hands the graph a zeroed attention output, so the padded rows stay finite and touch nothing a
real token reads. The LM head reads row n - 1. The model runner writes req_to_token from the
real batch before the replay, as for decode graphs.

Owned by the `CudaGraphRunner` (captured into its memory pool after the decode graphs, dropped
and captured again with them). Only for attention backends whose extend metadata is built from
device tensors (`AttentionBackend.supports_extend_graphs`) and tp_size 1."""
from __future__ import annotations

import bisect
import functools
import logging
from typing import TYPE_CHECKING

import torch

from rollout.forward_batch import ForwardBatch, ForwardMode
from rollout.graph_capture import capture_graph

if TYPE_CHECKING:
    from rollout.model_runner import ModelRunner

logger = logging.getLogger(__name__)

TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")
REQUEST_FIELDS = ("req_pool_indices", "seq_lens", "extend_seq_lens", "extend_prefix_lens")
# the request row while idle and during capture: row 0, one token, no prefix (minimal reads)
IDLE_REQUEST = (0, 1, 1, 0)


class PrefillGraphs:
    def __init__(self, model_runner: "ModelRunner", token_sizes: tuple[int, ...]):
        self.model_runner = model_runner
        self.token_sizes = sorted(token_sizes)
        self.max_tokens = self.token_sizes[-1]
        device = model_runner.device
        self.tokens = torch.zeros(len(TOKEN_FIELDS), self.max_tokens, dtype=torch.int64, device=device)
        self.request = torch.tensor(IDLE_REQUEST, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    # ---- capture --------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool) -> None:
        for size in reversed(self.token_sizes):  # largest first: the others fit in its memory
            self.graphs[size], self.outputs[size] = self._capture_one(size, pool)
        logger.info("captured prefill CUDA graphs for %s tokens", self.token_sizes)

    def compile_forwards(self) -> list:
        """What each graph runs, for `triton_compile_ahead` (not captured)."""
        return [functools.partial(self.forward, self.static_batch(size)) for size in self.token_sizes]

    def reset_inputs(self) -> None:
        """The idle token table and request row (before a capture)."""
        self.tokens.zero_()
        self.request.copy_(torch.tensor(IDLE_REQUEST, dtype=torch.int64))

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()

    def _capture_one(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        fb = self.static_batch(size)
        return capture_graph(lambda: self.forward(fb), pool)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """What a graph runs: metadata from the static request row, the model on all `size` rows,
        the logits of the request's last row ([1, vocab] float32)."""
        model = self.model_runner.model
        fb.attn_backend.init_forward_metadata(fb)
        hidden = model(fb.input_ids, fb.positions, fb)
        last = hidden.index_select(0, fb.extend_seq_lens - 1)
        return model.compute_logits(last, fb)  # fb.return_all_logits: every row given, i.e. one

    def static_batch(self, size: int) -> ForwardBatch:
        """A one-request EXTEND batch of `size` token rows, views of the static buffers. Its host
        lists say `size` new tokens (they size the attention grid); the device row says how
        many are real."""
        mr, t, r = self.model_runner, self.tokens, self.request
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=t[0, :size], positions=t[1, :size],
            out_cache_loc=t[2, :size], req_pool_indices=r[0:1], seq_lens=r[1:2],
            extend_seq_lens=r[2:3], extend_prefix_lens=r[3:4], seq_lens_cpu=[size],
            extend_seq_lens_cpu=[size], extend_prefix_lens_cpu=[0], return_all_logits=True,
            req_to_token_pool=mr.req_to_token_pool, token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=mr.attn_backend, padded_tokens=True)

    # ---- replay ---------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return (bool(self.graphs) and fb.forward_mode is ForwardMode.EXTEND and fb.batch_size == 1
                and not fb.return_all_logits and 0 < fb.num_tokens <= self.max_tokens
                and fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [1, vocab] float32 of the request's last token, as the eager forward returns
        them (a copy unless `fb.logits_read_at_once`)."""
        n = fb.num_tokens
        size = self.token_sizes[bisect.bisect_left(self.token_sizes, n)]
        self._fill(fb, n, size)
        self.graphs[size].replay()
        self.num_replays += 1
        out = self.outputs[size]
        return out if fb.logits_read_at_once else out.clone()

    def _fill(self, fb: ForwardBatch, n: int, size: int) -> None:
        fb.copy_indices(self.tokens, TOKEN_FIELDS)
        if size > n:
            self.tokens[:, n:size].zero_()
        fb.copy_indices(self.request.view(len(REQUEST_FIELDS), 1), REQUEST_FIELDS)
