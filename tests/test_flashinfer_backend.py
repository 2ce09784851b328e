"""Spec: the FlashInfer attention backend.

Without FlashInfer (CI): choosing it raises a ConfigError that says how to install it, and "auto"
falls back to Triton. With a fake `flashinfer` module that implements the wrappers' plan/run
contract (page_size 1) in plain PyTorch, the backend's metadata (host indptrs, kv_indices gathered
from req_to_token, causal extend, the CUDA-graph static buffers) gives torch_native's attention on
CPU. On a GPU with FlashInfer installed (tests marked `gpu`): bf16 decode/extend against
torch_native, whole-engine greedy tokens against the Triton engine, and decode CUDA graphs
against eager."""
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rollout.attention import create_backend, resolve_backend_name
from rollout.attention import flashinfer_backend as fib
from rollout.attention.torch_native import TorchNativeBackend
from rollout.errors import ConfigError
from rollout.forward_batch import ForwardBatch, ForwardMode
from tests.helpers import RunnerDriver, eager_graph_capture

SEQ_LENS = [1, 40, 17, 33, 5]
PREFIX_LENS = [0, 25, 0, 32, 3]  # extend: 1, 15, 17, 1, 2 new tokens


def stub_runner(device, dtype, heads, kv_heads, head_dim, req_to_token, k=None, v=None):
    """The attributes of a ModelRunner that backends read."""
    empty = torch.empty(8, kv_heads, head_dim, dtype=dtype)
    pool = SimpleNamespace(k_buffers=[empty if k is None else k], v_buffers=[empty if v is None else v])
    return SimpleNamespace(
        device=torch.device(device), dtype=dtype, tp=SimpleNamespace(size=1),
        model_config=SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads,
                                     head_dim=head_dim),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=pool)


# ---- without flashinfer ---------------------------------------------------------------------------
@pytest.fixture
def no_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError


def test_choosing_flashinfer_without_it_says_how_to_install(no_flashinfer):
    runner = stub_runner("cuda", torch.bfloat16, 8, 2, 128, torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ConfigError, match=r"pip install 'rollout-engine\[flashinfer\]'"):
        create_backend("flashinfer", runner)


def test_engine_with_flashinfer_without_it_raises_config_error(no_flashinfer, tiny_dirs):
    with pytest.raises(ConfigError, match="pip install"):
        RunnerDriver(tiny_dirs["Qwen3ForCausalLM"], device="cpu", attention_backend="flashinfer")


def test_auto_falls_back_to_triton_without_flashinfer(no_flashinfer):
    assert resolve_backend_name("auto", "cuda") == "triton"
    assert resolve_backend_name("auto", "cuda:1", torch.bfloat16, 128) == "triton"
    assert resolve_backend_name("auto", "cpu") == "torch_native"
    assert resolve_backend_name("flashinfer", "cuda") == "flashinfer"  # explicit names pass


def test_auto_picks_flashinfer_when_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    assert resolve_backend_name("auto", "cuda") == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.bfloat16, 128) == "flashinfer"
    assert resolve_backend_name("auto", "cpu", torch.bfloat16, 128) == "torch_native"
    # what FlashInfer cannot serve stays on Triton
    assert resolve_backend_name("auto", "cuda", torch.float32, 128) == "triton"
    assert resolve_backend_name("auto", "cuda", torch.bfloat16, 96) == "triton"


def test_auto_survives_a_broken_install(monkeypatch):
    def broken():
        raise OSError("libtvm_ffi.so: cannot open shared object file")
    monkeypatch.setattr(fib, "import_flashinfer", broken)
    assert resolve_backend_name("auto", "cuda", torch.bfloat16, 128) == "triton"


def test_unsupported_models_raise_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer_module())
    table = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ConfigError, match="bfloat16 or float16"):
        create_backend("flashinfer", stub_runner("cuda", torch.float32, 8, 2, 128, table))
    with pytest.raises(ConfigError, match="head_dim"):
        create_backend("flashinfer", stub_runner("cuda", torch.bfloat16, 8, 2, 80, table))
    with pytest.raises(ConfigError, match="CUDA"):
        create_backend("flashinfer", stub_runner("cpu", torch.bfloat16, 8, 2, 128, table))


