"""Decode step graphs: a whole decode step of a small batch — the graph-input kernel, the model
forward and the fused sampler — replayed as one CUDA graph.

A decode graph holds the forward only: around it a step queued the input kernel, the graph and
the sampler's two kernels — three Triton launches from Python a step, each tens of µs of host
time. As one graph the step is one replay. On an H200 (docs/BENCHMARKS.md, fifty-first
session) the GPU's step is as long either way — the fiftieth session's probe had measured the
whole step as one graph 7 µs faster, but its forward was chained to the input kernel by PDL,
which is not exact (`_step`); the full dependency costs what the launches saved — and the
host's is shorter: batch 1 ran 972-974 tok/s against 975 without them on a machine whose host
kept ahead, 970-974 against 941-962 on one whose host fell behind. Larger batches: the step
graph's sampler and inputs ran slower than the plain path's (batch 32 -1%). By default one
request only (`EngineConfig.cuda_graph_step_max_bs`, `config.DEFAULT_STEP_GRAPH_MAX_BS`: the
graphs of 2-16 requests captured beside it cost the batch-1 step 2% in the decode benchmark's
process, fifty-second session); any size up to the decode graphs' is served.

A captured step reads everything from static buffers, so what an eager step gets fresh each
time lives in two sets of them, parities used by steps in turn:
- `src[p]`, a [STEP_ROWS, max_bs] int64 table (`triton_graph_inputs.STEP_*`): the index rows,
  input ids of TAKE_PREVIOUS where the previous step is still sampling the token, the sampler's
  uniforms, temperatures and greedy flags, the number of real rows. The host writes a step's
  table into pinned staging and copies it on the copy stream once the last graph of its parity
  has finished (an event), so it never overwrites what a running graph reads, while the step
  before still runs;
- `tokens[p]`, `logprobs[p]`, `packs[p]`: what the sampler writes. A graph of parity p takes its
  pending input ids from tokens[1 - p], the previous step's (another path's tokens are copied
  there first: a step after a prefill);
- the [2, bs] pack for the host is copied from packs[p] to fresh pinned memory on a readback
  stream behind the graph: the next step's graph is queued at once, not behind a copy engine's
  launch, and not behind the next step's inputs on the copy stream.
Steps alternate parities, so step N+1's inputs and outputs never touch what step N's graph and
its copies still use; step N+2 of parity p waits (on the device) for step N's readback before
its graph overwrites packs[p]. A row's T is checked in the kernels (`UNIT_T_PER_ROW`): one graph
serves every mix of temperatures.

Served: decode batches up to the largest step size, sampling without filters or top-logprobs (the
fused sampler's case), input ids on the host or all pending in the previous step's row order,
one TP rank. The rest takes the decode graph and the sampler after it, as before."""
from __future__ import annotations

import bisect
import functools
import logging
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import triton

from rollout import triton_graph_inputs, triton_sampler
from rollout.cuda_graph_runner import PAD_VALUES
from rollout.forward_batch import ForwardBatch
from rollout.graph_capture import capture_graph
from rollout.host_to_device import copy_stream
from rollout.sampler import SampleOutput
from rollout.triton_graph_inputs import (STEP_BS, STEP_GREEDY, STEP_ROWS, STEP_TEMPERATURES,
                                         STEP_UNIFORMS, TAKE_PREVIOUS)

if TYPE_CHECKING:
    from rollout.cuda_graph_runner import CudaGraphRunner

logger = logging.getLogger(__name__)

NUM_INDEX_ROWS = len(PAD_VALUES)  # the table's rows at the head of a step's source


def _idle_column() -> np.ndarray:
    """A padded row's source column: the decode graph's padded-row values, uniform 0.5, T 1,
    not greedy."""
    col = np.zeros(STEP_ROWS, dtype=np.int64)
    col[:NUM_INDEX_ROWS] = list(PAD_VALUES.values())
    col[STEP_UNIFORMS:STEP_UNIFORMS + 1].view(np.float64)[0] = 0.5
    col[STEP_TEMPERATURES:STEP_TEMPERATURES + 1].view(np.float32)[:] = 1.0
    return col


IDLE_COLUMN = _idle_column()


class StepSource:
    """A [STEP_ROWS, width] int64 step source table and its typed views (host or device)."""

    def __init__(self, table):
        self.table = table
        numpy = isinstance(table, np.ndarray)

        def row_as(i: int, dtype):
            return table[i].view(dtype) if numpy else table[i].view(
                {np.float64: torch.float64, np.float32: torch.float32, np.bool_: torch.bool}[dtype])

        self.uniforms = row_as(STEP_UNIFORMS, np.float64)
        self.temperatures = row_as(STEP_TEMPERATURES, np.float32)
        self.greedy = row_as(STEP_GREEDY, np.bool_)


