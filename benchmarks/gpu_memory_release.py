"""Memory release/resume for colocated training, measured: how much device memory
`Engine.release_memory` gives back (KV cache, then weights), what `resume_memory` takes again,
how long each takes (resume re-captures the decode CUDA graphs), and that after resume plus a
full weight update the engine's greedy outputs equal those before the release.

The model is random and built on the device (`load_format="dummy"`, only a config.json is
written); the weights pushed before and after are the same HF-named random tensors.

  python benchmarks/gpu_memory_release.py --shape qwen2-1.5b --out $OUT/memory_release.json
  python benchmarks/gpu_memory_release.py --shape cpu-small --device cpu      # smoke run (RSS)
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.decode_throughput import SHAPES as DECODE_SHAPES
from rollout import Engine, EngineConfig, SamplingParams
from rollout.tiny_model import TinyModelSpec, hf_config_dict, random_state_dict

SHAPES = {
    **DECODE_SHAPES,  # cpu-small, qwen2-1.5b
    "llama-8b": TinyModelSpec(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                              intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, max_position_embeddings=8192,
                              rope_theta=500000.0, init_std=0.02, dtype="bfloat16"),
}


def memory(device: str) -> dict:
    """Device memory as the driver sees it (what a colocated trainer could get), or host RSS."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"free_bytes": free, "used_bytes": total - free,
                "torch_allocated_bytes": torch.cuda.memory_allocated(),
                "torch_reserved_bytes": torch.cuda.memory_reserved()}
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return {"free_bytes": -rss, "used_bytes": rss}  # on CPU: RSS (free = -RSS, so deltas read alike)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args) -> dict:
    spec = SHAPES[args.shape]
    model_dir = Path(tempfile.mkdtemp(prefix="mem-release-"))
    (model_dir / "config.json").write_text(json.dumps(hf_config_dict(spec)))
    cfg = EngineConfig(model_path=str(model_dir), device=args.device, dtype=args.dtype or spec.dtype,
                       load_format="dummy", kv_cache_tokens=args.kv_cache_tokens,
                       mem_fraction=args.mem_fraction, max_running_requests=args.batch)
    start = memory(args.device)
    engine = Engine(cfg)
    weights = [(n, t.to(cfg.torch_dtype)) for n, t in random_state_dict(spec)]  # HF names, on the host
    engine.update_weights_from_tensor(weights)
    prompts = torch.randint(0, 256, (args.batch, 16), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    before = [o.token_ids for o in engine.generate(prompts, sp)]
    graphs = engine.runner.graph_runner
    stages = {"engine_loaded": memory(args.device)}
    seconds = {"release_kv_cache": timed(lambda: engine.release_memory(("kv_cache",)))}
    stages["kv_cache_released"] = memory(args.device)
    seconds["release_weights"] = timed(lambda: engine.release_memory(("weights",)))
    stages["all_released"] = memory(args.device)
    seconds["resume_all"] = timed(lambda: engine.resume_memory(("kv_cache", "weights")))
    stages["resumed"] = memory(args.device)
    seconds["weight_update"] = timed(lambda: engine.update_weights_from_tensor(weights))
    after = [o.token_ids for o in engine.generate(prompts, sp)]
    stages["after_update_and_generate"] = memory(args.device)

    def freed(a: str, b: str) -> int:
        return stages[b]["free_bytes"] - stages[a]["free_bytes"]

    return {
        "shape": args.shape, "device": args.device, "dtype": cfg.dtype,
        "expected": {"kv_cache_bytes": engine.runner.token_to_kv_pool.nbytes(),
                     "weights_bytes": engine.runner.weights_bytes(),
                     "kv_cache_tokens": engine.runner.num_token_slots - 1,
                     "cuda_graph_batch_sizes": list(graphs.batch_sizes) if graphs else []},
        "freed_bytes": {"kv_cache (+ graphs)": freed("engine_loaded", "kv_cache_released"),
                        "weights": freed("kv_cache_released", "all_released"),
                        "total": freed("engine_loaded", "all_released"),
                        "taken_back_by_resume": -freed("all_released", "resumed")},
        "engine_footprint_bytes": start["free_bytes"] - stages["engine_loaded"]["free_bytes"],
        "seconds": seconds,
        "outputs_equal_after_resume_and_update": after == before,
        "graph_replays": graphs.num_replays if graphs else 0,
        "stages": stages,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-1.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: the shape's dtype")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="explicit KV budget; default: sized from free memory x --mem-fraction")
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
