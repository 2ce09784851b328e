"""Decode throughput: the engine next to HF `generate` on the same random model, in one run,
and next to a floor measured in the same run: on GPU memory bandwidth, on CPU the fp32 GEMM
peak (MKL through F.linear, and oneDNN through the engine's cpu_linear) over the run's FLOPs.

  python benchmarks/decode_throughput.py --shape cpu-small --device cpu --batch-sizes 1 16 64
  python benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda --dtype bfloat16 \
      --batch-sizes 1 32 128 --out $OUT/decode.json
"""
from __future__ import annotations

import argparse
import atexit
import bisect
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.tiny_model import TinyModelSpec, make_tiny_model

def _released(architecture: str, hidden: int, intermediate: int, layers: int, heads: int,
              kv_heads: int, tied: bool, vocab: int = 151936,
              head_dim: int | None = None) -> TinyModelSpec:
    """A released model's shape with random bf16 weights (std 0.02, rope theta 1e6)."""
    return TinyModelSpec(architecture=architecture, vocab_size=vocab, hidden_size=hidden,
                         intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=4096, rope_theta=1000000.0,
                         tie_word_embeddings=tied, init_std=0.02, dtype="bfloat16")


SHAPES = {
    # ANCHORS.md CPU shape
    "cpu-small": TinyModelSpec(architecture="Qwen2ForCausalLM", vocab_size=4096, hidden_size=256,
                               intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=2, max_position_embeddings=2048),
    "qwen2-1.5b": _released("Qwen2ForCausalLM", 1536, 8960, 28, 12, 2, tied=True),
    # Qwen3 (q/k norms): head_dim 128 whatever the hidden size
    "qwen3-1.7b": _released("Qwen3ForCausalLM", 2048, 6144, 28, 16, 8, tied=True, head_dim=128),
    # the dense models RL users train at 4-8B, for shapes the skinny-GEMM table does not list
    "qwen3-4b": _released("Qwen3ForCausalLM", 2560, 9728, 36, 32, 8, tied=True, head_dim=128),
    "qwen3-8b": _released("Qwen3ForCausalLM", 4096, 12288, 36, 32, 8, tied=False, head_dim=128),
    "qwen2.5-7b": _released("Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, tied=False,
                            vocab=152064),
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def model_dir_for(shape: str | TinyModelSpec) -> Path:
    """A random HF checkpoint of a benchmark shape (a SHAPES name, or a spec) in a temporary
    directory removed when the process exits (3 GB for qwen2-1.5b: leaked once per process, 22
    processes of A/Bs on one device machine filled its 64 GiB disk). With BENCH_MODEL_CACHE set
    (a directory), a named shape's checkpoint is made there once and kept for the processes
    after (an A/B of a 7-8B shape would otherwise write 15-16 GB per process); the caller
    removes it."""
    spec, name = (SHAPES[shape], shape) if isinstance(shape, str) else (shape, "m")
    cache = os.environ.get("BENCH_MODEL_CACHE")
    if cache and isinstance(shape, str):
        return _cached_model_dir(Path(cache), name, spec)
    tmp = tempfile.mkdtemp(prefix=f"bench-{name}-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return make_tiny_model(Path(tmp) / name, spec, with_tokenizer=False)


def _cached_model_dir(cache: Path, name: str, spec: TinyModelSpec) -> Path:
    """`cache / name`, made first if absent: written to a temporary directory beside it and
    renamed, so a process never reads a half-written checkpoint."""
    final = cache / name
    if not final.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
        make_tiny_model(tmp / name, spec, with_tokenizer=False)
        try:
            os.rename(tmp / name, final)
        except OSError:  # another process made it first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def gpu_engine_config(model_dir: Path, max_running_requests: int, **overrides) -> EngineConfig:
    """The GPU benchmarks' engine: bf16 on the GPU, every default (the profilers') but the
    prefix cache, off unless asked for: the benchmarks time calls that repeat their prompts (a
    warm-up, then repeats), which would find them cached, and time the cost of fresh prompts —
    an RL rollout's, whose every call follows a weight update that empties the cache."""
    overrides.setdefault("prefix_cache", False)
    return EngineConfig(model_path=str(model_dir), device="cuda", dtype="bfloat16",
                        max_running_requests=max_running_requests, **overrides)


def gpu_engine(shape: str, max_running_requests: int) -> Engine:
    """The engine on a random model of a benchmark shape (`gpu_engine_config`)."""
    return Engine(gpu_engine_config(model_dir_for(shape), max_running_requests))


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 256), (batch, prompt_len), generator=g).tolist()


