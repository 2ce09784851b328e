"""Probe: what a decode step costs on the GPU outside its graph, and what capturing more of
the step into the graph would take off — before building it.

A decode step today is, on the compute stream: the step's packed indices copied in (on the copy
stream, an event wait here), the graph-input kernel, the decode graph (forward + logits), the
sampler's two kernels. Variants, each timed back to back with CUDA events (the host queues
ahead, as overlap scheduling does), on the Qwen2-1.5B shape with idle-cache contexts:

  graph        the decode graph alone (the floor of every variant)
  now          copy in + input kernel + graph + sampler (the engine's step, its host work aside)
  now_nocopy   input kernel + graph + sampler, the indices already on the device
  graph_sampler  input kernel, then one graph holding forward + sampler
  graph_step   one graph holding input kernel + forward + sampler (indices static on device)
  graph_step_host  the same, its input kernel reading the indices from pinned host memory
  two_steps    one graph holding two such steps (per-step time)
  graph_sampler_nopdl, graph_step_nopdl  graph_sampler and graph_step with the sampler's
               kernels captured without PDL (fiftieth session: the thirty-first's guess was that,
               captured under PDL, the sampler's programs become resident during the LM head
               and slow it; without PDL they launch after it ends)

It also checks that the graphed sampler draws the same tokens and logprobs as the eager one on
the same logits.

  python benchmarks/step_graph_probe.py --out $OUT/step_graph_probe.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch
import triton

from benchmarks.decode_throughput import gpu_engine_config, model_dir_for
from rollout import Engine, SamplingParams, triton_graph_inputs, triton_sampler
from rollout.graph_capture import capture_graph
from rollout.host_to_device import to_device
from rollout.sampling_info import SamplingBatchInfo


class StepParts:
    """A decode step's pieces for one batch size, on static buffers."""

    def __init__(self, engine: Engine, bs: int, ctx: int):
        mr = engine.runner
        gr, be = mr.graph_runner, mr.attn_backend
        self.gr, self.bs = gr, bs
        vocab, dev = mr.model_config.vocab_size, mr.device
        rows = torch.arange(1, bs + 1)
        self.src_host = torch.stack([torch.randint(0, 256, (bs,)), torch.full((bs,), ctx - 1), rows,
                                     rows, rows, torch.full((bs,), ctx)]).pin_memory()
        self.src = self.src_host.to(dev)
        self.inputs = gr._inputs_for(bs)
        self.r2t = mr.req_to_token_pool.req_to_token
        self.info = SamplingBatchInfo.build([SamplingParams(temperature=1.0, seed=i) for i in range(bs)],
                                            [0] * bs, [ctx] * bs, vocab, dev)
        chunks = triton.cdiv(vocab, triton_sampler.CHUNK)
        self.stats = tuple(torch.empty(bs, chunks, dtype=torch.float32, device=dev) for _ in range(2))
        self.tokens = self.src[0].clone()
        self.logprobs = torch.empty(bs, dtype=torch.float32, device=dev)
        self.packed = torch.empty(2, bs, dtype=torch.float64, pin_memory=True)
        self.static_fb = gr._static_batch(bs, [ctx] * bs)
        be.init_forward_metadata_replay(self.static_fb)
        key = (bs, be.decode_launch_class(bs, ctx))
        self.graph, self.logits = gr.graphs[key], gr.outputs[key][:bs]
        self.pool = torch.cuda.graph_pool_handle()

    def fill(self, src=None, tokens=None) -> None:
        triton_graph_inputs.fill_decode_inputs(self.src if src is None else src, self.inputs.table,
                                               self.inputs.pad, tokens, self.r2t, self.bs)

    def sample_into(self, logits) -> None:
        i = self.info
        triton_sampler.launch_into(logits, i.temperatures, i.greedy, i.uniforms, self.stats,
                                   self.tokens, self.logprobs, self.packed, unit_temperature=True)

    def forward(self) -> torch.Tensor:
        return self.gr._forward(self.static_fb)[:self.bs]

    def capture(self, fn):
        return capture_graph(fn, self.pool)[0]


