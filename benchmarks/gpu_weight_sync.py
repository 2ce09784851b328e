"""GPU weight sync in one call (device tool, nvidia-h200-x2), JSON to --out:

1. Correctness, Qwen2-1.5B shape, bf16: a HF model on the trainer GPU pushes its weights into a
   TP=1 replica on GPU 0 — over NCCL from GPU 1, and over CUDA IPC from GPU 0 (colocated) — and
   the replica's prefill logits match the HF model's (relative error).
2. `rollout bench weight-sync`: p50/p90 latency, phases and the floor of the same bytes for
   nccl and ipc on the 0.5B/1.5B/7B shapes, disk and tensor on 0.5B/1.5B.

  python benchmarks/gpu_weight_sync.py --out $OUT/weight_sync_check.json --bench-out $OUT
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import ray
import torch

from actors import RolloutController
from actors.weight_sync_bench import model_dir, run_bench
from rollout import EngineConfig
from weight_sync import WeightSender

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [100, 2000, 30000, 7], [9] * 40]


def hf_logits(model, prompts) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p], device=model.device)).logits[0, -1].float().cpu()
                            for p in prompts])


def correctness(transport: str, trainer_device: str, path: Path) -> dict:
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(trainer_device).eval()
    engine_cfg = EngineConfig(model_path=str(path), device="cuda", dtype="bfloat16", load_format="dummy",
                              mem_fraction=0.5, cuda_graph=False)
    with RolloutController(engine_cfg, num_replicas=1) as ctl:
        sender = WeightSender(ctl, transport)
        before = ctl.prefill_logits(PROMPTS)
        version = sender.push(hf.named_parameters())
        after, ref = ctl.prefill_logits(PROMPTS), hf_logits(hf, PROMPTS)
        sender.close()
    return {"transport": transport, "trainer_device": trainer_device, "version": version,
            "rel_err_after": float((after - ref).norm() / ref.norm()),
            "rel_err_before": float((before - ref).norm() / ref.norm()),
            "argmax_equal": (after.argmax(-1) == ref.argmax(-1)).tolist(),
            "push_seconds": sender.last.total}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="weight_sync_check.json")
    p.add_argument("--bench-out", default=".")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--skip-bench", action="store_true")
    args = p.parse_args()
    ray.init(num_gpus=1, num_cpus=16, include_dashboard=False)  # the replica takes GPU 0
    last = f"cuda:{torch.cuda.device_count() - 1}"
    path = model_dir("qwen2-1.5b", "bfloat16", Path(tempfile.mkdtemp()))
    checks = [correctness("nccl", last, path), correctness("ipc", "cuda:0", path)]
    print(json.dumps(checks, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(checks, indent=2))
    if args.skip_bench:
        return
    out = Path(args.bench_out)
    big = run_bench(["nccl", "ipc"], ["qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"], [1], [512],
                    iters=args.iters, device="cuda", dtype="bfloat16", out_dir="/tmp/ws_fast",
                    progress=False)
    slow = run_bench(["disk", "tensor"], ["qwen2-0.5b", "qwen2-1.5b"], [1], [512], iters=3,
                     device="cuda", dtype="bfloat16", out_dir="/tmp/ws_slow", progress=False)
    merged = {**big, "cases": big["cases"] + slow["cases"]}
    from actors.weight_sync_bench import write_outputs
    write_outputs(merged, out)


if __name__ == "__main__":
    main()
