"""Spec: rollout/layers/triton_gemv.py's skinny GEMMs equal F.linear (and the unfused
silu(gate) * up after the fused gate/up projection) for 1..BATCH_MAX_M rows.

On CPU the kernels run under the Triton interpreter in fp32 on tiny ragged shapes (N not a
multiple of BLOCK_N, K not a multiple of BLOCK_K), through both kernels (FMA and tensor-core dot),
with and without split-K: within 1e-5 relative of torch. On a GPU (tests marked `gpu`): bf16 on
the Qwen2-1.5B decode shapes with the default launch config, relative error (norm of the
difference over the norm of the reference) <= 1e-2, and inside a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from rollout.layers import gemv_launch, triton_gemv  # noqa: E402
from rollout.layers.triton_gemv import Config, skinny_gate_up_silu, skinny_linear  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402

require_runnable_triton(triton_gemv._gemv_fma_kernel)



def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def ref_gate_up_silu(x, w, inter):
    gate_up = F.linear(x, w)  # rounded to x's dtype, as the unfused path's GEMM output
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


# ---- CPU (interpreter) and GPU: tiny ragged shapes in fp32, every kernel variant --------------
CONFIGS = {  # block_n, block_k, split_k, num_warps, dot
    "fma": Config(8, 32),
    "fma_split": Config(16, 16, 2),
    "dot": Config(16, 32, dot=True),
    "dot_split": Config(16, 16, 3, dot=True),
    # K chunks loaded before the PDL wait: 2 of K 48/64 (1.5-2 chunks of 32: masked tail), all 3
    # of K 96, more than a split's chunks (clipped)
    "fma_preload2": Config(8, 32, preload=2),
    "fma_preload3": Config(8, 32, preload=3),
    "fma_preload3_lookahead": Config(8, 16, preload=3, lookahead=True),
    "fma_split_preload": Config(16, 16, 2, preload=3),
    # the next K chunk loaded before the FMA on this one (none past the split's last chunk)
    "fma_lookahead": Config(8, 16, lookahead=True),
    "fma_split_lookahead": Config(8, 16, 2, preload=2, lookahead=True),
    # the loop after the preloaded chunks as Triton's software pipeline (cp.async when compiled)
    "fma_pipeline": Config(8, 16, preload=2, pipeline=3),
    "fma_split_pipeline": Config(8, 16, 2, pipeline=4),
    # the dot kernel's first K chunks of the weight loaded before the PDL wait (small batches):
    # one, all 3 of K 96 (K 48: clipped to what a split has; masked tail), split along K
    "dot_preload1": Config(16, 32, dot=True, dot_preload=1),
    "dot_preload3": Config(16, 32, dot=True, dot_preload=3),
    "dot_split_preload2": Config(16, 16, 3, dot=True, dot_preload=2),
    # tiles loaded by TMA (zero-filled past the edges: ragged N, and K 48 against chunks of 32)
    "tma": Config(16, 32, dot=True, block_m=16, tma=True),
    "tma_small_tiles": Config(16, 16, dot=True, num_stages=4, block_m=16, tma=True),
    # split along K (the last split's range runs past K: zero-filled), the weight tile on the
    # MMA's M side (out^T = W x^T), both
    "tma_split": Config(16, 16, 3, dot=True, block_m=16, tma=True),
    "tma_swap": Config(16, 32, dot=True, block_m=16, tma=True, swap_ab=True),
    "tma_swap_split": Config(32, 16, 2, dot=True, num_stages=4, block_m=16, tma=True,
                             swap_ab=True),
}
SHAPES = [(24, 64), (40, 48), (72, 96)]  # (N, K): 24/40/72 rows against blocks of 8/16, K 48/96


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES)
def test_skinny_linear_fp32(config, shape):
    n, k = shape
    w, b = rand(n, k, seed=n), rand(n, seed=k)
    for m in (1, 2, 3, 5, 16):
        x = rand(m, k, seed=m)
        for bias in (None, b):
            out = skinny_linear(x, w, bias, config=CONFIGS[config])
            ref = F.linear(x, w, bias)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            assert rel_err(out, ref) <= 1e-5, (m, bias is not None)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES)
def test_skinny_gate_up_silu_fp32(config, shape):
    inter, k = shape
    w = rand(2 * inter, k, seed=inter)
    for m in (1, 3, 16):
        x = rand(m, k, seed=m)
        out = skinny_gate_up_silu(x, w, inter, config=CONFIGS[config])
        ref = ref_gate_up_silu(x, w, inter)
        assert out.shape == ref.shape == (m, inter)
        assert rel_err(out, ref) <= 1e-5, m


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("kernel", ["dot", "tma", "tma_swap"])
def test_decode_batches_tile_m_fp32(block_m, split_k, kernel):
    """Above 16 rows (decode batches) the dot kernels also tile M (ragged last tile), with and
    without split-K, for the plain GEMM (with bias) and the fused gate/up + SiLU."""
    inter, k = 24, 48
    w, b = rand(2 * inter, k, seed=7), rand(2 * inter, seed=8)
    cfg = Config(16, 16, split_k, dot=True, block_m=block_m, tma=kernel != "dot",
                 swap_ab=kernel == "tma_swap")
    for m in (17, 40):
        x = rand(m, k, seed=m)
        out = skinny_gate_up_silu(x, w, inter, config=cfg)
        assert rel_err(out, ref_gate_up_silu(x, w, inter)) <= 1e-5, m
        assert rel_err(skinny_linear(x, w, b, config=cfg), F.linear(x, w, b)) <= 1e-5, m
    with pytest.raises(ValueError, match="rows"):
        skinny_gate_up_silu(rand(triton_gemv.BATCH_MAX_M + 1, k), w, inter)


def test_default_config_and_strided_rows():
    """The heuristic's config (no override) on a ragged shape; x rows with a stride > K."""
    w, b = rand(40, 48, seed=1), rand(40, seed=2)
    for m in (1, 4):
        x = rand(m, 64, seed=m)[:, 8:56]
        assert rel_err(skinny_linear(x, w, b), F.linear(x, w, b)) <= 1e-5


