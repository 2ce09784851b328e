"""MoE decode: the engine against HF `generate` on the same random Qwen3-MoE weights, in one run.

  python benchmarks/moe_decode.py --layers 24 --batch-sizes 1 32 128 --out moe.json   # GPU

The model is Qwen3-30B-A3B's shape (hidden 2048, 32 / 4 heads of 128, 128 experts of width 768,
top 8, vocab 151,936) with `--layers` of its 48 decoder layers, so that the engine and HF each
hold a copy on one GPU. HF's model is made on the GPU with random weights (no checkpoint is
written); the engine starts on dummy weights and takes HF's through
`update_weights_from_tensor` — the trainer's path, its fused 3-D expert tensors — which is timed.
Then: the two models' prefill logits on the same prompts (bf16), and tokens/s of sampling at
T = 1, prompt 128 and 128 new tokens, engine and HF calls alternated (`decode_throughput`), next
to a floor: the bytes a step must read (attention, the experts a batch routes to under uniform
routing, the LM head, the KV) at the copy bandwidth measured in the same run."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.decode_throughput import _sync, compare, copy_bandwidth, engine_runner, hf_runner
from rollout import Engine, EngineConfig

SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
             intermediate_size=6144, vocab_size=151936, max_position_embeddings=4096,
             rope_theta=1000000.0, norm_topk_prob=True, tie_word_embeddings=False,
             rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[])


# a tiny twin for checking the script on a CPU (`--small --device cpu`)
SMALL = {**SHAPE, **dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         intermediate_size=128, vocab_size=512)}


@torch.no_grad()
def hf_random_model(shape: dict, layers: int, dtype: torch.dtype, device: str):
    """HF's model made on the device, its weights seeded normal (norms 1)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(num_hidden_layers=layers, **shape)
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(cfg, dtype=dtype).eval()
    gen = torch.Generator(device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:  # the router wider than the rest: tokens then prefer some experts, as trained ones do
            std = 0.1 if name.endswith("mlp.gate.weight") else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)
    return model


def floor_tok_per_s(model, batch: int, args, bandwidth: float) -> float:
    """Tokens/s if a decode step only read what it must at `bandwidth`: attention and router
    weights, the LM head, the experts `batch` tokens route to (uniformly: E·(1 − (1 − k/E)^b)
    of them a layer) and the KV."""
    c = model.config
    elt = 2
    expert = 3 * c.hidden_size * c.moe_intermediate_size * elt
    hit = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch)
    attn = sum(p.numel() for n, p in model.named_parameters()
               if ".self_attn." in n or n.endswith("mlp.gate.weight")) * elt
    head = model.lm_head.weight.numel() * elt
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elt * \
        (args.prompt_len + args.new_tokens / 2) * batch
    step = attn + head + c.num_hidden_layers * hit * expert + kv
    return batch / (step / bandwidth)


@torch.no_grad()
def logits_check(engine: Engine, hf, vocab: int) -> dict:
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, min(vocab, 1000), (4, 64), generator=g).tolist()
    ours = engine.prefill_logits(prompts).float()
    device = next(hf.parameters()).device
    theirs = torch.stack([hf(torch.tensor([p], device=device)).logits[0, -1] for p in prompts]).float()
    diff = (ours - theirs.to(ours.device)).abs()
    return {"max_abs_diff": diff.max().item(), "logit_scale": theirs.abs().max().item(),
            "argmax_equal": int((ours.argmax(-1).cpu() == theirs.argmax(-1).cpu()).sum())}


def graph_profile(engine: Engine, batch: int, args) -> dict:
    """The decode graph of the batch's full step: replay ms and its 15 longest kernels."""
    from benchmarks.cuda_timing import full_batch_graph, replay_seconds
    from benchmarks.graph_kernel_profile import kernel_table
    graph = full_batch_graph(engine, batch, args.prompt_len + args.new_tokens, required=True)
    rows = kernel_table(graph, 10)
    return {"replay_ms": replay_seconds(graph, 30) * 1e3,
            "kernel_us_sum": sum(r["us_per_replay"] for r in rows), "kernels": rows[:15]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-hf-generate", action="store_true")
    p.add_argument("--small", action="store_true", help="the tiny twin shape (script checks)")
    p.add_argument("--profile", action="store_true",
                   help="each batch's decode graph: replay time and its kernels (torch.profiler)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--record-routed-experts", action="store_true",
                   help="routing replay on (EngineConfig.record_routed_experts): its cost")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.samples_per_prompt, args.hf_static_cache = 1, False
    shape = SMALL if args.small else SHAPE
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    hf = hf_random_model(shape, args.layers, dtype, args.device)
    result = {"shape": {**shape, "num_hidden_layers": args.layers}, "torch": torch.__version__,
              "record_routed_experts": args.record_routed_experts}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = hf.config.to_dict()
        cfg["architectures"] = ["Qwen3MoeForCausalLM"]
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model_path=tmp, device=args.device, dtype=str(dtype)[6:],
                                     load_format="dummy", prefix_cache=False,
                                     max_running_requests=max(*args.batch_sizes, 4),
                                     record_routed_experts=args.record_routed_experts,
                                     kv_cache_tokens=None if args.device == "cuda" else 65536))
        _sync(args.device)
        result["startup_s"] = time.perf_counter() - t0
    named = [(n, p) for n, p in hf.named_parameters()]
    result["weights_GB"] = sum(p.numel() * p.element_size() for _, p in named) / 1e9
    _sync(args.device)
    t0 = time.perf_counter()
    engine.update_weights_from_tensor(named)
    _sync(args.device)
    result["update_from_tensor_s"] = time.perf_counter() - t0
    result["logits"] = logits_check(engine, hf, shape["vocab_size"])
    print(json.dumps(result), flush=True)
    bandwidth = copy_bandwidth(args.device)
    result["copy_bandwidth_GBps"] = bandwidth / 1e9
    rows = []
    for bs in args.batch_sizes:
        e_call = engine_runner(engine, bs, args)
        if args.skip_hf_generate:
            runs = [e_call() for _ in range(args.repeats)]
            row = {"batch": bs, "engine": {"tok_per_s": runs[0][0] / min(t for _, t in runs),
                                           "all_seconds": [t for _, t in runs]}}
        else:
            row = {"batch": bs, **compare(e_call, hf_runner(hf, bs, args), args.repeats)}
        row["floor_tok_per_s"] = floor_tok_per_s(hf, bs, args, bandwidth)
        if args.profile:
            row["graph"] = graph_profile(engine, bs, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["rows"] = rows
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