def write_step(table: np.ndarray, fb: ForwardBatch, graph_bs: int, take_previous: bool) -> None:
    """Step `fb`'s source into `table` ([STEP_ROWS, >= graph_bs], host): its index rows (input
    ids TAKE_PREVIOUS when `take_previous`), its rows' uniforms at their positions, T and greedy
    flags, and the padded-row values in its columns bs..graph_bs."""
    bs = fb.batch_size
    info = fb.sampling_info
    view = StepSource(table)
    indices = fb.host_indices.flat.numpy().reshape(len(fb.host_indices.names), -1)
    table[:NUM_INDEX_ROWS, :bs] = indices[:NUM_INDEX_ROWS]
    if take_previous:
        table[0, :bs] = TAKE_PREVIOUS
    table[:NUM_INDEX_ROWS, bs:graph_bs] = IDLE_COLUMN[:NUM_INDEX_ROWS, None]
    # the sampler's rows by their own dtypes: T and greedy pack 2 and 8 rows an int64 column
    view.uniforms[:bs] = info.uniforms_at(fb.seq_lens_cpu)
    view.uniforms[bs:graph_bs] = 0.5
    view.temperatures[:bs] = info.host["temperatures"]
    view.temperatures[bs:graph_bs] = 1.0
    view.greedy[:bs] = info.host["greedy"]
    view.greedy[bs:graph_bs] = False
    table[STEP_BS, 0] = bs