def test_config_heuristic_is_sane():
    for m in range(1, triton_gemv.MAX_M + 1):
        for n, k, gated in [(2048, 1536, False), (1536, 8960, False), (17920, 1536, True),
                            (151936, 1536, False), (40, 48, False), (24, 20, True)]:
            c = triton_gemv._config(m, n, k, gated)
            assert c == triton_gemv._config(m, n, k, gated)  # deterministic
            assert c.block_n & (c.block_n - 1) == 0 and c.block_k & (c.block_k - 1) == 0
            assert 1 <= c.split_k <= triton_gemv.MAX_SPLIT_K
            if c.dot:
                assert c.block_n >= 16 and c.block_k >= 16


# The one-row entries where a sweep found better than the pattern the others share
SWEPT_ONE_ROW = {(1, 2048, 1536, False), (1, 4096, 2048, False)}  # both models' qkv


def test_one_row_rule_is_the_tables_pattern():
    """Every measured one-row entry but the swept qkv ones is what the rule gives its shape:
    the rule for unlisted shapes is the design measured on the two tuned models."""
    entries = {key: cfg for key, cfg in triton_gemv._TUNED.items() if key[0] == 1}
    assert len(entries) >= 10 and SWEPT_ONE_ROW <= set(entries)
    for (m, n, k, gated), cfg in entries.items():
        if (m, n, k, gated) not in SWEPT_ONE_ROW:
            assert gemv_launch.one_row_rule(n, k, gated) == cfg, (n, k, gated)


def test_one_row_rule_serves_unlisted_shapes(monkeypatch):
    """An unlisted one-row shape takes the rule (the legacy heuristic with
    ROLLOUT_ONE_ROW_RULES=0); the projections of a 7-8B model each get their kind's config."""
    launch = gemv_launch
    qwen3_8b = {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
                "gate_up": (24576, 4096, True), "down": (4096, 12288, False),
                "lm_head": (151936, 4096, False)}
    got = {name: triton_gemv._config(1, n, k, g) for name, (n, k, g) in qwen3_8b.items()}
    assert got["gate_up"].preload == 2 and got["gate_up"].lookahead
    assert got["lm_head"].block_n == 8 and got["lm_head"].pipeline == 3
    assert got["down"].block_k == 1024 and got["down"].split_k == 1 and got["down"].preload == 3
    assert got["qkv"] == got["o"] and got["o"].block_n == 2 and got["o"].lookahead
    assert launch.one_row_rule(1536, 8960).split_k == 2  # few row pairs: split (Qwen2's 768)
    assert launch.one_row_rule(3584, 18944).block_k == 512  # K no multiple of 1,024
    monkeypatch.setattr(launch, "ONE_ROW_RULES", "0")
    legacy = triton_gemv._config(1, 4096, 4096)
    assert legacy != got["o"] and legacy.preload == 1 and legacy.block_n >= 4