@contextlib.contextmanager
def sampler_without_pdl():
    """The sampler's kernels launched (and captured) without PDL inside."""
    saved = triton_sampler.launch_options
    triton_sampler.launch_options = lambda **_: {"USE_PDL": False}
    try:
        yield
    finally:
        triton_sampler.launch_options = saved


def variants(p: StepParts) -> dict:
    i = p.info
    with sampler_without_pdl():
        g_sampler_nopdl = p.capture(lambda: p.sample_into(p.forward()))
        g_step_nopdl = p.capture(lambda: (p.fill(tokens=p.tokens), p.sample_into(p.forward())))
    g_sampler = p.capture(lambda: p.sample_into(p.forward()))
    g_step = p.capture(lambda: (p.fill(tokens=p.tokens), p.sample_into(p.forward())))
    g_step_host = p.capture(lambda: (p.fill(src=p.src_host, tokens=p.tokens), p.sample_into(p.forward())))
    g_two = p.capture(lambda: [(p.fill(tokens=p.tokens), p.sample_into(p.forward())) for _ in range(2)])
    out: dict = {}

    def now():
        src = to_device(p.src_host, p.src.device)
        p.fill(src=src, tokens=out.get("tok"))
        p.graph.replay()
        out["tok"] = triton_sampler.sample_unfiltered(p.logits, i.temperatures, i.greedy, i.uniforms,
                                                      pack_on_host=True, unit_temperature=True)[0]

    def now_nocopy():
        p.fill(tokens=p.tokens)
        p.graph.replay()
        p.sample_into(p.logits)

    def graph_sampler():
        p.fill(tokens=p.tokens)
        g_sampler.replay()

    def graph_sampler_nopdl():
        p.fill(tokens=p.tokens)
        g_sampler_nopdl.replay()

    return {"graph": (p.graph.replay, 1), "now": (now, 1), "now_nocopy": (now_nocopy, 1),
            "graph_sampler": (graph_sampler, 1), "graph_step": (g_step.replay, 1),
            "graph_step_host": (g_step_host.replay, 1), "two_steps": (g_two.replay, 2),
            "graph_sampler_nopdl": (graph_sampler_nopdl, 1),
            "graph_step_nopdl": (g_step_nopdl.replay, 1)}


def us_per_step(fn, steps_per_call: int, calls: int) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * steps_per_call)


def same_draws(p: StepParts) -> dict:
    """The graphed sampler against the eager one on the same logits: bit for bit?"""
    p.graph.replay()
    eager = triton_sampler.sample_unfiltered(p.logits, p.info.temperatures, p.info.greedy,
                                             p.info.uniforms, unit_temperature=True)
    g = p.capture(lambda: p.sample_into(p.logits))
    g.replay()
    torch.cuda.synchronize()
    return {"tokens_equal": bool(torch.equal(eager[0], p.tokens)),
            "logprobs_equal": bool(torch.equal(eager[1], p.logprobs)),
            "pack_equal": bool(torch.equal(eager[2].cpu(), p.packed))}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="step_graph_probe.json")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = Engine(gpu_engine_config(model_dir_for("qwen2-1.5b"), max(args.batch_sizes),
                                      load_format="dummy",
                                      cuda_graph_batch_sizes=tuple(args.batch_sizes)))
    result = {}
    for bs in args.batch_sizes:
        p = StepParts(engine, bs, args.context)
        fns = variants(p)
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, (fn, k) in fns.items():
                times[name].append(us_per_step(fn, k, args.calls // k))
        med = {name: round(statistics.median(t), 2) for name, t in times.items()}
        result[bs] = {"us_per_step": med, "rounds": times, "same_draws": same_draws(p)}
        print(bs, json.dumps(result[bs]["us_per_step"]), result[bs]["same_draws"], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
