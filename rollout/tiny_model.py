"""The tiny-model factory: deterministic random HF-format model directories for tests and demos.

Writes config.json, generation_config.json, model.safetensors (or an index plus shards) and a
byte-level tokenizer.json, without needing `transformers`. Same arguments give identical bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors.torch import save_file

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Qwen3MoeForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "Qwen3MoeForCausalLM": "qwen3_moe"}
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 256, 257, 258 after the 256 bytes


@dataclass(frozen=True)
class TinyModelSpec:
    architecture: str = "Qwen2ForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    llama3_rope_scaling: bool = False
    tie_word_embeddings: bool = False
    init_std: float = 0.05
    # std of the embedding / LM head (default init_std). A larger one gives peaked next-token
    # distributions, as trained models have, so greedy comparisons between two bf16
    # implementations are not decided by rounding between near-tied logits.
    embed_std: Optional[float] = None
    seed: int = 0
    dtype: str = "float32"  # of the saved tensors
    # Qwen3-MoE: experts of width moe_intermediate_size in the sparse layers (every
    # decoder_sparse_step-th, but mlp_only_layers), the others dense of intermediate_size
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # std of the router: a trained router is peaked, so bf16 rounding rarely swaps an expert
    router_std: float = 0.2

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("a MoE model needs 0 < num_experts_per_tok <= num_experts")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must hold the 256 bytes and the special tokens (>= 259)")

    @property
    def is_moe(self) -> bool:
        return self.architecture == "Qwen3MoeForCausalLM"

    def is_sparse_layer(self, i: int) -> bool:
        return (self.is_moe and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), *,
                    num_shards: int = 1, with_tokenizer: bool = True) -> Path:
    """Write a random HF model directory for `spec` and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_dict(spec), indent=2))
    eos = {"eos_token_id": 257, "bos_token_id": 256}
    (out / "generation_config.json").write_text(json.dumps(eos, indent=2))
    dtype = getattr(torch, spec.dtype)
    write_safetensors(out, {n: t.to(dtype) for n, t in random_state_dict(spec)}, num_shards)
    if with_tokenizer:
        write_byte_tokenizer(out)
    return out


def hf_config_dict(spec: TinyModelSpec) -> dict:
    cfg = {
        "architectures": [spec.architecture],
        "model_type": _MODEL_TYPES[spec.architecture],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.resolved_head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
        "torch_dtype": spec.dtype,
        "attention_dropout": 0.0,
    }
    if spec.architecture == "LlamaForCausalLM":
        cfg.update(attention_bias=False, mlp_bias=False)
    if spec.architecture == "MistralForCausalLM":
        cfg.update(sliding_window=None)  # full attention (Mistral 7B v0.2 and later)
    if spec.is_moe:
        cfg.update(attention_bias=False, num_experts=spec.num_experts,
                   num_experts_per_tok=spec.num_experts_per_tok,
                   moe_intermediate_size=spec.moe_intermediate_size,
                   norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=spec.decoder_sparse_step,
                   mlp_only_layers=list(spec.mlp_only_layers), output_router_logits=False)
    if spec.llama3_rope_scaling:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return cfg


def random_state_dict(spec: TinyModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named random tensors; norms near 1 so activations stay in a healthy range."""
    gen = torch.Generator().manual_seed(spec.seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * spec.init_std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    h, d = spec.hidden_size, spec.resolved_head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    embed_scale = (spec.embed_std or spec.init_std) / spec.init_std
    yield "model.embed_tokens.weight", normal(spec.vocab_size, h) * embed_scale
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(h)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{name}.weight", normal(rows, h)
            if spec.architecture == "Qwen2ForCausalLM":
                yield p + f"self_attn.{name}.bias", normal(rows)
        yield p + "self_attn.o_proj.weight", normal(h, q)
        if spec.architecture in _QK_NORM:
            yield p + "self_attn.q_norm.weight", norm(d)
            yield p + "self_attn.k_norm.weight", norm(d)
        yield p + "post_attention_layernorm.weight", norm(h)
        if spec.is_sparse_layer(i):
            yield from _expert_tensors(spec, p + "mlp.", normal, gen)
            continue
        yield p + "mlp.gate_proj.weight", normal(spec.intermediate_size, h)
        yield p + "mlp.up_proj.weight", normal(spec.intermediate_size, h)
        yield p + "mlp.down_proj.weight", normal(h, spec.intermediate_size)
    yield "model.norm.weight", norm(h)
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", normal(spec.vocab_size, h) * embed_scale


def _expert_tensors(spec: TinyModelSpec, prefix: str, normal, gen: torch.Generator):
    """A sparse MLP as a checkpoint holds it: the router, then each expert's three tensors."""
    h, w = spec.hidden_size, spec.moe_intermediate_size
    yield prefix + "gate.weight", torch.randn(spec.num_experts, h, generator=gen) * spec.router_std
    for e in range(spec.num_experts):
        yield prefix + f"experts.{e}.gate_proj.weight", normal(w, h)
        yield prefix + f"experts.{e}.up_proj.weight", normal(w, h)
        yield prefix + f"experts.{e}.down_proj.weight", normal(h, w)


def write_safetensors(out: Path, tensors: dict[str, torch.Tensor], num_shards: int = 1) -> None:
    """One model.safetensors, or `num_shards` files plus model.safetensors.index.json."""
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k::num_shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_byte_tokenizer(out: Path) -> None:
    """A byte-level tokenizer: one token per byte (no merges) plus the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of_char(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    meta = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1],
            "pad_token": SPECIAL_TOKENS[2], "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(meta, indent=2))


def _byte_of_char(c: str) -> int:
    """Inverse of GPT-2's bytes-to-unicode table, so token id == byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    if ord(c) in printable:
        return ord(c)
    missing = [b for b in range(256) if b not in printable]
    return missing[ord(c) - 256]


def default_tiny_model_dir() -> Path:
    """The embedded default model (made once, then reused): Qwen2-shaped, byte tokenizer."""
    import os
    import tempfile
    root = Path(os.environ.get("ROLLOUT_CACHE", Path(tempfile.gettempdir()) / "rollout-cache"))
    out = root / "tiny-qwen2-v1"
    if not (out / "model.safetensors").is_file():
        tmp = Path(tempfile.mkdtemp(dir=root.parent if root.exists() else None))
        make_tiny_model(tmp, TinyModelSpec())
        root.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(out)
        except OSError:  # another process made it first
            pass
    return out