@pytest.mark.parametrize("shape", [(48, 1024, True), (32768, 64, False), (64, 8192, False),
                                   (64, 4608, False), (2048, 2560, False)])
def test_one_row_rule_configs_compute_the_gemm(shape):
    """Each kind's rule config (its split K, masked last chunk, lookahead, pipelined loop)
    computes F.linear (silu(gate) · up when gated) on a weight of 40 rows (or 48 gate/up
    rows): a config holds for any row count."""
    n, k, gated = shape
    cfg = gemv_launch.one_row_rule(n, k, gated)
    x = rand(1, k, seed=k)
    if gated:
        w = rand(48, k, seed=n) * k ** -0.5
        assert rel_err(skinny_gate_up_silu(x, w, 24, cfg), ref_gate_up_silu(x, w, 24)) <= 1e-5
    else:
        w, b = rand(40, k, seed=n) * k ** -0.5, rand(40, seed=k)
        assert rel_err(skinny_linear(x, w, b, cfg), F.linear(x, w, b)) <= 1e-5, cfg


def test_bad_inputs_are_refused():
    w = rand(24, 48)
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(rand(triton_gemv.BATCH_MAX_M + 1, 48), w)
    with pytest.raises(ValueError, match="16-byte aligned"):  # TMA: rows 28 bytes apart
        skinny_linear(rand(4, 7)[:, 1:], rand(8, 6), config=Config(16, 16, dot=True, tma=True))
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(rand(2, 32), w)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(rand(2, 48), w, rand(23))
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(rand(2, 48), rand(48, 24).t())
    with pytest.raises(ValueError, match="2·"):
        skinny_gate_up_silu(rand(2, 48), w, 10)
    for preload in (0, 4):
        with pytest.raises(ValueError, match="preload"):
            skinny_linear(rand(1, 48), w, config=Config(8, 16, preload=preload))
    with pytest.raises(ValueError, match="dot_preload"):
        skinny_linear(rand(2, 48), w, config=Config(16, 16, dot=True, dot_preload=4))
    assert not triton_gemv.supports(rand(2, 48).cpu(), w.cpu())  # CUDA only


# ---- GPU: bf16 on the Qwen2-1.5B decode shapes, default configs, in a CUDA graph ---------------
QWEN2_1_5B = {"qkv": (2048, 1536, True), "o": (1536, 1536, False),
              "down": (1536, 8960, False), "lm_head": (151936, 1536, False)}
GPU_ROWS = [1, 2, 3, 4, 7, 8, 16]


@gpu
@pytest.mark.parametrize("name", list(QWEN2_1_5B))
def test_gpu_bf16_qwen2_shapes(name):
    n, k, has_bias = QWEN2_1_5B[name]
    w = rand(n, k, dtype=torch.bfloat16, seed=1) * k ** -0.5
    b = rand(n, dtype=torch.bfloat16, seed=2) if has_bias else None
    for m in GPU_ROWS:
        x = rand(m, k, dtype=torch.bfloat16, seed=m)
        # an entry saying cuBLAS (None) keeps those rows off the kernels; skinny_linear itself
        # runs any row count (the heuristic config where the table has none)
        entry = triton_gemv._TUNED.get((triton.next_power_of_2(m), n, k, False), "none")
        assert triton_gemv.supports(x, w) == (entry is not None), m
        out = skinny_linear(x, w, b)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        assert rel_err(out, F.linear(x, w, b)) <= 1e-2, m


def test_lookahead_changes_no_bit():
    """Loading the next chunk early moves loads, not sums: the same bits as without."""
    w, b = rand(40, 96, seed=3), rand(40, seed=4)
    for m in (1, 5):
        x = rand(m, 96, seed=m)
        for cfg in (Config(8, 16), Config(8, 16, 2), Config(8, 32, preload=2)):
            assert torch.equal(skinny_linear(x, w, b, config=cfg._replace(lookahead=True)),
                               skinny_linear(x, w, b, config=cfg)), cfg
            assert torch.equal(
                skinny_gate_up_silu(x, w, 20, config=cfg._replace(lookahead=True)),
                skinny_gate_up_silu(x, w, 20, config=cfg)), cfg


