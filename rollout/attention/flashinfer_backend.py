"""FlashInfer attention backend: FlashInfer's batch decode and batch prefill wrappers over our KV pool.

The pool is token-granular, which FlashInfer sees as a paged cache with page_size 1: the "pages"
of request b are the slots req_to_token[row_b, :seq_len_b], so kv_indptr is the cumsum of the
seq_lens, kv_indices those rows concatenated, and every last_page_len is 1. The K/V buffers
[slots, kv_heads, head_dim] are viewed as NHD pages [slots, 1, kv_heads, head_dim] (no copy).

`plan` runs once per batch in `init_forward_metadata`; every layer then calls `run`. The indptrs
are built on the host from the ForwardBatch's *_cpu lists (plan schedules on the host, so it would
copy device indptrs back); kv_indices is gathered on the device with no host sync. Extend (and
MIXED) batches use the paged prefill wrapper with causal=True over prefix + new tokens: the base
class writes the new tokens' KV into the pool before `forward_extend` runs.

Decode CUDA graphs: one `use_cuda_graph=True` decode wrapper per graph batch size, all reading
one set of static index buffers sized for max_bs; the capture/replay hooks re-plan that wrapper
in place. The `flashinfer` package is imported lazily, when the backend is created."""
from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Optional

import torch

from rollout.attention.base import AttentionBackend
from rollout.errors import ConfigError

if TYPE_CHECKING:
    from rollout.forward_batch import ForwardBatch
    from rollout.layers.attention import Attention

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'rollout-engine[flashinfer]'"
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV partials)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
DEVICE_TYPES = ("cuda",)
KERNEL_BACKEND = "fa2"  # prefill, and tensor-core decode: one JIT module serves both
TENSOR_CORE_MIN_GROUP = 4  # query heads per KV head from which tensor-core decode pays off


def import_flashinfer():
    """The flashinfer module, or a ConfigError that says how to install it."""
    try:
        import flashinfer
    except ImportError as e:
        raise ConfigError(
            f"attention_backend='flashinfer' needs the flashinfer package, which failed to import "
            f"({e}); install it with: {INSTALL_HINT} (or choose attention_backend='triton')") from e
    return flashinfer


def flashinfer_importable() -> bool:
    try:
        import_flashinfer()
    except ConfigError:
        return False
    return True


def unsupported_reason(dtype: Optional[torch.dtype], head_dim: Optional[int]) -> Optional[str]:
    """Why FlashInfer cannot serve this model (None: it can). Unknown values pass."""
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"FlashInfer needs dtype bfloat16 or float16, got {dtype}"
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        return f"FlashInfer supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    return None


def host_indptr(lens: list[int]) -> tuple[torch.Tensor, int]:
    """int32 [len(lens) + 1] exclusive cumsum on the host, and the total."""
    ends = list(itertools.accumulate(lens))
    return torch.tensor([0] + ends, dtype=torch.int32), (ends[-1] if ends else 0)


