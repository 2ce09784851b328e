"""CUDA graphs for prefills (EXTEND batches), by padded token count and padded request count.

An eager prefill is bound by the host, not the GPU, up to thousands of tokens: for the
Qwen2-1.5B shape, 128 prompt tokens take ~2 ms of GPU work but 15-29 ms of wall time (~145
Triton launches through Triton's Python launcher, 84 cuBLAS calls and the model's Python around
them), and a GRPO-shaped step of 16 prompts and their 112 sharing samples (2,160 tokens) ~20 ms
for ~10 ms. That is a fixed cost of every call, and in continuous batching every admission of new
requests stalls the running decodes for it. Replaying a graph is one launch.

The graph (T, R) runs any EXTEND batch of n <= T new tokens over r <= R requests (after any
cached prefixes: chunks of long prompts and the samples that share a prompt's KV qualify). Its
static inputs are a [3, T] token table (ids, positions, KV slots) and a [4, R] request table
(request row, seq_len, extend length, prefix length). Token rows n..T are padding: token 0 at
position 0 writing its KV to the dummy slot 0; request rows r..R are padding: no new tokens. The
extend attention takes its programs from a device table built from the extend lengths
(`extend_blocks`: a grid fixed at capture would be R × T / block_m programs a head), computes
only the requests' rows, and the backend hands the graph a zeroed attention output, so padded
rows stay finite and touch nothing a real token reads. The LM head reads each request's last row
(cumsum(extend lengths) - 1, on the device). Every graph writes its logits, in the model's dtype,
into one shared [max requests, vocab] buffer (a graph's own output would hold ~R × 0.3 MB of the
pool per graph). The model runner writes req_to_token from the real batch before the replay, as
for decode graphs.

Request counts are the configured sizes clipped to each token count (a batch has at most as
many requests as tokens) and to the engine's max_running_requests.

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
# request rows while idle and during capture: row 0, one token, no prefix (minimal reads); a
# replay's padded request rows compute nothing
IDLE_REQUEST = (0, 1, 1, 0)
PAD_REQUEST = (0, 0, 0, 0)


def graph_keys(token_sizes: tuple[int, ...], request_sizes: tuple[int, ...],
               max_requests: int) -> list[tuple[int, int]]:
    """(tokens, requests) of every graph, largest first: each token size with the request sizes
    clipped to it and to max_requests."""
    keys = {(t, min(r, t, max_requests)) for t in token_sizes for r in request_sizes}
    return sorted(keys, reverse=True)


class PrefillGraphs:
    def __init__(self, model_runner: "ModelRunner", token_sizes: tuple[int, ...],
                 request_sizes: tuple[int, ...]):
        self.model_runner = model_runner
        self.keys = graph_keys(token_sizes, request_sizes, model_runner.config.max_running_requests)
        self.token_sizes = sorted({t for t, _ in self.keys})
        self.request_sizes = {t: sorted(r for tt, r in self.keys if tt == t) for t in self.token_sizes}
        self.max_tokens = self.token_sizes[-1]
        self.max_requests = max(r for _, r in self.keys)
        device, mc = model_runner.device, model_runner.model_config
        self.tokens = torch.zeros(len(TOKEN_FIELDS), self.max_tokens, dtype=torch.int64, device=device)
        self.requests = torch.empty(len(REQUEST_FIELDS), self.max_requests, dtype=torch.int64,
                                    device=device)
        self.pad = torch.tensor(PAD_REQUEST, dtype=torch.int64, device=device).view(-1, 1)
        self.logits = torch.zeros(self.max_requests, mc.vocab_size, dtype=model_runner.dtype,
                                  device=device)
        self.reset_inputs()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.last_key: tuple[int, int] | None = None

    # ---- capture --------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool) -> None:
        for key in self.keys:  # largest first: the others fit in its memory
            self.graphs[key] = self._capture_one(key, pool)
        logger.info("captured %d prefill CUDA graphs for up to %d tokens and %d requests",
                    len(self.graphs), self.max_tokens, self.max_requests)

    def compile_forwards(self) -> list:
        """What each graph runs, for `triton_compile_ahead` (not captured)."""
        return [functools.partial(self.forward, self.static_batch(*key)) for key in self.keys]

    def reset_inputs(self) -> None:
        """The idle token and request tables (before a capture)."""
        self.tokens.zero_()
        self.requests.copy_(torch.tensor(IDLE_REQUEST, dtype=torch.int64).view(-1, 1)
                            .expand(-1, self.max_requests))

    def release(self) -> None:
        self.graphs.clear()

    def _capture_one(self, key: tuple[int, int], pool) -> torch.cuda.CUDAGraph:
        fb = self.static_batch(*key)
        return capture_graph(lambda: self.forward(fb), pool)[0]

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """What a graph runs: metadata from the static request rows, the model on all token rows,
        the logits of each request's last row into the shared buffer ([requests, vocab])."""
        model = self.model_runner.model
        fb.attn_backend.init_forward_metadata(fb)
        hidden = model(fb.input_ids, fb.positions, fb)
        last = hidden.index_select(0, torch.cumsum(fb.extend_seq_lens, 0) - 1)
        # fb.return_all_logits: the head takes the rows given, i.e. one a request
        out = self.logits[:fb.batch_size]
        out.copy_(model.head_logits(last, fb))
        return out

    def static_batch(self, tokens: int, requests: int) -> ForwardBatch:
        """An EXTEND batch of `tokens` token rows and `requests` request rows, views of the static
        buffers. Its host lists say `tokens` new tokens a request (the attention's program table
        is sized by the token count); the device rows say how many are real."""
        mr, t, r = self.model_runner, self.tokens, self.requests[:, :requests]
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=requests, input_ids=t[0, :tokens],
            positions=t[1, :tokens], out_cache_loc=t[2, :tokens], req_pool_indices=r[0],
            seq_lens=r[1], extend_seq_lens=r[2], extend_prefix_lens=r[3],
            seq_lens_cpu=[tokens] * requests, extend_seq_lens_cpu=[tokens] * requests,
            extend_prefix_lens_cpu=[0] * requests, return_all_logits=True,
            req_to_token_pool=mr.req_to_token_pool, token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=mr.attn_backend, padded_tokens=True)

    # ---- replay ---------------------------------------------------------------------------
    def key_for(self, num_tokens: int, batch_size: int) -> tuple[int, int] | None:
        """The smallest graph that holds the batch: the next token size up, then its next request
        size up (None: past the largest)."""
        i = bisect.bisect_left(self.token_sizes, num_tokens)
        if i == len(self.token_sizes):
            return None
        tokens = self.token_sizes[i]
        sizes = self.request_sizes[tokens]
        j = bisect.bisect_left(sizes, batch_size)
        return (tokens, sizes[j]) if j < len(sizes) else None

    def can_run(self, fb: ForwardBatch) -> bool:
        return (bool(self.graphs) and fb.forward_mode is ForwardMode.EXTEND
                and not fb.return_all_logits and fb.num_tokens > 0
                and fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None
                and self.key_for(fb.num_tokens, fb.batch_size) is not None)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [requests, vocab] of each request's last token: float32 as the eager forward
        returns them, or with `fb.logits_read_at_once` the shared buffer in the model's dtype
        (valid until the next prefill replay)."""
        key = self.key_for(fb.num_tokens, fb.batch_size)
        self._fill(fb, *key)
        self.graphs[key].replay()
        self.num_replays += 1
        self.last_key = key
        out = self.logits[:fb.batch_size]
        return out if fb.logits_read_at_once else out.to(torch.float32, copy=True)

    def _fill(self, fb: ForwardBatch, tokens: int, requests: int) -> None:
        n = fb.copy_indices(self.tokens, TOKEN_FIELDS)
        if tokens > n:
            self.tokens[:, n:tokens].zero_()
        r = fb.copy_indices(self.requests, REQUEST_FIELDS)
        if requests > r:
            self.requests[:, r:requests].copy_(self.pad.expand(-1, requests - r))