def num_prompts(batch: int, args) -> int:
    """Distinct prompts of a batch of `batch` samples (`--samples-per-prompt` of each)."""
    n = getattr(args, "samples_per_prompt", 1)
    if batch % n:
        raise SystemExit(f"batch {batch} is not a multiple of --samples-per-prompt {n}")
    return batch // n


def engine_runner(engine: Engine, batch: int, args):
    """A function that runs one timed generate call of the engine; returns (tokens, seconds)."""
    n = getattr(args, "samples_per_prompt", 1)
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=1,
                        n=n)
    prompts = prompts_for(num_prompts(batch, args), args.prompt_len, engine.model_config.vocab_size)
    # warm-up at the timed batch size: Triton specialises integer arguments (a batch of 32 is
    # divisible by 16, one of 2 is not), so a first call at a new size can compile kernels
    engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True, n=n))
    fresh = iter(range(1, 1 << 30))

    def call() -> tuple[int, float]:
        # with the prefix cache, every call fresh prompts (as an RL rollout's after an update)
        todo = prompts if not engine.config.prefix_cache else prompts_for(
            num_prompts(batch, args), args.prompt_len, engine.model_config.vocab_size, next(fresh))
        _sync(args.device)
        t0 = time.perf_counter()
        outs = engine.generate(todo, sp)
        _sync(args.device)
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0
    return call


def hf_runner(model, batch: int, args):
    """The same for HF `generate` (sampling at T=1, no top-k/top-p, no early stop; each prompt
    repeated for its samples, as `num_return_sequences` does)."""
    prompts = torch.tensor(prompts_for(num_prompts(batch, args), args.prompt_len,
                                       model.config.vocab_size), device=args.device)
    prompts = prompts.repeat_interleave(batch // prompts.shape[0], dim=0)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True,
              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    if args.hf_static_cache:
        kw["cache_implementation"] = "static"
    with torch.no_grad():  # warm-up at the timed batch size too
        model.generate(prompts, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})

    @torch.no_grad()
    def call() -> tuple[int, float]:
        _sync(args.device)
        t0 = time.perf_counter()
        out = model.generate(prompts, **kw)
        _sync(args.device)
        return (out.shape[1] - args.prompt_len) * batch, time.perf_counter() - t0
    return call


def timed(call, repeats: int) -> dict:
    runs = [call() for _ in range(repeats)]
    return _summary(runs)


def _summary(runs: list[tuple[int, float]]) -> dict:
    seconds = statistics.median(t for _, t in runs)
    return {"tokens": runs[0][0], "seconds": seconds, "tok_per_s": runs[0][0] / seconds,
            "all_seconds": [t for _, t in runs]}


def compare(engine_call, hf_call, repeats: int, after_engine=None) -> dict:
    """Engine and HF calls alternated (E, H, E, H, ...), so a slow spell of a shared machine hits
    both; the speedup is the median of the per-pair ratios. `after_engine` runs after each
    engine call, before HF's (its last result is returned as "after_engine")."""
    pairs, probe = [], None
    for _ in range(repeats):
        e = engine_call()
        if after_engine is not None:
            probe = after_engine()
        pairs.append((e, hf_call()))
    e, h = [p[0] for p in pairs], [p[1] for p in pairs]
    ratios = [(te[0] / te[1]) / (th[0] / th[1]) for te, th in pairs]
    return {"engine": _summary(e), "hf": _summary(h), "speedup": statistics.median(ratios),
            "pair_speedups": ratios, "after_engine": probe}


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by one large device copy (GPU only)."""
    if not device.startswith("cuda"):
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t0)


def cpu_gemm_peak(threads: int | None = None) -> dict:
    """fp32 GEMM GFLOP/s on CPU at the model's sizes, through torch's default BLAS (F.linear:
    MKL) and through the engine's `cpu_linear` (oneDNN), best of the shapes (CPU only)."""
    import torch.nn.functional as F
    from rollout.layers.cpu_gemm import cpu_linear
    out = {}
    with torch.inference_mode():
        for name, fn in (("mkl_F.linear", F.linear), ("engine_cpu_linear", cpu_linear)):
            best = 0.0
            for m, k, n in ((64, 256, 2048), (2048, 256, 2048), (64, 1024, 256)):
                x, w = torch.randn(m, k), torch.randn(n, k)
                fn(x, w)
                reps = max(3, int(2e9 / (2 * m * k * n)))
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(x, w)
                best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9)
            out[name] = best
    return out


