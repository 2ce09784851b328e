"""Validated configuration dataclasses: the model's shape (from a HF directory) and the engine's."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from rollout.errors import ConfigError
from weight_sync.update_args import PAUSE_MODES

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling (rope_type='llama3')."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE): each token's router picks `top_k` of
    `num_experts` SwiGLU experts of width `intermediate_size`; `sparse_layers` are the decoder
    layers that have one (the others keep the dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]

    def __post_init__(self) -> None:
        if self.num_experts <= 0 or self.intermediate_size <= 0:
            raise ConfigError(f"config.json: num_experts={self.num_experts} and "
                              f"moe_intermediate_size={self.intermediate_size} must be positive")
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"config.json: num_experts_per_tok={self.top_k} must be in "
                              f"1..num_experts={self.num_experts}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any], num_layers: int) -> Optional["MoEConfig"]:
        """None for a dense model (no `num_experts`; transformers 5 writes `num_local_experts`)."""
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        if experts == 0:
            return None
        step = int(raw.get("decoder_sparse_step", 1))
        if step <= 0:
            raise ConfigError(f"config.json: decoder_sparse_step must be positive, got {step}")
        dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
        sparse = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(num_experts=experts, top_k=int(raw["num_experts_per_tok"]),
                   intermediate_size=int(raw["moe_intermediate_size"]),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=sparse)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[RopeScaling]
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    moe: Optional[MoEConfig] = None

    @property
    def mlp_activation_width(self) -> int:
        """Widest gate|up activation one token makes (top_k experts' for a sparse MLP)."""
        width = self.intermediate_size
        if self.moe is not None:
            width = max(width, self.moe.top_k * self.moe.intermediate_size)
        return width

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        raw = _read_json(model_dir / "config.json")
        try:
            return cls._from_dict(raw, _read_eos(model_dir, raw))
        except KeyError as e:
            raise ConfigError(f"{model_dir}/config.json is missing the key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{model_dir}/config.json has a malformed value: {e}") from None

    @classmethod
    def _from_dict(cls, raw: dict[str, Any], eos: tuple[int, ...]) -> "ModelConfig":
        archs = raw["architectures"]
        if not isinstance(archs, list) or not archs:
            raise ConfigError("config.json: 'architectures' must be a non-empty list")
        _check_full_attention(raw)
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        arch = archs[0]
        layers = int(raw["num_hidden_layers"])
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(raw)),
            rope_scaling=_rope_scaling(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos,
            moe=MoEConfig.from_hf(raw, layers),
        )


