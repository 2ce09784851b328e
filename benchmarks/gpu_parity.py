"""GPU checks of one call (device tool), JSON to --out:

1. Triton + CUDA-graph engine vs torch_native eager engine, Qwen2-1.5B shape: greedy tokens
   of 8 ragged prompts (--prompt-lens) for 16 steps, and the number of graph replays (the graph
   path is taken);
   also each prompt alone through the Triton engine (its batch-1 graph) against the same tokens.
2. TP=2 (RolloutController on both GPUs) vs TP=1 (one GPU): the same greedy tokens, max |Δ| of
   prefill logits, and decode tokens/s of both (batch 32, 128 new tokens).
3. With --flashinfer: the FlashInfer engine vs the Triton engine (greedy tokens, 16 steps).
4. With --hf-control (bf16): the oracle against itself — HF transformers' eager attention vs its
   sdpa attention on the same weights. Two correct bf16 implementations of one model fork on a
   random model's near-tied logits as often as ours do, which is why free-running bf16 greedy
   equality is checked in float32 too (--dtype float32: rounding 2^-24 instead of 2^-8).

  python benchmarks/gpu_parity.py --out $OUT/parity.json [--dtype float32] [--hf-control]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.decode_throughput import SHAPES, model_dir_for, prompts_for
from rollout import Engine, EngineConfig, SamplingParams

RAGGED_LENS = [5, 17, 33, 64, 9, 128, 71, 2]


def ragged_prompts(vocab: int, lens: list[int] = RAGGED_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, min(vocab, 5000), (n,), generator=g).tolist() for n in lens]


def greedy(engine_or_ctl, prompts, steps: int = 16):
    outs = engine_or_ctl.generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0.0,
                                                          ignore_eos=True))
    return [o.token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    first = []
    for x, y in zip(a, b):
        diff = [i for i, (p, q) in enumerate(zip(x, y)) if p != q]
        first.append(diff[0] if diff else None)
    return {"identical": a == b, "first_divergence_step": first,
            "tokens_equal": sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)),
            "tokens_total": sum(len(x) for x in a)}


def throughput(target, vocab: int, batch: int = 32, new: int = 128) -> float:
    prompts = prompts_for(batch, 128, vocab)
    sp = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=1)
    target.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    target.generate(prompts, sp)
    torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="parity.json")
    p.add_argument("--embed-std", type=float, default=0.1,
                   help="std of the (tied) embedding / LM head; the rest keeps std 0.02: peaked "
                        "next-token distributions, so bf16 rounding rarely decides a greedy tie")
    p.add_argument("--skip-tp", action="store_true")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--flashinfer", action="store_true", help="also FlashInfer vs Triton")
    p.add_argument("--hf-control", action="store_true", help="also HF eager vs HF sdpa")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=RAGGED_LENS,
                   help="the ragged prompts' lengths (past 257: the long-context launches)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="each engine's KV pool (default: its share of free memory; the second "
                        "engine then has little left for torch_native's padded attention)")
    args = p.parse_args()
    spec = dataclasses.replace(SHAPES["qwen2-1.5b"], embed_std=args.embed_std)
    path = str(model_dir_for(spec))
    prompts = ragged_prompts(spec.vocab_size, args.prompt_lens)
    result = {"embed_std": args.embed_std, "init_std": spec.init_std, "dtype": args.dtype,
              "prompt_lens": args.prompt_lens}
    base = dict(model_path=path, device="cuda", dtype=args.dtype, max_running_requests=64,
                kv_cache_tokens=args.kv_cache_tokens)
    if args.hf_control:
        result["hf_eager_vs_hf_sdpa"] = hf_control(path, prompts, args.dtype)
        print(json.dumps(result, indent=1), flush=True)

    fast = Engine(EngineConfig(**base, attention_backend="triton", cuda_graph=True))
    ref = Engine(EngineConfig(**base, attention_backend="torch_native", cuda_graph=False))
    fast_tokens, ref_tokens = greedy(fast, prompts), greedy(ref, prompts)
    result["triton_graph_vs_torch_native"] = {
        **agreement(fast_tokens, ref_tokens), "graph_replays": fast.runner.graph_runner.num_replays}
    logits_fast, logits_ref = fast.prefill_logits(prompts), ref.prefill_logits(prompts)
    result["triton_graph_vs_torch_native"]["prefill_rel_err"] = float(
        (logits_fast - logits_ref).norm() / logits_ref.norm())
    # each prompt alone: the batch-1 graph (its own attention kernel, decode_launch_config)
    replays = fast.runner.graph_runner.num_replays
    alone = [greedy(fast, [prompt])[0] for prompt in prompts]
    result["triton_graph_one_request_vs_torch_native"] = {
        **agreement(alone, ref_tokens),
        "graph_replays": fast.runner.graph_runner.num_replays - replays}
    tp1_tokens, tp1_logits = fast_tokens, logits_fast
    tp1_tps = throughput(fast, spec.vocab_size)
    print(json.dumps(result, indent=1), flush=True)
    del ref
    if args.flashinfer:
        result["flashinfer_vs_triton"] = flashinfer_check(base, prompts, fast_tokens, logits_fast)
        print(json.dumps(result, indent=1), flush=True)
    del fast
    gc.collect()
    torch.cuda.empty_cache()

    if not args.skip_tp and torch.cuda.device_count() >= 2:
        result["tp2_vs_tp1"] = tp_check(base, prompts, tp1_tokens, tp1_logits, tp1_tps, spec.vocab_size)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))


def hf_control(path: str, prompts, dtype: str, steps: int = 16) -> dict:
    """Greedy tokens of HF transformers itself, eager attention vs sdpa, on the same weights."""
    from transformers import AutoModelForCausalLM
    runs = {}
    for impl in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=getattr(torch, dtype),
                                                     attn_implementation=impl).cuda().eval()
        with torch.no_grad():
            runs[impl] = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=steps,
                                         min_new_tokens=steps, do_sample=False)[0, len(p):].tolist()
                          for p in prompts]
        del model
        torch.cuda.empty_cache()
    return agreement(runs["eager"], runs["sdpa"])


def flashinfer_check(base: dict, prompts, triton_tokens, triton_logits) -> dict:
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        return {"skipped": f"flashinfer not importable: {e}"}
    eng = Engine(EngineConfig(**base, attention_backend="flashinfer", cuda_graph=True))
    tokens, logits = greedy(eng, prompts), eng.prefill_logits(prompts)
    out = {**agreement(tokens, triton_tokens), "graph_replays": eng.runner.graph_runner.num_replays,
           "prefill_rel_err": float((logits - triton_logits).norm() / triton_logits.norm())}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def tp_check(base: dict, prompts, tp1_tokens, tp1_logits, tp1_tps: float, vocab: int) -> dict:
    import ray
    from actors import RolloutController
    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False)
    cfg = EngineConfig(**base, tp_size=2)
    with RolloutController(cfg, num_replicas=1) as ctl:
        tokens = greedy(ctl, prompts)
        logits = ctl.prefill_logits(prompts)
        tps = throughput(ctl, vocab)
    return {**agreement(tokens, tp1_tokens), "prefill_max_abs_diff": float((logits - tp1_logits).abs().max()),
            "prefill_rel_err": float((logits - tp1_logits).norm() / tp1_logits.norm()),
            "tok_per_s_tp1": tp1_tps, "tok_per_s_tp2": tps, "batch": 32, "new_tokens": 128}


if __name__ == "__main__":
    main()