class StepGraphs:
    def __init__(self, graphs: "CudaGraphRunner", max_bs: int):
        self.graphs = graphs
        mr = graphs.model_runner
        self.sizes = [s for s in graphs.batch_sizes if s <= max_bs]
        if not self.sizes:
            raise ValueError(f"no decode graph size up to {max_bs}: {graphs.batch_sizes}")
        self.max_bs = self.sizes[-1]
        dev = self.device = mr.device
        chunks = triton.cdiv(mr.model_config.vocab_size, triton_sampler.CHUNK)
        self.src = [torch.empty(STEP_ROWS, self.max_bs, dtype=torch.int64, device=dev) for _ in range(2)]
        self.staging = [torch.empty(STEP_ROWS, self.max_bs, dtype=torch.int64, pin_memory=True)
                        for _ in range(2)]
        self.tokens = [torch.zeros(self.max_bs, dtype=torch.int64, device=dev) for _ in range(2)]
        self.logprobs = [torch.zeros(self.max_bs, dtype=torch.float32, device=dev) for _ in range(2)]
        self.packs = [torch.zeros(2 * self.max_bs, dtype=torch.float64, device=dev) for _ in range(2)]
        self.stats = tuple(torch.empty(self.max_bs, chunks, dtype=torch.float32, device=dev)
                           for _ in range(2))
        self.step_graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        # per parity: its last graph done, its last inputs copied in (events recorded again at
        # each step of the parity: a wait takes the record before it), its last pack read back
        # (a step's own event: its LaunchedStep holds it)
        self.graph_done = [torch.cuda.Event() for _ in range(2)]
        self.copied_in = [torch.cuda.Event() for _ in range(2)]
        self.read_back: list[Optional[torch.cuda.Event]] = [None, None]
        self.parity = 0  # the next step's
        self.replays = 0
        self._readback_stream = torch.cuda.Stream(dev)
        self._forward_stream = torch.cuda.Stream(dev)  # captures only (`_step`)
        idle = np.repeat(IDLE_COLUMN[:, None], self.max_bs, axis=1)
        idle[STEP_BS, 0] = 0  # no real row: captures' warm-ups and stand-ins write no req_to_token
        self._idle = torch.from_numpy(idle)
        for src in self.src:
            src.copy_(self._idle)

    def stand_in_forwards(self) -> list:
        """The step graphs' own kernel variants, launched on idle sources (no real row), for the
        compile-ahead (`CudaGraphRunner._step_forwards`): the input kernel, and the sampler
        checking each row's T at each launch shape the step sizes use."""
        mr = self.graphs.model_runner
        r2t = mr.req_to_token_pool.req_to_token
        forwards = [functools.partial(triton_graph_inputs.fill_step_inputs, self.src[0],
                                      self.graphs._inputs_for(bs).table, self.tokens[1], r2t, bs)
                    for bs in dict.fromkeys((1, self.max_bs))]
        vocab = mr.model_config.vocab_size
        for rows in dict.fromkeys((1, self.max_bs)):
            logits = torch.zeros(rows, vocab, dtype=mr.dtype, device=self.device)
            forwards.append(functools.partial(self._sample, logits, rows, 0))
        return forwards

    # ---- capture --------------------------------------------------------------------------
    def release(self) -> None:
        self.step_graphs.clear()

    def capture(self, pool) -> None:
        keys = [(key, seq) for key, seq in self.graphs.graph_keys() if key[0] <= self.max_bs]
        for (bs, cls), max_seq_len in keys:
            for parity in (0, 1):
                self.step_graphs[(bs, cls, parity)] = self._capture_one(bs, max_seq_len, parity, pool)
        logger.info("captured %d decode step graphs for batch sizes %s", len(self.step_graphs),
                    self.sizes)

    def _capture_one(self, bs: int, max_seq_len: int, parity: int, pool) -> torch.cuda.CUDAGraph:
        self.src[parity].copy_(self._idle)  # a replay's step may be there
        fb = self.graphs._static_batch(bs, [max_seq_len] * bs)
        self.graphs.backend.init_forward_metadata_capture(fb)
        return capture_graph(lambda: self._step(fb, bs, parity), pool)[0]

    def _step(self, fb: ForwardBatch, bs: int, p: int) -> torch.Tensor:
        """What a step graph holds (`_capture_one`): inputs, forward, sampler. The forward runs
        on a stream forked behind the input kernel: in the graph a full dependency, not a
        programmatic one. The forward's kernels load what no kernel of a forward writes — the
        static inputs among it, e.g. the attention's new KV slot from req_to_token — before their
        PDL wait; chained to the input kernel by PDL (each triggering the next early), they may
        load them before it has written them. On an H200 a bf16 step graph chained so drew
        another token than the plain path once (the last of a 20-token sample); forked, every
        draw of the specs is the plain path's."""
        mr = self.graphs.model_runner
        triton_graph_inputs.fill_step_inputs(self.src[p], self.graphs._inputs_for(bs).table,
                                             self.tokens[1 - p], mr.req_to_token_pool.req_to_token, bs)
        main = torch.cuda.current_stream(self.device)
        self._forward_stream.wait_stream(main)
        with torch.cuda.stream(self._forward_stream):
            self._sample(self.graphs._forward(fb), bs, p)
        main.wait_stream(self._forward_stream)
        return self.tokens[p]

    def _sample(self, logits: torch.Tensor, bs: int, p: int) -> None:
        """The fused sampler on src[p]'s rows into parity p's outputs, each row's T checked."""
        src = StepSource(self.src[p])
        triton_sampler.launch_into(
            logits, src.temperatures[:bs], src.greedy[:bs], src.uniforms[:bs],
            tuple(s[:bs] for s in self.stats), self.tokens[p][:bs], self.logprobs[p][:bs],
            self.packs[p][:2 * bs].view(2, bs), unit_temperature=triton_sampler.UNIT_T_PER_ROW)

    # ---- replay ---------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        info = fb.sampling_info
        return (bool(self.step_graphs) and fb.forward_mode.is_decode
                and 0 < fb.batch_size <= self.max_bs and fb.host_indices is not None
                and not fb.input_ids_copied_on_device and info is not None and info.host is not None
                and not info.needs_filter and info.max_top_logprobs == 0)

    def run(self, fb: ForwardBatch) -> SampleOutput:
        """Queues step `fb` (inputs, graph, readback) without blocking; its tokens and logprobs
        as the fused sampler returns them, the host pack valid once `ready` has passed."""
        bs, p = fb.batch_size, self.parity
        graph_bs = self.sizes[bisect.bisect_left(self.sizes, bs)]
        backend = self.graphs.backend
        key = (graph_bs, backend.decode_launch_class(graph_bs, fb.max_seq_len), p)
        compute = torch.cuda.current_stream(self.device)
        take_previous = fb.input_ids_source is not None
        if take_previous and not _same_buffer(fb.input_ids_source, self.tokens[1 - p]):
            self.tokens[1 - p][:bs].copy_(fb.input_ids_source)  # the step before was another path's
        self._copy_in(fb, graph_bs, p, take_previous)
        if self.read_back[p] is not None:  # packs[p]: the step two before has been read back
            compute.wait_event(self.read_back[p])
        padded_lens = list(fb.seq_lens_cpu) + [1] * (graph_bs - bs)
        backend.init_forward_metadata_replay(self.graphs._static_batch(graph_bs, padded_lens))
        self.step_graphs[key].replay()
        done = self.graph_done[p]
        done.record(compute)
        fb.input_ids_source = None
        self.parity = 1 - p
        self.replays += 1
        self.graphs.num_replays += 1
        self.graphs.last_key = key[:2]
        pack, ready = self._read_back(p, graph_bs, done)
        return SampleOutput(self.tokens[p][:bs], self.logprobs[p][:bs], host_pack=pack[:, :bs],
                            ready=ready)

    def _copy_in(self, fb: ForwardBatch, graph_bs: int, p: int, take_previous: bool) -> None:
        """The step's source into src[p], on the copy stream once parity p's last graph is done."""
        copied = self.copied_in[p]
        copied.synchronize()  # the staging buffer's last copy has been made (a first step: no wait)
        write_step(self.staging[p].numpy(), fb, graph_bs, take_previous)
        stream = copy_stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream or compute):
            if stream is not None:
                stream.wait_event(self.graph_done[p])  # a first step: an unrecorded event, no wait
            self.src[p][:, :graph_bs].copy_(self.staging[p][:, :graph_bs], non_blocking=True)
            copied.record()
        if stream is not None:
            compute.wait_event(copied)

    def _read_back(self, p: int, graph_bs: int, done: torch.cuda.Event
                   ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """packs[p]'s [2, graph_bs] into fresh pinned memory on the readback stream."""
        host = torch.empty(2, graph_bs, dtype=torch.float64, pin_memory=True)
        stream = self._readback_stream
        with torch.cuda.stream(stream):
            stream.wait_event(done)
            host.copy_(self.packs[p][:2 * graph_bs].view(2, graph_bs), non_blocking=True)
            ready = self.read_back[p] = torch.cuda.Event()
            ready.record()
        return host, ready


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()