def cpu_floor_tok_per_s(engine: Engine, batch: int, args, gflops: float) -> float:
    """Tokens/s if the run's GEMM FLOPs (prefill of every prompt, logits of its last token, then
    new_tokens - 1 decode steps) ran at `gflops`; attention and everything else for free."""
    model = engine.runner.model
    layers = sum(p.numel() for n, p in model.named_parameters()
                 if ".layers." in n and n.endswith("proj.weight"))
    head = model.lm_head.weight.numel()
    macs = batch * (args.prompt_len * layers + head) + batch * (args.new_tokens - 1) * (layers + head)
    return batch * args.new_tokens / (2 * macs / (gflops * 1e9))


def floor_tok_per_s(engine: Engine, batch: int, args, bandwidth: float) -> float:
    """Tokens/s if each decode step only read the weights and the KV once at `bandwidth`."""
    weights = engine.runner.weights_bytes()
    mc = engine.model_config
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * \
        torch.empty(0, dtype=engine.config.torch_dtype).element_size()
    mean_ctx = args.prompt_len + args.new_tokens / 2
    step_bytes = weights + batch * mean_ctx * kv_per_token
    return batch / (step_bytes / bandwidth)  # ANCHORS.md convention: copy bytes read + written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="cpu-small", choices=sorted(SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="the engine's share of free GPU memory (default EngineConfig's); less "
                        "leaves HF's model room in the same process at 7-8B shapes")
    p.add_argument("--no-prefill-graphs", action="store_true",
                   help="prefills run eagerly (decode graphs stay)")
    p.add_argument("--prefill-graph-tokens", type=int, nargs="+", default=None,
                   help="EngineConfig.cuda_graph_prefill_tokens (default: the engine's)")
    p.add_argument("--prefill-graph-requests", type=int, nargs="+", default=None,
                   help="EngineConfig.cuda_graph_prefill_requests (default: the engine's; 1: "
                        "one-request prefill graphs only)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="tokens a prefill step may compute (default: the engine's)")
    p.add_argument("--max-running", type=int, default=None,
                   help="the engine's max_running_requests (default: the largest batch size)")
    p.add_argument("--graph-batch-sizes", type=int, nargs="+", default=None,
                   help="decode graph batch sizes (default: the engine's)")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="a batch is batch / N distinct prompts sampled N times each (GRPO groups)")
    p.add_argument("--no-share-prompt-kv", action="store_true",
                   help="each sample prefills its prompt alone (EngineConfig.share_prompt_kv)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="the prefix cache on, each call with fresh prompts (what it costs when "
                        "nothing is found: an RL rollout after a weight update)")
    p.add_argument("--reserve-mb", type=int, default=0,
                   help="GPU memory held (allocated, unused) from before the engine's start to "
                        "the end: its tensors and graphs at other addresses, nothing else "
                        "changed (fifty-second session: batch 1's decode graph moved by 2%% with "
                        "what else the engine had captured)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-static-cache", action="store_true")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


def run(args) -> dict:
    model_dir = model_dir_for(args.shape)
    reserved = (torch.empty(args.reserve_mb << 20, dtype=torch.uint8, device=args.device)
                if args.reserve_mb else None)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model_path=str(model_dir), device=args.device, dtype=args.dtype,
                                 # the repeated prompts' cost uncached (gpu_engine_config)
                                 prefix_cache=args.prefix_cache,
                                 attention_backend=args.attention_backend,
                                 cuda_graph=not args.no_cuda_graph,
                                 cuda_graph_prefill_tokens=() if args.no_prefill_graphs else (
                                     args.prefill_graph_tokens and tuple(args.prefill_graph_tokens)),
                                 cuda_graph_prefill_requests=args.prefill_graph_requests
                                 and tuple(args.prefill_graph_requests),
                                 max_running_requests=args.max_running or max(args.batch_sizes),
                                 cuda_graph_batch_sizes=args.graph_batch_sizes and tuple(args.graph_batch_sizes),
                                 max_prefill_tokens=args.max_prefill_tokens,
                                 share_prompt_kv=not args.no_share_prompt_kv,
                                 **({"mem_fraction": args.mem_fraction} if args.mem_fraction
                                    else {}),
                                 kv_cache_tokens=None if args.device.startswith("cuda") else 65536))
    _sync(args.device)
    startup = time.perf_counter() - t0
    bandwidth = copy_bandwidth(args.device)
    gemm = None if args.device.startswith("cuda") else cpu_gemm_peak()
    rows = []
    hf = None if args.skip_hf else _load_hf(model_dir, args)
    for bs in args.batch_sizes:
        engine_call = engine_runner(engine, bs, args)
        if hf is not None:
            row = {"batch": bs, **compare(engine_call, hf_runner(hf, bs, args), args.repeats,
                                          after_engine=lambda: graph_replays_ms(engine, bs, args))}
            row["graph_replay_ms"], step_ms = row.pop("after_engine")
        else:
            row = {"batch": bs, "engine": timed(engine_call, args.repeats)}
            row["graph_replay_ms"], step_ms = graph_replays_ms(engine, bs, args)
        if step_ms is not None:
            row["step_graph_replay_ms"] = step_ms
        row["floor_tok_per_s"] = floor_tok_per_s(engine, bs, args, bandwidth)
        if gemm is not None:  # CPU: the compute floor at each library's measured GEMM peak
            row["gemm_floor_tok_per_s"] = {k: cpu_floor_tok_per_s(engine, bs, args, v)
                                           for k, v in gemm.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"shape": args.shape, "device": args.device, "dtype": args.dtype,
            "backend": type(engine.runner.attn_backend).__name__,
            "cuda_graph": engine.runner.graph_runner is not None, "startup_s": startup,
            "copy_bandwidth_GBps": bandwidth / 1e9, "cpu_gemm_gflops": gemm,
            "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
            "samples_per_prompt": args.samples_per_prompt,
            "share_prompt_kv": not args.no_share_prompt_kv,
            "prefix_cache": args.prefix_cache,
            "new_tokens": args.new_tokens, "torch": torch.__version__,
            "reserved_mb": 0 if reserved is None else reserved.numel() >> 20, "rows": rows}


