"""Spec: rollout/layers/fused_layer's one-kernel decode layer equals the layer written in torch
(residual add, RMSNorm, qkv + bias, rotate-half rope, attention over the cached keys plus the
new one, o + residual, RMSNorm, SiLU gate, down) for one request, and stores the new key and
value into the cache slot.

On CPU the kernel runs under the Triton interpreter, phase by phase, in fp32 on tiny ragged
shapes (hidden not a power of two, rows not a multiple of the programs or the tiles, K not a
multiple of the K chunk), with sequences that leave KV splits empty, several grids: within 1e-5
relative of torch. On a GPU (marked `gpu`): the persistent kernel with its grid barriers, bf16 on
the Qwen2-1.5B layer shape, relative error <= 1e-2, and inside a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout.layers import fused_layer  # noqa: E402
from rollout.layers.fused_layer import FusedDecodeLayers, FusedLayerConfig, LayerShape  # noqa: E402
from rollout.layers.fused_layer_kernel import fused_layer_kernel  # noqa: E402
from rollout.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402

require_runnable_triton(fused_layer_kernel)

EPS = 1e-6


class Case:
    """One layer's random weights, a request's cached keys, and the step's inputs."""

    def __init__(self, shape: LayerShape, seq_len: int, dtype=torch.float32, bias=True, seed=0,
                 slots=64):
        gen = torch.Generator().manual_seed(seed)

        def rnd(*s, scale=0.2 * (48 / shape.hidden) ** 0.5):  # sums of O(1): softmax not one-hot
            return (torch.randn(*s, generator=gen) * scale).to(device=DEV, dtype=dtype)
        hid, d = shape.hidden, shape.head_dim
        self.shape, self.seq_len, self.dtype = shape, seq_len, dtype
        self.weights = (1 + rnd(hid), rnd(shape.qkv_rows, hid), rnd(shape.qkv_rows) if bias else None,
                        rnd(hid, shape.heads * d), 1 + rnd(hid), rnd(2 * shape.inter, hid),
                        rnd(hid, shape.inter))
        self.h, self.residual = rnd(1, hid, scale=1.0), rnd(1, hid, scale=1.0)
        self.k_buf, self.v_buf = rnd(slots, shape.kv_heads, d, scale=1.0), rnd(slots, shape.kv_heads, d, scale=1.0)
        perm = torch.randperm(slots, generator=gen)
        self.req_to_token = torch.zeros(3, slots + 5, dtype=torch.int32, device=DEV)
        self.req_to_token[1, :seq_len] = perm[:seq_len].to(DEV, torch.int32)  # request row 1
        self.loc = self.req_to_token[1, seq_len - 1:seq_len].to(torch.int64)
        self.req_pool_indices = torch.tensor([1], device=DEV)
        self.seq_lens = torch.tensor([seq_len], device=DEV)
        rope = RotaryEmbedding(d, 512, 10000.0).to(DEV)
        self.cos, self.sin = rope.lookup(torch.tensor([seq_len - 1], device=DEV), dtype)
        self.scaling = d ** -0.5

    def reference(self, has_residual: bool):
        """(h_out, residual_out, k_new, v_new) in torch, as the unfused layer computes them."""
        s = self.shape
        n1, qkv_w, qkv_b, o_w, n2, gu_w, down_w = self.weights
        r1 = self.h + self.residual if has_residual else self.h
        qkv = F.linear(rms(r1, n1), qkv_w, qkv_b)
        q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim,
                             s.kv_heads * s.head_dim], dim=-1)
        q = apply_rotary(q.view(1, s.heads, s.head_dim), self.cos, self.sin)
        k = apply_rotary(k.view(1, s.kv_heads, s.head_dim), self.cos, self.sin)
        v = v.view(1, s.kv_heads, s.head_dim)
        slots = self.req_to_token[1, :self.seq_len - 1].long()
        keys = torch.cat((self.k_buf[slots], k), 0).float()  # [seq, kv_heads, d]
        vals = torch.cat((self.v_buf[slots], v), 0).float()
        group = s.heads // s.kv_heads
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        scores = torch.einsum("hd,shd->hs", q[0].float(), keys) * self.scaling
        att = torch.einsum("hs,shd->hd", scores.softmax(-1), vals).to(self.dtype)
        r2 = F.linear(att.reshape(1, -1), o_w) + r1
        gate, up = F.linear(rms(r2, n2), gu_w).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down_w), r2, k[0], v[0]

    def run(self, config: FusedLayerConfig, has_residual: bool):
        owner = FusedDecodeLayers(self.shape, EPS, 1, config)
        s = owner.scratch_for(self.h)
        s.residual.copy_(self.residual)
        s.counters.zero_()
        fused_layer.launch_layer(owner, s, self.weights, self.h, has_residual, 0,
                                 (self.cos, self.sin), self.k_buf, self.v_buf, self.loc,
                                 self.req_to_token, self.req_pool_indices, self.seq_lens,
                                 self.scaling)
        return s.h, s.residual