# ---- a fake flashinfer: the wrappers' contract in PyTorch -----------------------------------------
class FakeWrapper:
    """plan/run of FlashInfer's paged wrappers for page_size 1, as plain softmax attention.

    Asserts what the backend promises: int32 indptrs on the host (plan reads them there, so a
    device indptr would cost a device->host sync), int32 kv_indices of length indptr[-1], last
    pages of length 1. In CUDA-graph mode plan copies into the static buffers and run reads
    them back from there, as a replayed graph would."""

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto"):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.graph_bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                           paged_kv_last_page_len_buffer) if use_cuda_graph else None
        self.use_tensor_cores, self.num_plans, self.num_runs = use_tensor_cores, 0, 0

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, heads, kv_heads, head_dim,
              page_size, causal, sm_scale, q_data_type, kv_data_type):
        assert page_size == 1 and qo_indptr.device.type == kv_indptr.device.type == "cpu"
        assert kv_indptr.dtype == qo_indptr.dtype == kv_indices.dtype == torch.int32
        assert len(kv_indices) == int(kv_indptr[-1]) and bool((last_page_len == 1).all())
        if self.graph_bufs is not None:
            indptr_buf, indices_buf, last_buf = self.graph_bufs
            assert len(last_page_len) == len(last_buf) and len(kv_indices) <= len(indices_buf)
            indptr_buf.copy_(kv_indptr)
            indices_buf[:len(kv_indices)].copy_(kv_indices)
            kv_indptr, kv_indices = indptr_buf, indices_buf
        self.p = SimpleNamespace(qo=qo_indptr.tolist(), kv_indptr=kv_indptr, kv_indices=kv_indices,
                                 group=heads // kv_heads, causal=causal, scale=sm_scale,
                                 q_dtype=q_data_type, kv_dtype=kv_data_type, head_dim=head_dim)
        self.num_plans += 1

    def run(self, q, paged_kv_cache):
        p, (k, v) = self.p, paged_kv_cache
        assert k.shape[1] == 1 and k.shape[-1] == p.head_dim  # [slots, page_size 1, kv_heads, d]
        assert q.dtype == p.q_dtype and k.dtype == v.dtype == p.kv_dtype
        kv_indptr, out = p.kv_indptr.tolist(), torch.empty_like(q)
        for b in range(len(p.qo) - 1):
            qb = q[p.qo[b]:p.qo[b + 1]].float()
            idx = p.kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
            kb, vb = (t[idx, 0].float().repeat_interleave(p.group, 1) for t in (k, v))
            n, length = qb.shape[0], idx.numel()
            scores = torch.einsum("qhd,khd->hqk", qb, kb) * p.scale
            if p.causal:
                allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
                scores = scores.masked_fill(~allowed, float("-inf"))
            probs = scores.softmax(-1)
            out[p.qo[b]:p.qo[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vb).to(q.dtype)
        self.num_runs += 1
        return out


class FakeDecodeWrapper(FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, sm_scale, q_data_type, kv_data_type):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, False, sm_scale, q_data_type, kv_data_type)


class FakePrefillWrapper(FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal, sm_scale, q_data_type,
             kv_data_type):
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                   q_data_type, kv_data_type)


def fake_flashinfer_module() -> types.ModuleType:
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    return mod


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The fake module, and the backend allowed on CPU in fp32 with the tiny models' head_dim."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer_module())
    monkeypatch.setattr(fib, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fib, "SUPPORTED_DTYPES", fib.SUPPORTED_DTYPES + (torch.float32,))
    monkeypatch.setattr(fib, "SUPPORTED_HEAD_DIMS", fib.SUPPORTED_HEAD_DIMS + (16,))
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)


