"""ModelRunner: one tensor-parallel shard of the model. ForwardBatch in, logits and tokens out.

Knows nothing about requests or Ray. Init order (DESIGN.md): device and distributed state →
initialize() (model, weights) → memory pools → attention backend → CUDA graphs (last, so the
graphs see the pools)."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Optional, Sequence

import torch

from rollout import loader, pdl_policy
from rollout.attention import create_backend
from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import SINGLE, TPGroup
from rollout.errors import (CheckpointError, ConfigError, EngineNotReadyError, KVCacheBudgetError,
                            WeightUpdateError)
from rollout.forward_batch import ForwardBatch
from rollout.layers.one_row_blas import ONE_ROW_BLAS
from rollout.memory import (MEMORY_TAGS, ReqToTokenPool, StorageRecord, TokenToKVPool, check_memory_tags,
                            free_storages, kv_bytes_per_token, kv_capacity_tokens, restore_storages,
                            return_freed_host_memory)
from rollout.models.registry import model_class
from rollout.routing_record import RoutingPool
from weight_sync.spec import TensorSpec
from rollout.sampler import SampleOutput, sample

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, tp: TPGroup = SINGLE,
                 device: Optional[torch.device] = None):
        self.model_config, self.config, self.tp = model_config, config, tp
        self.device = _resolve_device(device or torch.device(config.device))
        self.dtype = config.torch_dtype
        self.released: dict[str, list[StorageRecord]] = {}  # tag -> freed storages (release_memory)
        # one more at every write to the weights: KV computed before is of other weights (the
        # scheduler's prefix cache keeps none across it)
        self.weights_epoch = 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # sparse layers whose routing is recorded: checked before the weights load
        self.routed_layers = self._routed_layers()
        free_before = self._free_device_memory()
        self.initialize()
        self.init_memory_pool(free_before)
        self.attn_backend = create_backend(config.attention_backend, self)
        self.graph_runner = self._init_cuda_graphs()

    # ---- initialisation -------------------------------------------------------------------
    def initialize(self) -> None:
        cls = model_class(self.model_config.architecture)
        with _default_dtype(self.dtype), self.device:
            self.model = cls(self.model_config, self.tp)
        self.model.eval()
        self.model.packed_weights.enabled = self.device.type == "cpu" and self.config.cpu_packed_weights
        if self.config.load_format == "dummy":
            self.init_dummy_weights()
        else:
            self.load_checkpoint(self.config.model_path)

    @torch.inference_mode()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights made on the device (benchmarks of large shapes: no checkpoint to write
        or read). Norm weights are 1, the rest N(0, 0.02), as a freshly initialised model."""
        gen = torch.Generator(self.device).manual_seed(seed)
        for name, p in self.model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=self.device) * 0.02)
        self.weights_changed()

    def load_checkpoint(self, model_path: str) -> None:
        files = loader.checkpoint_files(model_path)
        self.model.weight_table.validate(loader.read_specs(files), complete=True, exact_dtype=False)
        try:
            self.model.load_weights(loader.iter_slices(files))
        except CheckpointError:
            raise
        except Exception as e:  # a shard that passed the header check but fails to read
            raise CheckpointError(f"reading checkpoint {model_path} failed: {e}") from e

    def init_memory_pool(self, free_before: Optional[int]) -> None:
        cfg, mc = self.config, self.model_config
        kv_heads = mc.num_key_value_heads // self.tp.size
        per_token = kv_bytes_per_token(mc.num_hidden_layers, kv_heads, mc.head_dim, self.dtype)
        routed = self.routed_layers
        if routed:
            per_token += RoutingPool.bytes_per_token(routed, mc.moe.top_k)
        tokens = kv_capacity_tokens(
            bytes_per_token=per_token, tokens=cfg.kv_cache_tokens, budget_bytes=cfg.kv_cache_bytes,
            free_before_load=free_before, mem_fraction=cfg.mem_fraction,
            weights_bytes=self.weights_bytes(), preloaded_weights_bytes=cfg.preloaded_weights_bytes)
        tokens = self.tp.min_int(tokens)  # all TP ranks hold the same KV slots (the leader's table)
        if tokens < 2:
            raise KVCacheBudgetError(f"KV budget holds {tokens} token(s); one request needs at least "
                                     f"2 ({per_token} B per token)")
        self.max_context_len = min(cfg.max_context_len or mc.max_position_embeddings,
                                   mc.max_position_embeddings)
        self.req_to_token_pool = ReqToTokenPool(cfg.max_running_requests + 1, self.max_context_len,
                                                self.device)
        routing = RoutingPool(routed, tokens + 1, mc.moe.top_k, self.device) if routed else None
        self.token_to_kv_pool = TokenToKVPool(tokens + 1, mc.num_hidden_layers, kv_heads, mc.head_dim,
                                              self.dtype, self.device, routing)
        self.num_token_slots = tokens + 1  # slot 0 is the dummy for padded rows
        logger.info("KV cache: %d tokens (%.1f MiB)", tokens, self.token_to_kv_pool.nbytes() / 2**20)

    def _routed_layers(self) -> int:
        """Sparse layers whose routing is recorded (`record_routed_experts`), else 0."""
        moe = self.model_config.moe
        if not self.config.record_routed_experts:
            return 0
        if moe is None:
            raise ConfigError(f"record_routed_experts needs a mixture-of-experts model; "
                              f"{self.model_config.architecture} has no experts")
        return len(moe.sparse_layers)

    def _init_cuda_graphs(self):
        if self.device.type != "cuda" or not self.config.cuda_graph:
            return None
        from rollout.cuda_graph_runner import CudaGraphRunner
        return CudaGraphRunner(self)

    def _free_device_memory(self) -> Optional[int]:
        if self.device.type != "cuda":
            return None
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [rows, vocab] float32: one row per request (last token), or every token when
        `fb.return_all_logits`. With `fb.logits_read_at_once`, a graph's logits come in
        the model's dtype (`sample` takes either)."""
        if self.released:
            raise EngineNotReadyError(f"memory {sorted(self.released)} is released; call resume_memory")
        if self.device.type == "cpu":  # one-row GEMMs (a batch-1 decode) through OpenBLAS
            if fb.num_tokens == 1:
                ONE_ROW_BLAS.enter()
            else:
                ONE_ROW_BLAS.leave()
        fb.req_to_token_pool, fb.token_to_kv_pool = self.req_to_token_pool, self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)  # takes in the input ids, writes req_to_token
        self.take_inputs(fb)
        return self.forward_eager(fb)

    @torch.inference_mode()
    def sample_step_graph(self, fb: ForwardBatch) -> Optional[SampleOutput]:
        """fb's forward and sampling queued as one step graph (`step_graphs`) where one serves
        fb, else None (the caller runs `forward` and `sample`)."""
        steps = self.graph_runner.steps if self.graph_runner is not None else None
        if steps is None or self.released or not steps.can_run(fb):
            return None
        return steps.run(fb)

    def take_inputs(self, fb: ForwardBatch) -> None:
        """The step's pending input ids into `fb.input_ids`, its new KV slots (and the shared
        ones its rows start to reference) into req_to_token."""
        fb.resolve_input_ids()
        self.req_to_token_pool.write(fb.token_req_pool_indices, fb.positions, fb.out_cache_loc)
        if fb.shared_slots is not None:
            self.req_to_token_pool.write(fb.shared_token_rows, fb.shared_positions, fb.shared_slots)

    def release_cpu_threads(self) -> None:
        """Called before the engine hands control back to its caller: torch gets its CPU
        threads back and OpenBLAS's workers stop (`one_row_blas`)."""
        ONE_ROW_BLAS.leave()

    def forward_eager(self, fb: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(fb)
        with pdl_policy.for_forward(fb):
            hidden = self.model(fb.input_ids, fb.positions, fb)
            return self.model.compute_logits(hidden, fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, fb: ForwardBatch) -> SampleOutput:
        return sample(logits, fb.sampling_info)

    # ---- weights --------------------------------------------------------------------------
    def validate_weights(self, specs: Iterable[TensorSpec], error: type[Exception], *,
                         complete: bool = False, exact_dtype: bool = True) -> None:
        self._check_weights_resident(error)
        self.model.weight_table.validate(specs, complete=complete, exact_dtype=exact_dtype, error=error)

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        n = self.model.load_weights(weights)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return n

    def weights_changed(self) -> None:
        """Every path that writes weights calls this (the updater's write phases too): packed
        CPU copies of the old values are dropped and made again on first use, and the KV the
        prefix cache holds stops being of these weights (`weights_epoch`)."""
        self.weights_epoch += 1
        self.model.packed_weights.clear()

    def export_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of this shard's parameters (our names, this rank's slices): what a fresh
        shard of the same rank and TP layout copies in with `import_weights` to catch up."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    @torch.inference_mode()
    def import_weights(self, weights: dict[str, torch.Tensor]) -> int:
        """Copy another shard's `export_weights()` in place (checked whole before any write)."""
        self._check_weights_resident(WeightUpdateError)
        params = dict(self.model.named_parameters())
        if set(weights) != set(params):
            diff = sorted(set(weights) ^ set(params))[:3]
            raise WeightUpdateError(f"exported weights do not match this shard's parameters: {diff}")
        for name, t in weights.items():
            if t.shape != params[name].shape:
                raise WeightUpdateError(f"exported {name!r} has shape {tuple(t.shape)}, this shard "
                                        f"holds {tuple(params[name].shape)} (another TP layout?)")
        try:
            for name, t in weights.items():
                params[name].copy_(t)
        finally:
            self.weights_changed()
        return len(weights)

    # ---- memory release / resume (colocated training) ----------------------------------------
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the KV cache and/or the weights: their storages shrink to 0 bytes (the tensors
        stay, so every reference stays valid). CUDA graphs are dropped first: they captured the
        old addresses and hold a memory pool of their own; resume_memory captures them again."""
        todo = [t for t in check_memory_tags(tags) if t not in self.released]
        if not todo:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.graph_runner is not None:
            self.graph_runner.release()
        self.weights_changed()
        for tag in todo:
            self.released[tag] = free_storages(self._tensors_of(tag))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the memory back to the driver (and to a colocated trainer)
        else:
            return_freed_host_memory()  # freed blocks below glibc's mmap threshold stay resident

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Re-allocate what release_memory freed. The KV cache comes back zeroed; weights come
        back with undefined contents (the caller marks them incomplete until an update lands).
        Once nothing is released, CUDA graphs are captured again."""
        todo = [t for t in check_memory_tags(tags) if t in self.released]
        if not todo:
            return
        for tag in todo:
            restore_storages(self.released.pop(tag))
        self.weights_changed()
        # Zeroed before any capture: the capture's warm-up forward reads req_to_token (garbage
        # slot ids there are out-of-bounds reads) and padded rows read the dummy slot 0.
        if "kv_cache" in todo:
            self.clear_kv_cache()
        if not self.released and self.graph_runner is not None:
            self.graph_runner.recapture()
            self.clear_kv_cache()  # no NaNs from a warm-up on undefined weights

    def clear_kv_cache(self) -> None:
        """Zeroes the KV pool and req_to_token (no request may hold slots)."""
        for t in self._tensors_of("kv_cache"):
            t.zero_()

    def _tensors_of(self, tag: str) -> list[torch.Tensor]:
        if tag == "kv_cache":
            return self.token_to_kv_pool.tensors() + [self.req_to_token_pool.req_to_token]
        return list(self.model.parameters())

    def _check_weights_resident(self, error: type[Exception]) -> None:
        if "weights" in self.released:
            raise error("the weights are released (release_memory); call "
                        "resume_memory(tags=('weights',)) before loading weights into them")


def _resolve_device(device: torch.device) -> torch.device:
    """'cuda' → 'cuda:N' (the current device), so set_device and graph capture get an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