def _check_full_attention(raw: dict[str, Any]) -> None:
    """Every layer attends to the whole context here: a sliding window shorter than the model's
    positions (Mistral's `sliding_window`, Qwen's with `use_sliding_window`) would be computed
    wrongly, so it is refused."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    positions = int(raw.get("max_position_embeddings", 2048))
    if window is not None and int(window) < positions:
        raise ConfigError(f"config.json: sliding-window attention (sliding_window={window} < "
                          f"max_position_embeddings={positions}) is not supported")


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    return raw.get("rope_theta", params.get("rope_theta", 10000.0))


def _rope_scaling(raw: dict[str, Any]) -> Optional[RopeScaling]:
    rs = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"config.json: rope scaling type {kind!r} is not supported (only 'llama3')")
    return RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                       float(rs["high_freq_factor"]), int(rs["original_max_position_embeddings"]))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path} not found: model_path must be a Hugging Face model directory")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_eos(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = _as_id_tuple(_read_json(gen).get("eos_token_id"))
        if eos:
            return eos
    return _as_id_tuple(raw.get("eos_token_id"))


ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
GPU_PREFILL_TOKENS = 8192
# GPU: decode batches up to this size replay their whole step as one graph (`step_graphs`). One
# request only: with the graphs of 2-16 requests captured too, the batch-1 decode graph with the
# per-head attention ran 2% slower in the decode benchmark's process (fifty-second session,
# docs/BENCHMARKS.md; the cause, a placement of the graphs' memory or their kernels' CTAs, not
# found), and at 2-16 requests step graphs had not measured faster on the GPU
DEFAULT_STEP_GRAPH_MAX_BS = 1
# CPU: a prefill chunk whose widest activation (the gate|up output) stays within a few MB, so a
# layer's activations stay in cache between its ops instead of streaming through DRAM. On the
# 2-core development machine (cpu-small shape, 64 prompts of 32 tokens, 2,048 prompt tokens)
# chunks of 512-768 tokens made the prefill 25% and the whole generate ~8% faster than one chunk.
CPU_PREFILL_ACTIVATION_BYTES = 4 << 20
CPU_PREFILL_TOKENS_RANGE = (128, 8192)
# GPU: prefill graph sizes (`prefill_graphs`), in tokens and in requests. An eager prefill is
# host-bound up to thousands of tokens (~20 ms of launches; H200, Qwen2-1.5B shape), while past
# ~512 tokens its GPU work grows with the padded token count (~5 us a token): token sizes in
# steps of 256 up to 2,048 and of 512 up to 4,096 keep the padding under a third (a step of
# 2,160 tokens padded to 4,096 took as long as eager). A padded request costs one LM-head row
# and a program that exits, so few request sizes.
DEFAULT_PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048,
                                2560, 3072, 3584, 4096)
DEFAULT_PREFILL_GRAPH_REQUESTS = (1, 16, 256)


@dataclass
class EngineConfig:
    """Everything an Engine needs. Validated on creation; derived values are properties."""

    model_path: Optional[str] = None  # None: the embedded tiny model (made on first use)
    device: str = "cpu"
    dtype: str = "float32"
    tp_size: int = 1
    attention_backend: str = "auto"
    kv_cache_tokens: Optional[int] = None  # explicit KV budget in tokens (CPU default: 65536)
    kv_cache_bytes: Optional[int] = None  # or an explicit budget in bytes
    mem_fraction: float = 0.85  # GPU: share of free memory for weights + KV
    preloaded_weights_bytes: int = 0
    max_running_requests: int = 256
    # tokens an EXTEND step may compute (a longer prompt still goes alone). None: 8192 on a GPU,
    # a cache-sized chunk on CPU (`prefill_token_budget`)
    max_prefill_tokens: Optional[int] = None
    max_context_len: Optional[int] = None  # default: the model's max_position_embeddings
    seed: int = 0
    cuda_graph: bool = True
    cuda_graph_batch_sizes: Optional[tuple[int, ...]] = None
    # prefills of up to this many tokens replay a CUDA graph of the next size up
    # (`prefill_graphs`); None: DEFAULT_PREFILL_GRAPH_TOKENS, (): none
    cuda_graph_prefill_tokens: Optional[tuple[int, ...]] = None
    # ... and of up to this many requests (the next size up); None:
    # DEFAULT_PREFILL_GRAPH_REQUESTS, (1,): one-request prefills only
    cuda_graph_prefill_requests: Optional[tuple[int, ...]] = None
    # decode batches of up to this many requests replay their whole step — input kernel,
    # forward and sampler — as one CUDA graph (`step_graphs`); None: DEFAULT_STEP_GRAPH_MAX_BS
    # (or ROLLOUT_STEP_GRAPH_MAX_BS), 0: none
    cuda_graph_step_max_bs: Optional[int] = None
    # threads that compile the graphs' Triton kernels before their capture
    # (`triton_compile_ahead`); None: the process's CPU cores (at most 32), 0 or 1: each kernel
    # at its first launch, one at a time
    compile_workers: Optional[int] = None
    # Queue step N+1 before waiting for step N's tokens. None: on when device is a GPU and
    # tp_size is 1 (TP followers need the input ids on the host; on CPU nothing runs meanwhile).
    overlap_schedule: Optional[bool] = None
    # CPU: keep oneDNN-packed copies of the GEMM weights (per step: -12% at batch 64, -26% at
    # batch 4 on the cpu-small shape) at the cost of a second copy of those weights in memory
    cpu_packed_weights: bool = True
    check_finite: bool = False  # weight updates: reject NaN/inf tensors
    # the samples of a prompt in one call (its n, and its copies) share its KV cache: one
    # prefill of the prompt, then one token a sample (`prompt_group`); False: each sample
    # prefills its prompt alone
    share_prompt_kv: bool = True
    # an admission's prefill step also carries the running requests' next tokens (one each,
    # beside max_prefill_tokens of prompts), so they do not wait a step for it (`Scheduler`,
    # mixed steps); False: they wait
    mixed_steps: bool = True
    # a sample's KV stays cached after it leaves (a radix tree of its tokens, `prefix_cache`):
    # a later request that starts with those tokens — the next turn of a conversation, a shared
    # system prompt — computes only the rest; unused entries are evicted (least recently used)
    # when slots are needed, and every weight update empties it
    prefix_cache: bool = True
    # MoE models: each output carries the experts every token it fed through the model was
    # routed to (`GenerateOutput.routed_experts`), for routing replay in the trainer
    record_routed_experts: bool = False
    pause_mode: str = "retract"
    show_progress: bool = False
    load_format: str = "auto"  # "auto": the safetensors checkpoint; "dummy": random (benchmarks)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _check_positive_int("tp_size", self.tp_size)
        _check_positive_int("max_running_requests", self.max_running_requests)
        for name in ("max_prefill_tokens", "kv_cache_tokens", "kv_cache_bytes", "max_context_len"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        step_max = self.cuda_graph_step_max_bs
        if step_max is not None and (isinstance(step_max, bool) or not isinstance(step_max, int)
                                     or step_max < 0):
            raise ConfigError(f"cuda_graph_step_max_bs must be a non-negative integer (0: off), "
                              f"got {step_max!r}")
        if not isinstance(self.preloaded_weights_bytes, int) or self.preloaded_weights_bytes < 0:
            raise ConfigError("preloaded_weights_bytes must be a non-negative integer, "
                              f"got {self.preloaded_weights_bytes!r}")
        if not (isinstance(self.mem_fraction, float) and 0.0 < self.mem_fraction <= 1.0):
            raise ConfigError(f"mem_fraction must be a float in (0, 1], got {self.mem_fraction!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                              f"got {self.attention_backend!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        for name in ("share_prompt_kv", "mixed_steps", "prefix_cache", "record_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if self.overlap_schedule not in (None, True, False):
            raise ConfigError(f"overlap_schedule must be None, True or False, got {self.overlap_schedule!r}")
        if self.overlap_schedule and self.tp_size > 1:
            raise ConfigError("overlap_schedule needs tp_size 1: TP followers take each step's input "
                              "ids from the leader's host copy")
        if self.compile_workers is not None and (
                isinstance(self.compile_workers, bool) or not isinstance(self.compile_workers, int)
                or self.compile_workers < 0):
            raise ConfigError(f"compile_workers must be None or an int >= 0, got {self.compile_workers!r}")
        if self.cuda_graph_batch_sizes is not None:
            self.cuda_graph_batch_sizes = _graph_sizes("cuda_graph_batch_sizes",
                                                       self.cuda_graph_batch_sizes, allow_empty=False)
        if self.cuda_graph_prefill_tokens is not None:
            self.cuda_graph_prefill_tokens = _graph_sizes("cuda_graph_prefill_tokens",
                                                          self.cuda_graph_prefill_tokens, allow_empty=True)
        if self.cuda_graph_prefill_requests is not None:
            self.cuda_graph_prefill_requests = _graph_sizes("cuda_graph_prefill_requests",
                                                            self.cuda_graph_prefill_requests,
                                                            allow_empty=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def overlap(self) -> bool:
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return self.is_cuda and self.tp_size == 1

    def prefill_token_budget(self, mc: "ModelConfig") -> int:
        """`max_prefill_tokens`, or its device default: GPU_PREFILL_TOKENS on a GPU; on CPU the
        largest power of two of tokens whose gate|up activation fits CPU_PREFILL_ACTIVATION_BYTES
        (512 for the cpu-small shape in fp32), within CPU_PREFILL_TOKENS_RANGE."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        if self.is_cuda:
            return GPU_PREFILL_TOKENS
        per_token = 2 * mc.mlp_activation_width * self.torch_dtype.itemsize
        tokens = 1 << max(0, (CPU_PREFILL_ACTIVATION_BYTES // per_token).bit_length() - 1)
        low, high = CPU_PREFILL_TOKENS_RANGE
        return min(high, max(low, tokens))

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        if self.cuda_graph_batch_sizes is not None:
            return self.cuda_graph_batch_sizes
        return (1, 2, 4, 8) + tuple(range(16, 257, 16))

    @property
    def graph_step_max_bs(self) -> int:
        if self.cuda_graph_step_max_bs is not None:
            return self.cuda_graph_step_max_bs
        spec = os.environ.get("ROLLOUT_STEP_GRAPH_MAX_BS")  # an A/B's switch
        if spec is None:
            return DEFAULT_STEP_GRAPH_MAX_BS
        if not spec.isdigit():
            raise ConfigError(f"ROLLOUT_STEP_GRAPH_MAX_BS={spec!r}: want a batch size (0: off)")
        return int(spec)

    @property
    def graph_prefill_tokens(self) -> tuple[int, ...]:
        if self.cuda_graph_prefill_tokens is not None:
            return self.cuda_graph_prefill_tokens
        return DEFAULT_PREFILL_GRAPH_TOKENS

    @property
    def graph_prefill_requests(self) -> tuple[int, ...]:
        if self.cuda_graph_prefill_requests is not None:
            return self.cuda_graph_prefill_requests
        return DEFAULT_PREFILL_GRAPH_REQUESTS


def _graph_sizes(name: str, value: Any, allow_empty: bool) -> tuple[int, ...]:
    """CUDA graph sizes: positive ints (bools refused), sorted, each once."""
    sizes = tuple(value)
    if (not sizes and not allow_empty) or any(
            isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
        raise ConfigError(f"{name} must be positive ints, got {sizes!r}")
    return tuple(sorted(set(sizes)))


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["ModelConfig", "EngineConfig", "RopeScaling", "resolve_dtype", "ceil_div", "math"]