# ---- ragged paged batches --------------------------------------------------------------------------
def make_paged(seq_lens, kv_heads, head_dim, dtype, device, seed=0):
    """A random pool where request b's token j is at slot req_to_token[rows[b], j] (slots
    scattered; slot 0 is the dummy)."""
    gen = torch.Generator().manual_seed(seed)
    total, batch = sum(seq_lens), len(seq_lens)
    slots = torch.randperm(total, generator=gen) + 1
    table = torch.zeros(batch + 3, max(seq_lens) + 8, dtype=torch.int32)
    rows = torch.randperm(batch + 3, generator=gen)[:batch]
    for b, n in enumerate(seq_lens):
        table[rows[b], :n] = slots[sum(seq_lens[:b]): sum(seq_lens[:b]) + n].int()
    k, v = (torch.randn(total + 1, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
            for _ in range(2))
    return k, v, table.to(device), rows.to(device)


def backend_outputs(mode, seq_lens, prefix_lens, heads, kv_heads, head_dim, dtype, device, seed=0):
    """(flashinfer, torch_native, the flashinfer backend) for one layer on a ragged batch."""
    k, v, table, rows = make_paged(seq_lens, kv_heads, head_dim, dtype, device, seed)
    ext = [s - p for s, p in zip(seq_lens, prefix_lens)]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(ext), heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    t = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
    n = sum(ext)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=len(ext), input_ids=t([0] * n), positions=t([0] * n),
        req_pool_indices=rows, seq_lens=t(seq_lens), out_cache_loc=t([0] * n),
        seq_lens_cpu=list(seq_lens), extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens=t(ext), extend_prefix_lens=t(list(prefix_lens)),
        token_to_kv_pool=SimpleNamespace(k_buffers=[k], v_buffers=[v]))
    runner = stub_runner(device, dtype, heads, kv_heads, head_dim, table, k, v)
    layer = SimpleNamespace(layer_id=0, scaling=head_dim ** -0.5, num_heads=heads, num_kv_heads=kv_heads)
    outs = []
    flashinfer = create_backend("flashinfer", runner)
    flashinfer.last_fb = fb
    for backend in (flashinfer, TorchNativeBackend(runner)):
        backend.init_forward_metadata(fb)
        run = backend.forward_decode if mode.is_decode else backend.forward_extend
        outs.append(run(q, layer, fb))
    return outs[0], outs[1], flashinfer


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 2), (4, 4)])  # tensor-core decode from 4
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED])
def test_fake_flashinfer_matches_torch_native(fake_flashinfer, mode, heads, kv_heads):
    prefix = [n - 1 for n in SEQ_LENS] if mode.is_decode else PREFIX_LENS
    out, expected, backend = backend_outputs(mode, SEQ_LENS, prefix, heads, kv_heads, 64,
                                             torch.float32, "cpu")
    assert (out - expected).abs().max().item() <= 1e-5
    assert backend.use_tensor_cores == (heads // kv_heads >= 4)
    wrapper = backend.decode_wrapper if mode.is_decode else backend.prefill_wrapper
    assert backend.wrapper is wrapper and wrapper.num_plans == 1
    assert wrapper.p.causal == (not mode.is_decode)


def test_kv_indices_are_the_request_rows_concatenated(fake_flashinfer):
    _, _, backend = backend_outputs(ForwardMode.EXTEND, SEQ_LENS, PREFIX_LENS, 4, 2, 64,
                                    torch.float32, "cpu")
    p, fb = backend.prefill_wrapper.p, backend.last_fb
    rows = fb.req_pool_indices.tolist()
    expected = torch.cat([backend.req_to_token[r, :n] for r, n in zip(rows, SEQ_LENS)])
    assert torch.equal(p.kv_indices, expected)
    assert p.kv_indptr.tolist() == [0, 1, 41, 58, 91, 96] and p.qo == [0, 1, 16, 33, 34, 36]


def greedy(driver: RunnerDriver, prompts, steps: int):
    """Greedy tokens and the logits that chose them, [steps, batch, vocab]."""
    logits = driver.prefill([list(s) for s in prompts])
    tokens, seen = [], []
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        tokens.append(nxt)
        seen.append(logits.float())
        logits = driver.decode(nxt)
    return tokens, torch.stack(seen)


PROMPTS = [[1, 5, 9], [42, 7, 300, 12, 8, 99, 3], [256, 17], list(range(60, 75)), [5, 6, 7, 8, 9]]


def test_engine_with_fake_flashinfer_matches_torch_native(fake_flashinfer, tiny_dirs):
    path = tiny_dirs["Qwen3ForCausalLM"]
    fi = RunnerDriver(path, device="cpu", attention_backend="flashinfer")
    native = RunnerDriver(path, device="cpu", attention_backend="torch_native")
    assert isinstance(fi.runner.attn_backend, fib.FlashInferBackend)
    f_tokens, f_logits = greedy(fi, PROMPTS, 6)
    n_tokens, n_logits = greedy(native, PROMPTS, 6)
    assert f_tokens == n_tokens
    assert (f_logits - n_logits).abs().max().item() <= 1e-4
    backend = fi.runner.attn_backend  # one plan per batch, one run per layer
    layers = fi.runner.model_config.num_hidden_layers
    assert backend.prefill_wrapper.num_plans == 1 and backend.prefill_wrapper.num_runs == layers
    assert backend.decode_wrapper.num_plans == 6 and backend.decode_wrapper.num_runs == 6 * layers


def test_graph_hooks_with_fake_flashinfer(fake_flashinfer, tiny_dirs, monkeypatch):
    """The CudaGraphRunner's capture/replay hooks without CUDA: each "graph" re-runs the forward
    eagerly on the static buffers; the graph-mode wrappers read the static index buffers."""
    from rollout.cuda_graph_runner import CudaGraphRunner

    monkeypatch.setattr(CudaGraphRunner, "_capture_graphs", eager_graph_capture)
    path = tiny_dirs["Qwen3ForCausalLM"]
    cfg = dict(device="cpu", attention_backend="flashinfer", cuda_graph=False)
    graphed = RunnerDriver(path, cuda_graph_batch_sizes=(1, 2, 4, 8), **cfg)
    graphed.runner.graph_runner = CudaGraphRunner(graphed.runner)
    eager = RunnerDriver(path, **cfg)
    g_tokens, g_logits = greedy(graphed, PROMPTS, 4)  # 5 requests: the graph of 8, padded
    e_tokens, e_logits = greedy(eager, PROMPTS, 4)
    backend = graphed.runner.attn_backend
    assert graphed.runner.graph_runner.num_replays == 4
    assert sorted(backend.graph_wrappers) == [1, 2, 4, 8]
    assert backend.graph_wrappers[8].num_plans == 1 + 4  # capture, then one per replay
    assert backend.graph_wrappers[8].p.kv_indices is backend.graph_bufs[1]
    assert backend.decode_wrapper.num_plans == 0  # no eager decode
    assert g_tokens == e_tokens
    assert (g_logits - e_logits).abs().max().item() <= 1e-5


# ---- GPU, with FlashInfer installed ---------------------------------------------------------------
def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return fib.flashinfer_importable()
    except Exception:
        return False


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not _gpu_ready(),
                                              reason="needs a CUDA GPU and flashinfer")(test))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@gpu
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 2)])  # tensor-core decode, and not
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_bf16_matches_torch_native(mode, heads, kv_heads):
    lens = [1, 300, 77, 513, 64, 129]
    prefix = [n - 1 for n in lens] if mode.is_decode else [0, 100, 0, 500, 63, 1]
    out, expected, _ = backend_outputs(mode, lens, prefix, heads, kv_heads, 128, torch.bfloat16,
                                       "cuda", seed=3)
    assert rel_err(out, expected) <= 1e-2


