"""Decode CUDA graphs: one graph per batch size and launch class (model forward + logits),
replayed with padding; and the prefill graphs of `prefill_graphs`, captured into the same
memory pool. A launch class is the attention backend's (`decode_launch_classes`): where its
decode kernels launch by the batch's longest context (the Triton backend's, past 257 keys up to
16 requests), a batch size has a graph per class and a replay takes the batch's.

Every graph reads its inputs from one set of static buffers sized for the largest batch (a graph
of size bs reads their first bs rows; the smallest graphs, batch 1 by default, from a set of
their own: `SMALL_INPUTS_BS`), filled before each replay (`GraphInputs.fill`), and
the attention backend's static metadata (its `init_cuda_graph_state` /
`init_forward_metadata_capture` / `init_forward_metadata_replay` hooks, which get the static
batch: a backend reads the request rows and seq_lens from these buffers, not from copies of its
own). Graphs are captured largest first into one shared memory pool, so the smaller graphs
reuse the largest one's memory. Before the first capture, every graph's Triton kernels are
compiled in parallel threads (`triton_compile_ahead`; a cold start-up's compiles were most of it).

Padding: a batch of 5 replays the graph of 8. Padded rows decode token 0 at position 0 of
request row 0 with seq_len 1 and write their KV to slot 0, the dummy slot nobody reads as a
real token; they never touch req_to_token, which is written from the real batch outside the
graph, with the static inputs, by one kernel (`triton_graph_inputs`). Their logits are dropped.

Weights are updated in place (`copy_`), so the graphs stay valid across weight updates. Releasing
memory (ModelRunner.release_memory) is the exception: the freed KV and weight storages come back
at new addresses, so `release()` drops the graphs (freeing their pool) and `recapture()` captures
them again on resume."""
from __future__ import annotations

import bisect
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from rollout import eager_prefill_ahead, pdl_policy, sampler, triton_graph_inputs, triton_sampler
from rollout.forward_batch import INDEX_FIELDS, ForwardBatch, ForwardMode
from rollout.graph_capture import capture_graph
from rollout.prefill_graphs import PrefillGraphs
from rollout.sampling_info import SamplingBatchInfo
from rollout.sampling_params import SamplingParams
from rollout.triton_compile_ahead import AheadStats, compile_ahead, default_workers

if TYPE_CHECKING:
    from rollout.model_runner import ModelRunner
    from rollout.step_graphs import StepGraphs

logger = logging.getLogger(__name__)

# what a padded row holds: token 0 at position 0 of request row 0, one key, KV into dummy slot 0.
# The order is that of the first six INDEX_FIELDS, so a decode batch's packed indices (its
# device tensors are rows of one [8, bs] tensor) go into the static table in one copy.
PAD_VALUES = dict(input_ids=0, positions=0, out_cache_loc=0, token_req_pool_indices=0,
                  req_pool_indices=0, seq_lens=1)
PAD_FIELDS = tuple(PAD_VALUES)
assert PAD_FIELDS == INDEX_FIELDS[:len(PAD_FIELDS)]


def _small_inputs_bs() -> int:
    """ROLLOUT_GRAPH_SMALL_INPUTS_BS (default 1; 0: every graph reads the shared inputs)."""
    spec = os.environ.get("ROLLOUT_GRAPH_SMALL_INPUTS_BS", "1")
    if not spec.isdigit():
        raise ValueError(f"ROLLOUT_GRAPH_SMALL_INPUTS_BS={spec!r}: want a batch size (0: off)")
    return int(spec)


# The graphs of up to this many requests read static inputs of their own, that many rows wide.
# Twenty-sixth session, H200, the decode benchmark's engine (sized for 128 requests): the
# batch-1 graph replayed in 1.0056 ms from rows of the shared [6, 128] table (each field 1 KB
# from the next), in 1.0021 from a [6, 1] table of its own (its six values in one 48-byte span)
# — the speed of an engine sized for one request (`tiers26`, `sizes26`, `shape26` in
# docs/BENCHMARKS.md: not the graphs' pool, their number, the attention's scratch or the
# kernels' compiled code). Larger sizes were not measured.
SMALL_INPUTS_BS = _small_inputs_bs()