def test_pipeline_changes_no_bit():
    """The loop as a software pipeline moves loads, not sums: the same bits as the lookahead
    loop and the plain one (compiled where a GPU runs this file: cp.async stages), and a config
    asking for both is refused."""
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    w, b = rand(40, 200, dtype=dtype, seed=3), rand(40, dtype=dtype, seed=4)
    for m in (1, 3):
        x = rand(m, 200, dtype=dtype, seed=m)
        for cfg in (Config(8, 32), Config(8, 32, 2, preload=2), Config(4, 16, preload=3)):
            plain = skinny_linear(x, w, b, config=cfg)
            assert torch.equal(skinny_linear(x, w, b, config=cfg._replace(lookahead=True)), plain)
            for stages in (2, 4):
                assert torch.equal(skinny_linear(x, w, b, config=cfg._replace(pipeline=stages)),
                                   plain), (cfg, stages)
                assert torch.equal(
                    skinny_gate_up_silu(x, w, 20, config=cfg._replace(pipeline=stages)),
                    skinny_gate_up_silu(x, w, 20, config=cfg)), (cfg, stages)
    with pytest.raises(ValueError, match="lookahead or pipeline"):
        skinny_linear(x, w, b, config=Config(8, 32, lookahead=True, pipeline=3))


@gpu
@pytest.mark.parametrize("preload", [2, 3])
def test_gpu_preload_changes_no_bit(preload):
    """Loading more weight chunks before the PDL wait, or the next chunk before the FMA on this
    one, moves loads, not sums: the same bits."""
    x = rand(1, 1536, dtype=torch.bfloat16, seed=5)
    gate_up = rand(17920, 1536, dtype=torch.bfloat16, seed=3) * 1536 ** -0.5
    cfg = triton_gemv._config(1, 17920, 1536, True)
    assert torch.equal(skinny_gate_up_silu(x, gate_up, 8960, cfg._replace(preload=preload)),
                       skinny_gate_up_silu(x, gate_up, 8960, cfg))
    assert torch.equal(skinny_gate_up_silu(x, gate_up, 8960, cfg._replace(lookahead=True)),
                       skinny_gate_up_silu(x, gate_up, 8960, cfg))
    for name in ("qkv", "o", "down"):
        n, k, _ = QWEN2_1_5B[name]
        w = rand(n, k, dtype=torch.bfloat16, seed=1) * k ** -0.5
        x = rand(1, k, dtype=torch.bfloat16, seed=5)
        cfg = triton_gemv._config(1, n, k)
        assert torch.equal(skinny_linear(x, w, config=cfg._replace(preload=preload)),
                           skinny_linear(x, w, config=cfg)), name
        assert torch.equal(skinny_linear(x, w, config=cfg._replace(lookahead=True)),
                           skinny_linear(x, w, config=cfg)), name
        assert torch.equal(skinny_linear(x, w, config=cfg._replace(lookahead=False, pipeline=4)),
                           skinny_linear(x, w, config=cfg)), name


@gpu
def test_gpu_bf16_gate_up_silu():
    inter, k = 8960, 1536
    w = rand(2 * inter, k, dtype=torch.bfloat16, seed=3) * k ** -0.5
    for m in GPU_ROWS:
        x = rand(m, k, dtype=torch.bfloat16, seed=m)
        assert rel_err(skinny_gate_up_silu(x, w, inter), ref_gate_up_silu(x, w, inter)) <= 1e-2, m


@gpu
def test_gpu_bf16_gate_up_silu_batches():
    inter, k = 8960, 1536
    w = rand(2 * inter, k, dtype=torch.bfloat16, seed=3) * k ** -0.5
    for m in (32, 48, 128, 256):
        x = rand(m, k, dtype=torch.bfloat16, seed=m)
        assert rel_err(skinny_gate_up_silu(x, w, inter), ref_gate_up_silu(x, w, inter)) <= 1e-2, m


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype):
    w, b = rand(1536, 1536, dtype=dtype, seed=4) * 0.03, rand(1536, dtype=dtype, seed=5)
    for m in (1, 5, 16):
        x = rand(m, 1536, dtype=dtype, seed=m)
        bound = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: IEEE products, not TF32
        assert rel_err(skinny_linear(x, w, b), F.linear(x, w, b)) <= bound