def rms(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(case: Case, config: FusedLayerConfig, has_residual=True, tol=1e-5):
    h_ref, r_ref, k_ref, v_ref = case.reference(has_residual)
    h, residual = case.run(config, has_residual)
    assert rel_err(residual, r_ref) <= tol
    assert rel_err(h, h_ref) <= tol
    slot = case.loc.item()
    assert rel_err(case.k_buf[slot], k_ref) <= tol
    assert rel_err(case.v_buf[slot], v_ref) <= tol


# ---- CPU (interpreter, one launch a phase) and GPU: tiny ragged shapes in fp32 ----------------
TINY = LayerShape(hidden=48, heads=4, kv_heads=2, head_dim=16, inter=40)
TINY_CONFIG = FusedLayerConfig(programs=5, block_k=16, block_n=4, block_keys=16, num_splits=4,
                               programs_per_sm=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("seq_len", [1, 3, 23])
def test_tiny_layer_matches_torch(seq_len):
    # seq 1: the new token alone; 3: splits of one key, the last one empty; 23: several key
    # blocks in a split
    check(Case(TINY, seq_len), TINY_CONFIG)


def test_first_layer_without_residual_and_bias():
    check(Case(TINY, 9, bias=False, seed=1), TINY_CONFIG, has_residual=False)


@pytest.mark.parametrize("config", [
    FusedLayerConfig(programs=1, block_k=32, block_n=8, block_keys=16, num_splits=2),
    FusedLayerConfig(programs=13, block_k=16, block_n=2, block_keys=16, num_splits=8),
    FusedLayerConfig(programs=3, block_k=16, block_n=4, block_keys=16, num_splits=4, num_stages=1),
])
def test_grids_and_tiles(config):
    # one program does everything; more programs than some phases have rows (empty ranges);
    # the unpipelined stream (registers, next tile issued ahead)
    check(Case(TINY, 17, seed=2), config)


def test_gqa_group_of_one_and_wide_heads():
    shape = LayerShape(hidden=32, heads=2, kv_heads=2, head_dim=32, inter=24)
    check(Case(shape, 6, seed=3), TINY_CONFIG)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="power of two"):
        FusedLayerConfig(block_k=48)
    with pytest.raises(ValueError, match="block_keys"):
        FusedLayerConfig(block_keys=8)
    with pytest.raises(ValueError, match=">= 1"):
        FusedLayerConfig(programs=0)


# ---- GPU: the persistent kernel, bf16, Qwen2-1.5B layer shape ----------------------------------
QWEN2_15B = LayerShape(hidden=1536, heads=12, kv_heads=2, head_dim=128, inter=8960)


@gpu
@pytest.mark.parametrize("seq_len", [1, 100, 257])
def test_gpu_qwen2_layer_bf16(seq_len):
    check(Case(QWEN2_15B, seq_len, dtype=torch.bfloat16, slots=512), FusedLayerConfig(),
          tol=1e-2)


@gpu
def test_gpu_layer_in_cuda_graph():
    case = Case(QWEN2_15B, 50, dtype=torch.bfloat16, slots=512)
    config = FusedLayerConfig()
    eager_h, eager_r = (t.clone() for t in case.run(config, True))
    owner = FusedDecodeLayers(case.shape, EPS, 1, config)
    s = owner.scratch_for(case.h)

    def step():
        s.residual.copy_(case.residual)
        s.counters.zero_()
        fused_layer.launch_layer(owner, s, case.weights, case.h, True, 0, (case.cos, case.sin),
                                 case.k_buf, case.v_buf, case.loc, case.req_to_token,
                                 case.req_pool_indices, case.seq_lens, case.scaling)
    step()  # compiles outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        s.h.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(s.h, eager_h) and torch.equal(s.residual, eager_r)


# ---- the engine: one-request decode through the fused layers -----------------------------------
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_engine_one_request_fused_matches_layer_by_layer(tiny_dirs, monkeypatch, arch):
    """The model's wiring (weights, rope tables, KV metadata, final norm): greedy decode of one
    request through the fused layers against the Triton backend layer by layer (CPU: the
    interpreter, fp32; GPU: CUDA graphs of batch 1, fp32)."""
    from tests.test_triton_kernels import greedy
    from tests.helpers import RunnerDriver
    path = tiny_dirs[arch]
    cfg = dict(device=DEV.type, attention_backend="triton")
    if DEV.type == "cuda":
        cfg["cuda_graph_batch_sizes"] = (1, 2)
    else:
        cfg["cuda_graph"] = False
    monkeypatch.setenv("ROLLOUT_FUSED_LAYER", "1")
    fused = RunnerDriver(path, **cfg)
    f_tokens, f_logits = greedy(fused, [[3, 14, 15, 92, 65, 35]], 6)
    assert fused.runner.model.model.__dict__.get("_fused") is not None  # the path was taken
    monkeypatch.setenv("ROLLOUT_FUSED_LAYER", "0")
    plain = RunnerDriver(path, **cfg)
    p_tokens, p_logits = greedy(plain, [[3, 14, 15, 92, 65, 35]], 6)
    assert plain.runner.model.model.__dict__.get("_fused") is None
    assert f_tokens == p_tokens
    assert (f_logits - p_logits).abs().max().item() <= 1e-4


def test_config_from_a_spec():
    assert FusedLayerConfig.parse("programs_per_sm=1, num_warps=8") == FusedLayerConfig(
        programs_per_sm=1, num_warps=8)
    with pytest.raises(ValueError, match="name=int"):
        FusedLayerConfig.parse("warps=8")
    with pytest.raises(ValueError, match="power of two"):
        FusedLayerConfig.parse("block_k=100")