@dataclass
class GraphInputs:
    """Static input buffers for the graphs of up to max_bs rows: rows of one [6, max_bs] int64
    table (each holds the padded-row value when idle)."""

    table: torch.Tensor
    pad: torch.Tensor  # the padded-row values, the table's shape
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    token_req_pool_indices: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, device: torch.device) -> "GraphInputs":
        pad = torch.tensor(list(PAD_VALUES.values()), dtype=torch.int64, device=device)
        pad = pad.view(-1, 1).expand(-1, max_bs).contiguous()
        table = pad.clone()
        return cls(table, pad, *table.unbind(0))

    def reset(self) -> None:
        """Every row back to the padded-row values."""
        self.table.copy_(self.pad)

    def fill(self, fb: ForwardBatch, graph_bs: int, model_runner: "ModelRunner") -> None:
        """The real rows of fb (their pending input ids taken in), rows bs..graph_bs back to the
        padding values, and the step's KV slots into req_to_token: one kernel when fb's indices
        are packed (as the batch builders make them, `triton_graph_inputs`), else a copy each
        and the pool's write."""
        src = fb.stacked(PAD_FIELDS)
        if src is not None and triton_graph_inputs.FUSED_GRAPH_INPUTS:
            triton_graph_inputs.fill_decode_inputs(
                src, self.table, self.pad, fb.input_ids_source,
                model_runner.req_to_token_pool.req_to_token, graph_bs)
            fb.input_ids_source = None
            return
        model_runner.take_inputs(fb)
        bs = fb.copy_indices(self.table, PAD_FIELDS)
        if graph_bs > bs:
            self.table[:, bs:graph_bs].copy_(self.pad[:, bs:graph_bs])