def graph_replay_ms(engine: Engine, batch: int, args) -> float | None:
    """The decode step's GPU time alone: the graph of a full step of the batch at its last
    step's longest context (`cuda_timing.full_batch_graph`), 50 replays. Timed right after an
    engine call: after an HF call (torch's eager kernels on the same stream) a replay's launch
    took 10x the host time and the batch-1 replay 2% longer until the engine ran again
    (benchmarks/process_shape.py)."""
    from benchmarks.cuda_timing import full_batch_graph, replay_seconds
    graph = full_batch_graph(engine, batch, args.prompt_len + args.new_tokens)
    return None if graph is None else replay_seconds(graph, 50) * 1e3


def graph_replays_ms(engine: Engine, batch: int, args) -> tuple[float | None, float | None]:
    """(`graph_replay_ms`, `step_graph_replay_ms`), both right after an engine call."""
    return graph_replay_ms(engine, batch, args), step_graph_replay_ms(engine, batch, args)


def step_graph_replay_ms(engine: Engine, batch: int, args) -> float | None:
    """A small batch's whole step alone (`step_graphs`: input kernel, forward, sampler): the
    step graph the call replayed last, 50 replays on its last step's source (None where no step
    graph serves the batch). With the graph column, what the step adds to the forward."""
    from benchmarks.cuda_timing import replay_seconds
    gr = engine.runner.graph_runner
    steps = gr.steps if gr is not None else None
    if steps is None or not 0 < batch <= steps.max_bs or steps.replays == 0:
        return None
    size = steps.sizes[bisect.bisect_left(steps.sizes, batch)]
    key = (size, gr.backend.decode_launch_class(size, args.prompt_len + args.new_tokens),
           1 - steps.parity)
    graph = steps.step_graphs.get(key)
    return None if graph is None else replay_seconds(graph, 50) * 1e3


def _load_hf(model_dir: Path, args):
    import transformers
    dtype = getattr(torch, args.dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()


if __name__ == "__main__":
    main()