class FlashInferBackend(AttentionBackend):
    def __init__(self, runner) -> None:
        fi = import_flashinfer()
        mc, tp = runner.model_config, runner.tp.size
        self.num_heads, self.num_kv_heads = mc.num_attention_heads // tp, mc.num_key_value_heads // tp
        self.head_dim = mc.head_dim
        pool = runner.token_to_kv_pool
        self.q_dtype, self.kv_dtype = runner.dtype, pool.k_buffers[0].dtype
        for dtype in (self.q_dtype, self.kv_dtype):
            reason = unsupported_reason(dtype, self.head_dim)
            if reason:
                raise ConfigError(f"attention_backend='flashinfer': {reason}; use 'triton' instead")
        if runner.device.type not in DEVICE_TYPES:
            raise ConfigError(f"attention_backend='flashinfer' needs a CUDA device, got {runner.device}")
        self.device = runner.device
        self.num_slots = pool.k_buffers[0].shape[0]
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.sm_scale = self.head_dim ** -0.5  # planned; a layer with another scaling rescales q
        self.use_tensor_cores = self.num_heads // self.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self._fi = fi
        # zeroed: FlashInfer asks for a zero-initialised float workspace on first use
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=KERNEL_BACKEND)
        self.decode_wrapper = self._decode_wrapper()
        self.wrapper = None  # the wrapper planned for the current batch
        # CUDA graphs: static buffers for max_bs, and one graph-mode decode wrapper per batch size
        self.graph_wrappers: dict[int, object] = {}
        self.graph_bufs: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def _decode_wrapper(self, graph_bs: Optional[int] = None):
        kwargs = dict(use_tensor_cores=self.use_tensor_cores)
        if self.use_tensor_cores:
            kwargs["backend"] = KERNEL_BACKEND
        if graph_bs is not None:
            indptr, indices, last_page_len = self.graph_bufs
            kwargs.update(use_cuda_graph=True, paged_kv_indptr_buffer=indptr[:graph_bs + 1],
                          paged_kv_indices_buffer=indices,
                          paged_kv_last_page_len_buffer=last_page_len[:graph_bs])
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", **kwargs)

    # ---- per-batch metadata ---------------------------------------------------------------
    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if fb.forward_mode.is_decode:
            self._plan_decode(self.decode_wrapper, fb)
            return
        qo_indptr, _ = host_indptr(fb.extend_seq_lens_cpu)
        kv_indptr, total = host_indptr(fb.seq_lens_cpu)
        self.prefill_wrapper.plan(
            qo_indptr, kv_indptr, self._kv_indices(fb, total), self._last_page_len(fb.batch_size),
            self.num_heads, self.num_kv_heads, self.head_dim, 1, causal=True,
            sm_scale=self.sm_scale, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype)
        self.wrapper = self.prefill_wrapper

    def _plan_decode(self, wrapper, fb: "ForwardBatch", indices_out: Optional[torch.Tensor] = None):
        kv_indptr, total = host_indptr(fb.seq_lens_cpu)
        wrapper.plan(
            kv_indptr, self._kv_indices(fb, total, indices_out), self._last_page_len(fb.batch_size),
            self.num_heads, self.num_kv_heads, self.head_dim, 1,
            sm_scale=self.sm_scale, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype)
        self.wrapper = wrapper

    def _kv_indices(self, fb: "ForwardBatch", total: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """req_to_token[row_b, :seq_len_b] for every request b, concatenated (int32, on the
        device). `total` (from seq_lens_cpu) sizes every op, so nothing waits for the device."""
        lens = fb.seq_lens
        req = torch.repeat_interleave(lens, output_size=total)  # request of each key
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(total, device=lens.device) - starts[req]
        flat = fb.req_pool_indices[req] * self.req_to_token.shape[1] + pos
        if out is not None:
            out = out[:total]
        return torch.index_select(self.req_to_token.view(-1), 0, flat, out=out)

    @staticmethod
    def _last_page_len(bs: int) -> torch.Tensor:
        return torch.ones(bs, dtype=torch.int32)  # page_size 1: every last page is full

    # ---- attention ------------------------------------------------------------------------
    def forward_extend(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        return self._run(q, layer, fb)

    def forward_decode(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        return self._run(q, layer, fb)

    def _run(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        pool = fb.token_to_kv_pool
        k = pool.k_buffers[layer.layer_id].unsqueeze(1)  # [slots, page_size 1, kv_heads, head_dim]
        v = pool.v_buffers[layer.layer_id].unsqueeze(1)
        if layer.scaling != self.sm_scale:  # plan holds one scale per batch
            q = q * (layer.scaling / self.sm_scale)
        return self.wrapper.run(q.contiguous(), (k, v))

    # ---- CUDA graphs (decode only) ----------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Static indptr / indices / last_page_len for graphs of up to max_bs requests. Keys of
        one batch hold distinct slots, except the padded rows' dummy slot 0."""
        max_keys = min(max_bs * self.req_to_token.shape[1], self.num_slots + max_bs)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.graph_bufs = (torch.zeros(max_bs + 1, **i32), torch.zeros(max_keys, **i32),
                           torch.ones(max_bs, **i32))
        self.graph_wrappers = {}

    def init_forward_metadata_capture(self, fb: "ForwardBatch") -> None:
        if self.graph_bufs is None:
            raise RuntimeError("init_cuda_graph_state must be called before capturing graphs")
        if fb.batch_size not in self.graph_wrappers:
            self.graph_wrappers[fb.batch_size] = self._decode_wrapper(graph_bs=fb.batch_size)
        self.init_forward_metadata_replay(fb)

    def init_forward_metadata_replay(self, fb: "ForwardBatch") -> None:
        """Re-plan the graph's wrapper for fb (already padded to the graph's batch size): the
        static buffers and the plan's workspace are updated in place, where the graph reads."""
        wrapper = self.graph_wrappers.get(fb.batch_size)
        if wrapper is None:
            raise RuntimeError(f"no decode graph was captured for batch size {fb.batch_size}")
        self._plan_decode(wrapper, fb, indices_out=self.graph_bufs[1])