class CudaGraphRunner:
    def __init__(self, model_runner: "ModelRunner"):
        self.model_runner = model_runner
        self.backend = model_runner.attn_backend
        cfg = model_runner.config
        # clipped, not dropped: with max_running_requests=5, the graph of 8 becomes one of 5
        self.batch_sizes = sorted({min(s, cfg.max_running_requests) for s in cfg.graph_batch_sizes})
        self.max_bs = self.batch_sizes[-1]
        self.num_replays = 0
        # by (batch size, launch class)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.last_key: Optional[tuple[int, int]] = None  # the graph replayed last
        self.ahead = AheadStats()  # the first capture's compiles ahead (workers 0: none yet)
        self.capture_s = 0.0
        self.inputs = GraphInputs.allocate(self.max_bs, model_runner.device)
        # the graphs of up to SMALL_INPUTS_BS requests: static inputs of their own, that wide
        self.small_inputs = (GraphInputs.allocate(SMALL_INPUTS_BS, model_runner.device)
                             if 0 < SMALL_INPUTS_BS < self.max_bs else None)
        self.enabled = True
        try:
            self.backend.init_cuda_graph_state(self.max_bs)
        except NotImplementedError as e:
            logger.warning("CUDA graphs disabled: %s (decode runs eagerly)", e)
            self.enabled = False
            self.prefill = self.steps = None
            return
        self.prefill = self._prefill_graphs()
        self.steps = self._step_graphs()
        self.capture()

    def _prefill_graphs(self) -> Optional[PrefillGraphs]:
        mr = self.model_runner
        sizes = mr.config.graph_prefill_tokens
        if not sizes or not self.backend.supports_extend_graphs or mr.tp.size > 1:
            return None
        return PrefillGraphs(mr, sizes, mr.config.graph_prefill_requests)

    def _step_graphs(self) -> Optional["StepGraphs"]:
        """The whole-step graphs of the small decode batches (`step_graphs`): on a GPU (not the
        CPU specs' eager stand-in graphs), one TP rank (a follower never samples), the fused
        sampler on, a decode graph that small."""
        mr = self.model_runner
        max_bs = mr.config.graph_step_max_bs
        if (max_bs == 0 or mr.device.type != "cuda" or mr.tp.size > 1
                or not sampler.FUSED_GPU_SAMPLER or not any(s <= max_bs for s in self.batch_sizes)):
            return None
        from rollout.step_graphs import StepGraphs
        return StepGraphs(self, max_bs)

    def release(self) -> None:
        """Drop every graph and its outputs (their private pool is freed with them)."""
        self.graphs.clear()
        self.outputs.clear()
        if self.prefill is not None:
            self.prefill.release()
        if self.steps is not None:
            self.steps.release()

    def recapture(self) -> None:
        if self.enabled and not self.graphs:
            self.capture()

    # ---- capture --------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every graph, from idle static inputs: after replays they hold the last real
        batch (a prefill's token count, real KV slots), which a capture's warm-up forward would
        read and write."""
        start = time.perf_counter()
        self.inputs.reset()
        if self.small_inputs is not None:
            self.small_inputs.reset()
        if self.prefill is not None:
            self.prefill.reset_inputs()
        self._capture_graphs()
        self.capture_s = time.perf_counter() - start  # compiles ahead included

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        keys = self.graph_keys()
        if not self.ahead.workers:  # a recapture (resume_memory) finds every variant in memory
            self._compile_ahead(keys)
        for key, max_seq_len in keys:  # largest first: the others fit in its pool
            self.graphs[key], self.outputs[key] = self._capture_one(key[0], max_seq_len, pool)
        logger.info("captured %d decode CUDA graphs for batch sizes %s", len(self.graphs),
                    self.batch_sizes)
        if self.steps is not None:
            self.steps.capture(pool)
        if self.prefill is not None:
            self.prefill.capture(pool)

    def graph_keys(self) -> list[tuple[tuple[int, int], int]]:
        """((batch size, launch class), a longest context of that class) for every decode graph,
        largest batch first."""
        return [((bs, cls), max_seq_len) for bs in reversed(self.batch_sizes)
                for cls, max_seq_len in enumerate(self.backend.decode_launch_classes(bs))]

    def _compile_ahead(self, keys: list[tuple[tuple[int, int], int]]) -> None:
        """Every graph's Triton kernels compiled in parallel threads before the first capture
        (triton_compile_ahead), with the step's kernels outside the graphs and the eager
        multi-request prefills' (`eager_prefill_ahead`); the KV pool and req_to_token, which the
        forwards may have written (the skipped kernels' garbage; where a variant was in memory
        already, e.g. a second engine in the process, real launches: the stand-in prefills' keys
        and rows), are zeroed after whenever the forwards ran."""
        mr = self.model_runner
        workers = mr.config.compile_workers
        forwards = [functools.partial(self._compile_forward, key[0], max_seq_len)
                    for key, max_seq_len in keys]
        if self.prefill is not None:
            forwards += self.prefill.compile_forwards()
        forwards += self._step_forwards() + eager_prefill_ahead.stand_in_forwards(mr)
        self.ahead = compile_ahead(forwards, default_workers() if workers is None else workers,
                                   mr.device)
        if self.ahead.workers:  # the forwards ran (compile_ahead did not return at once)
            mr.clear_kv_cache()

    def _compile_forward(self, bs: int, max_seq_len: int) -> None:
        fb = self._static_batch(bs, [max_seq_len] * bs)
        self.backend.init_forward_metadata_capture(fb)
        self._forward(fb)

    def _step_forwards(self) -> list:
        """What a step launches outside the graphs, on stand-in inputs, for the compile-ahead:
        the sampler for each logits dtype (the decode graphs' and the float32 of prefills and
        eager steps), launch class and temperature shortcut; the graph-input kernel with and
        without pending input ids; the req_to_token write. Their batch sizes are not specialized
        (`do_not_specialize`), so these variants serve every batch; before, a cold cache's first
        `generate` compiled six of them (1.9-3.1 s on an H200 host). Run at start-up only: the
        stand-ins are the idle rows (a real launch, of a variant already in memory, rewrites
        what is there: the padded-row values and req_to_token's unused row-0 entry)."""
        mr = self.model_runner
        many = triton_sampler.MANY_ROWS
        rows = [1] + ([many] if self.max_bs >= many else [])
        forwards = [functools.partial(self._sample_stand_in, n, dtype, temperature)
                    for n in rows for dtype in dict.fromkeys((mr.dtype, torch.float32))
                    for temperature in (1.0, 0.5)]
        idle = self.inputs.pad[:, :1].clone()  # one idle row, as a step's packed indices
        tokens = idle[0].clone()
        forwards += [functools.partial(triton_graph_inputs.fill_decode_inputs, idle, self.inputs.table,
                                       self.inputs.pad, t, mr.req_to_token_pool.req_to_token, 1)
                     for t in (tokens, None)]
        forwards.append(functools.partial(mr.req_to_token_pool.write, idle[3], idle[1], idle[2]))
        if self.steps is not None:
            forwards += self.steps.stand_in_forwards()
        return forwards

    def _sample_stand_in(self, rows: int, dtype: torch.dtype, temperature: float) -> None:
        vocab, device = self.model_runner.model_config.vocab_size, self.model_runner.device
        info = SamplingBatchInfo.build([SamplingParams(temperature=temperature)] * rows, [0] * rows,
                                       [1] * rows, vocab, device)
        sampler.sample(torch.zeros(rows, vocab, dtype=dtype, device=device), info)

    def _capture_one(self, bs: int, max_seq_len: int,
                     pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # the static inputs hold idle rows (one key each): only the host lengths say the class
        fb = self._static_batch(bs, [max_seq_len] * bs)
        self.backend.init_forward_metadata_capture(fb)
        return capture_graph(lambda: self._forward(fb), pool)

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        # the head's dtype: the float32 cast is the reader's (the fused sampler converts as it
        # loads; at batch 128 the cast kernel wrote 78 MB a step inside the graph: 2.078 ->
        # 2.023 ms a replay without it)
        model = self.model_runner.model
        with pdl_policy.for_forward(fb):  # captured: the replays launch as the capture did
            return model.head_logits(model(fb.input_ids, fb.positions, fb), fb)

    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        """A DECODE batch of bs rows whose tensors are views of the static buffers."""
        b, mr = self._inputs_for(bs), self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=b.input_ids[:bs],
            positions=b.positions[:bs], req_pool_indices=b.req_pool_indices[:bs],
            seq_lens=b.seq_lens[:bs], out_cache_loc=b.out_cache_loc[:bs],
            token_req_pool_indices=b.token_req_pool_indices[:bs], seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[n - 1 for n in seq_lens_cpu],
            req_to_token_pool=mr.req_to_token_pool, token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=self.backend)

    def _inputs_for(self, bs: int) -> GraphInputs:
        """The static inputs the graph of `bs` requests reads."""
        small = self.small_inputs
        return small if small is not None and bs <= small.table.shape[1] else self.inputs

    # ---- replay ---------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        if not fb.forward_mode.is_decode:
            return self.prefill is not None and self.prefill.can_run(fb)
        return bool(self.graphs) and 0 < fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [fb.batch_size, vocab] float32, as the eager forward would return them (with
        `fb.logits_read_at_once`: the graph's output buffer in the model's dtype, valid until
        the next replay)."""
        if not fb.forward_mode.is_decode:
            self.model_runner.take_inputs(fb)
            return self.prefill.replay(fb)
        bs = fb.batch_size
        graph_bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        key = (graph_bs, self.backend.decode_launch_class(graph_bs, fb.max_seq_len))
        self._inputs_for(graph_bs).fill(fb, graph_bs, self.model_runner)
        padded_lens = list(fb.seq_lens_cpu) + [1] * (graph_bs - bs)
        self.backend.init_forward_metadata_replay(self._static_batch(graph_bs, padded_lens))
        self.graphs[key].replay()
        self.num_replays += 1
        self.last_key = key
        out = self.outputs[key][:bs]
        # The static output is overwritten by the next replay of any graph (shared pool): a copy,
        # unless the caller reads it at once (the engine samples from it, and the next replay is
        # queued behind that sampling on the same stream; the copy is 78 MB at batch 128)
        return out if fb.logits_read_at_once else out.to(torch.float32, copy=True)