@gpu
def test_gpu_cuda_graph_replay():
    w = rand(1536, 8960, dtype=torch.bfloat16, seed=6) * 0.01
    wg = rand(2 * 8960, 1536, dtype=torch.bfloat16, seed=7) * 0.03
    for m in (1, 8, 16):
        x = rand(m, 8960, dtype=torch.bfloat16, seed=m)
        xg = rand(m, 1536, dtype=torch.bfloat16, seed=m)
        skinny_linear(x, w), skinny_gate_up_silu(xg, wg, 8960)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, out_g = skinny_linear(x, w), skinny_gate_up_silu(xg, wg, 8960)
        x.copy_(rand(m, 8960, dtype=torch.bfloat16, seed=100 + m))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, skinny_linear(x, w))  # deterministic (split-K sums in order)
        assert torch.equal(out_g, skinny_gate_up_silu(xg, wg, 8960))


@gpu
def test_gpu_small_batches_take_the_kernels_only_where_tuned():
    """The engine's policy (`linear.use_skinny`): one row always (the heuristic config for
    shapes the table does not list), 2-16 rows only where the table names a kernel."""
    from rollout.layers.linear import use_skinny
    qkv = rand(2048, 1536, dtype=torch.bfloat16)
    other = rand(1000, 1536, dtype=torch.bfloat16)  # no entry at any row count
    row = lambda m: rand(m, 1536, dtype=torch.bfloat16)  # noqa: E731
    assert use_skinny(row(1), qkv) and use_skinny(row(1), other)
    assert use_skinny(row(2), qkv) and use_skinny(row(3), qkv) and use_skinny(row(16), qkv)
    assert not use_skinny(row(8), qkv)  # the table says cuBLAS at 5-8 rows
    assert not use_skinny(row(2), other) and not use_skinny(row(16), other)


@gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_small_batch_entries(gated):
    """The table's 2-16 row entries (small decode batches) on the Qwen2-1.5B shapes: within bf16
    rounding of cuBLAS, and the dot kernel's weight preload (`dot_preload`) moves loads, not
    sums: the same bits without it."""
    shapes = {(2 * 8960, 1536)} if gated else {(n, k) for n, k, _ in QWEN2_1_5B.values()}
    tried = 0
    for (m, n, k, g), cfg in triton_gemv._TUNED.items():
        if not (2 <= m <= 16 and g == gated and (n, k) in shapes and cfg is not None):
            continue
        w = rand(n, k, dtype=torch.bfloat16, seed=n) * k ** -0.5
        for rows in (m // 2 + 1, m):
            x = rand(rows, k, dtype=torch.bfloat16, seed=rows)
            if gated:
                out, ref = skinny_gate_up_silu(x, w, n // 2, cfg), ref_gate_up_silu(x, w, n // 2)
                plain = skinny_gate_up_silu(x, w, n // 2, cfg._replace(dot_preload=0))
            else:
                out, ref = skinny_linear(x, w, config=cfg), F.linear(x, w)
                plain = skinny_linear(x, w, config=cfg._replace(dot_preload=0))
            assert rel_err(out, ref) <= 1e-2, (m, n, rows)
            assert torch.equal(out, plain), (m, n, rows)
            tried += 1
    assert tried >= 2


@gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_one_row_entries(gated):
    """Every one-row entry of the table (Qwen2-1.5B's and Qwen3-1.7B's shapes, the LM heads
    included): within bf16 rounding of cuBLAS (+ SiLU when gated)."""
    tried = 0
    for (m, n, k, g), cfg in triton_gemv._TUNED.items():
        if not (m == 1 and g == gated and cfg is not None):
            continue
        w = rand(n, k, dtype=torch.bfloat16, seed=n + k) * k ** -0.5
        x = rand(1, k, dtype=torch.bfloat16, seed=k)
        if gated:
            out, ref = skinny_gate_up_silu(x, w, n // 2, cfg), ref_gate_up_silu(x, w, n // 2)
        else:
            out, ref = skinny_linear(x, w, config=cfg), F.linear(x, w)
        assert rel_err(out, ref) <= 1e-2, (n, k, cfg)
        tried += 1
    assert tried >= (2 if gated else 8)


# Dense models the table does not list: (N, K, gated) of qkv, o, gate/up, down, the LM head
UNLISTED_MODELS = {
    "qwen3-4b": [(6144, 2560, False), (2560, 4096, False), (19456, 2560, True),
                 (2560, 9728, False), (151936, 2560, False)],
    "qwen3-8b": [(6144, 4096, False), (4096, 4096, False), (24576, 4096, True),
                 (4096, 12288, False), (151936, 4096, False)],
    "qwen2.5-7b": [(4608, 3584, False), (3584, 3584, False), (37888, 3584, True),
                   (3584, 18944, False), (152064, 3584, False)],
}


@gpu
@pytest.mark.parametrize("model", list(UNLISTED_MODELS))
def test_gpu_one_row_rule_at_unlisted_models(model):
    """The one-row rule's config for every projection of a 4-8B model the table does not list,
    compiled: within bf16 rounding of cuBLAS (+ SiLU when gated)."""
    for n, k, gated in UNLISTED_MODELS[model]:
        assert (1, n, k, gated) not in triton_gemv._TUNED
        cfg = triton_gemv._config(1, n, k, gated)
        assert cfg == gemv_launch.one_row_rule(n, k, gated)
        w = rand(n, k, dtype=torch.bfloat16, seed=n + k) * k ** -0.5
        x = rand(1, k, dtype=torch.bfloat16, seed=k)
        if gated:
            out, ref = skinny_gate_up_silu(x, w, n // 2), ref_gate_up_silu(x, w, n // 2)
        else:
            out, ref = skinny_linear(x, w), F.linear(x, w)
        assert rel_err(out, ref) <= 1e-2, (model, n, k, cfg)
        del w


@gpu
@pytest.mark.parametrize("model", ["qwen3-4b", "qwen2.5-7b"])
def test_gpu_one_row_logits_with_the_rule_equal_cublas(tmp_path, monkeypatch, model):
    """Two layers of a 4-8B model the table does not list, random bf16 weights (a peaked LM
    head): the one-row decode logits through the rule's GEMVs, eager and from the decode CUDA
    graph, within bf16 rounding of those with every GEMM on cuBLAS (ROLLOUT_SKINNY_GEMM=0;
    relative error of the whole row), same argmax."""
    from benchmarks.decode_throughput import SHAPES
    from rollout.layers import linear as linear_mod
    from rollout.tiny_model import make_tiny_model
    from tests.test_split_sum import decode_logits
    import dataclasses
    spec = dataclasses.replace(SHAPES[model], num_hidden_layers=2, embed_std=0.5)  # peaked
    path = str(make_tiny_model(tmp_path / "m", spec, with_tokenizer=False))
    for graph in (False, True):
        rule = decode_logits(path, 1, graph)
        monkeypatch.setattr(linear_mod, "SKINNY_GEMM", False)
        cublas = decode_logits(path, 1, graph)
        monkeypatch.setattr(linear_mod, "SKINNY_GEMM", True)
        err = rel_err(rule, cublas)
        print(f"{model} graph={graph}: rel. err {err:.2e}, logits std {cublas.float().std():.1f}")
        assert err <= 1e-2, graph  # logits of std ~30: an ulp is 0.125-1
        assert rule.argmax(-1).equal(cublas.argmax(-1)), graph


@gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_decode_batch_entries(gated):
    """Every entry of the table for decode batches (17-256 rows; Qwen2-1.5B's and Qwen3-1.7B's
    shapes): within bf16 rounding of cuBLAS (+ SiLU when gated), at the rows the entry serves
    from and to."""
    tried = 0
    for (m, n, k, g), cfg in triton_gemv._TUNED.items():
        if not (m > 16 and g == gated and cfg is not None):
            continue
        w = rand(n, k, dtype=torch.bfloat16, seed=n + k) * k ** -0.5
        for rows in (m // 2 + 1, m):
            x = rand(rows, k, dtype=torch.bfloat16, seed=rows)
            if gated:
                out, ref = skinny_gate_up_silu(x, w, n // 2, cfg), ref_gate_up_silu(x, w, n // 2)
            else:
                out, ref = skinny_linear(x, w, config=cfg), F.linear(x, w)
            assert rel_err(out, ref) <= 1e-2, (m, n, k, rows)
            tried += 1
    assert tried >= (4 if gated else 20)


@gpu
@pytest.mark.parametrize("name", ["qkv", "o", "down"])
def test_gpu_bf16_decode_batches(name):
    """Decode batches on the M-tiled kernel, with the tuned config where there is one."""
    n, k, has_bias = QWEN2_1_5B[name]
    w = rand(n, k, dtype=torch.bfloat16, seed=1) * k ** -0.5
    b = rand(n, dtype=torch.bfloat16, seed=2) if has_bias else None
    for m in (17, 32, 100, 128, 256):
        x = rand(m, k, dtype=torch.bfloat16, seed=m)
        assert rel_err(skinny_linear(x, w, b), F.linear(x, w, b)) <= 1e-2, m


@gpu
def test_gpu_tma_entries_in_a_graph_and_unaligned_rows():
    """The table's TMA entries for qkv and o (17-128 rows) and down split along K (17-64 rows)
    — where the table names the Gluon GEMM, the TMA entries it replaced, which GPUs without it
    take — replay in a CUDA graph bit for bit as eager; rows TMA cannot read (not 16-byte
    aligned) are not offered to it. (The TMA gate/up entry, 33-64 rows, is
    test_gpu_bf16_gate_up_silu_batches's 48 rows.)"""
    for name, rows in (("qkv", (24, 64, 128)), ("o", (24, 64, 128)), ("down", (24, 64))):
        n, k, has_bias = QWEN2_1_5B[name]
        w = rand(n, k, dtype=torch.bfloat16, seed=1) * k ** -0.5
        b = rand(n, dtype=torch.bfloat16, seed=2) if has_bias else None
        for m in rows:
            key = (triton.next_power_of_2(m), n, k, False)
            cfg = gemv_launch.GLUON_FALLBACK.get(key, triton_gemv._config(m, n, k))
            assert cfg.tma, (name, m)
            x = rand(m, k, dtype=torch.bfloat16, seed=m)
            eager = skinny_linear(x, w, b, config=cfg)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = skinny_linear(x, w, b, config=cfg)
            graph.replay()
            assert torch.equal(out, eager) and rel_err(eager, F.linear(x, w, b)) <= 1e-2
        unaligned = rand(64, k + 1, dtype=torch.bfloat16)[:, 1:]  # rows 2 * 1537 bytes apart
        assert triton_gemv.supports(rand(64, k, dtype=torch.bfloat16), w)
        assert not triton_gemv.supports(unaligned, w)


@gpu
@pytest.mark.parametrize("prefetch_k", [256, 1536])
def test_gpu_tma_l2_prefetch_changes_no_bit(prefetch_k):
    """The TMA kernel's L2 prefetch of its weight rows before the PDL wait is a hint: every
    table TMA entry (qkv, o, down split along K, the fused gate/up) gives the same bits with it,
    eager and in a CUDA graph."""
    shapes = dict(QWEN2_1_5B, gate_up=(17920, 1536, False))
    for name in ("qkv", "o", "down", "gate_up"):
        n, k, has_bias = shapes[name]
        w = rand(n, k, dtype=torch.bfloat16, seed=1) * k ** -0.5
        b = rand(n, dtype=torch.bfloat16, seed=2) if has_bias else None
        for m in ((64, 128) if name == "gate_up" else (32, 64, 128)):
            gated = name == "gate_up"
            cfg = triton_gemv._config(m, n, k, gated)
            # gate/up and qkv at 128 rows: Gluon entries (test_gluon_gemm.py); the TMA
            # entries they replaced are what other GPUs take
            cfg = gemv_launch.GLUON_FALLBACK.get((m, n, k, gated), cfg)
            assert cfg.tma, (name, m)
            x = rand(m, k, dtype=torch.bfloat16, seed=m)

            def call(c):
                if gated:
                    return skinny_gate_up_silu(x, w, n // 2, config=c)
                return skinny_linear(x, w, b, config=c)
            ref = call(cfg)
            with_prefetch = cfg._replace(prefetch_k=prefetch_k)
            assert torch.equal(call(with_prefetch), ref), (name, m)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call(with_prefetch)
            graph.replay()
            assert torch.equal(out, ref), (name, m)


def test_tma_entries_need_a_gpu_with_tma(monkeypatch):
    """The table's TMA entries were measured on an H200: a GPU older than compute capability 9.0
    (no TMA) is not offered them (cuBLAS instead)."""
    capability = {0: (8, 0), 1: (9, 0)}  # an A100, an H100
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    triton_gemv._has_tma.cache_clear()
    try:
        assert not triton_gemv._has_tma(0) and triton_gemv._has_tma(1)
    finally:
        triton_gemv._has_tma.cache_clear()