@gpu
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_metadata_needs_no_host_sync(mode):
    """init_forward_metadata (our kv_indices and FlashInfer's plan) never waits for the GPU."""
    lens = [1, 300, 77, 513]
    prefix = [n - 1 for n in lens] if mode.is_decode else [0, 100, 0, 500]
    *_, backend = backend_outputs(mode, lens, prefix, 8, 2, 128, torch.bfloat16, "cuda")
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing CUDA call raises
    try:
        backend.init_forward_metadata(backend.last_fb)
    finally:
        torch.cuda.set_sync_debug_mode("default")


GPU_PROMPTS = [[1, 5, 9], [42, 7, 300, 12, 8, 99, 3], [256, 17], list(range(60, 75)),
               [5, 6, 7, 8, 9], list(range(100, 160)), [300], list(range(200, 233))]
# Greedy decisions whose top-2 logits are closer than this are bf16 ties: the logits come out
# of a bf16 LM head (exact ties occur) and two attention kernels differ by a few bf16 ulps (a
# CPU proxy measured <= 0.03 on these models, where the median top-2 margin is ~0.19), so
# either token is right and a free-running comparison would diverge there by chance.
TIE = 0.1


@pytest.fixture(scope="module")
def gpu_model_dirs(tmp_path_factory):
    """bf16 tiny models FlashInfer can serve (head_dim 128): 2 query heads per KV head (CUDA-core
    decode) and 4 (tensor-core decode)."""
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    root = tmp_path_factory.mktemp("fi")
    return {group: str(make_tiny_model(root / f"g{group}", TinyModelSpec(
        architecture="Qwen3ForCausalLM", hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=4 // group, head_dim=128, dtype="bfloat16")))
        for group in (2, 4)}


def gpu_driver(path, backend, **cfg) -> RunnerDriver:
    return RunnerDriver(path, device="cuda", dtype="bfloat16", attention_backend=backend, **cfg)


def greedy_against(ref: RunnerDriver, other: RunnerDriver, prompts, steps: int):
    """Both engines decode ref's greedy tokens (teacher forcing keeps the sequences equal).
    Returns ref's and other's greedy choices, ref's top-2 margins ([steps * batch] each) and
    both logits stacks."""
    ref_logits = ref.prefill([list(s) for s in prompts])
    other_logits = other.prefill([list(s) for s in prompts])
    seen_ref, seen_other = [], []
    for _ in range(steps):
        seen_ref.append(ref_logits.float())
        seen_other.append(other_logits.float())
        nxt = ref_logits.argmax(-1).tolist()
        ref_logits, other_logits = ref.decode(nxt), other.decode(nxt)
    r, o = torch.stack(seen_ref).flatten(0, 1), torch.stack(seen_other).flatten(0, 1)
    top2 = r.topk(2, -1).values
    return r.argmax(-1), o.argmax(-1), top2[:, 0] - top2[:, 1], r, o


def assert_same_greedy(ref, other, prompts, steps=16):
    ref_tokens, tokens, margins, ref_logits, logits = greedy_against(ref, other, prompts, steps)
    decided = margins > TIE
    assert decided.float().mean().item() >= 0.5, "too few decisions outside bf16 ties to compare"
    wrong = torch.nonzero(decided & (tokens != ref_tokens)).flatten().tolist()
    assert not wrong, f"greedy tokens differ at decisions {wrong} (step * batch + request)"
    # bf16 logits through two layers differ by ~1% (0.8% on the CPU proxy); a wrong mask, scale
    # or index gives O(1)
    assert rel_err(logits, ref_logits) <= 5e-2


@gpu
@pytest.mark.parametrize("group", [2, 4])
def test_engine_greedy_matches_triton(gpu_model_dirs, group):
    """16 greedy decode steps of 8 ragged prompts: FlashInfer's engine picks Triton's tokens."""
    path = gpu_model_dirs[group]
    fi = gpu_driver(path, "flashinfer", cuda_graph=False)
    assert isinstance(fi.runner.attn_backend, fib.FlashInferBackend)
    assert fi.runner.attn_backend.use_tensor_cores == (group >= 4)
    assert_same_greedy(gpu_driver(path, "triton", cuda_graph=False), fi, GPU_PROMPTS)


@gpu
@pytest.mark.parametrize("group", [2, 4])
def test_cuda_graph_greedy_matches_eager(gpu_model_dirs, group):
    path = gpu_model_dirs[group]
    graphed = gpu_driver(path, "flashinfer", cuda_graph_batch_sizes=(1, 2, 4, 8))
    eager = gpu_driver(path, "flashinfer", cuda_graph=False)
    assert_same_greedy(eager, graphed, GPU_PROMPTS[:5])  # 5 requests: the graph of 8, padded
    assert graphed.runner.graph_runner.num_replays == 16
    assert sorted(graphed.runner.attn_backend.graph_wrappers) == [1, 2, 4, 8]
