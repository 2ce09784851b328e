"""Spec: the warp-specialized Gluon GEMM (rollout/layers/gluon_gemm.py), the table's entry for
Qwen2-1.5B's gate/up + SiLU and its qkv, o and down (split along K) at 65-128 rows, qkv, o and
down at 17-64 rows and gate/up at 33-64, on a Hopper GPU.

Gluon has no interpreter, so on CPU the spec covers what can run there: the table names the
kernel and the entry it replaced (what other GPUs take), the tile widths it refuses, and the
kernel compiled for sm_90 (a stub driver naming an H200, in a child process), gate and up in
one wgmma, waiting for the PDL predecessor in
both its partitions exactly when PDL is on. On the H200 (`gpu`): against cuBLAS + silu_and_mul
(relative error <= 1e-2, METHOD.md) at 65, 100 and 128 rows, on ragged shapes (output columns
past the last tile, K past the last chunk), and every tiling and PDL variant the config offers
gives the same bits eagerly and in a CUDA graph. (The model-level specs with its shapes run it
too: test_triton_pdl's decode logits at 128 rows under every trigger policy.)"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout.layers import gemv_launch, triton_gemv  # noqa: E402
from rollout.layers.triton_gemv import Config, skinny_gate_up_silu  # noqa: E402
from tests.helpers import gpu  # noqa: E402

KEY = (128, 17920, 1536, True)  # Qwen2-1.5B's gate/up at 65-128 rows
QKV_KEY = (128, 2048, 1536, False)  # its qkv
DOWN_KEY = (128, 1536, 8960, False)  # its down
O_KEY = (128, 1536, 1536, False)  # its o
# down at 128 rows split along K: 12 tiles of 128 weight rows x 11 K ranges = 132 programs
DOWN = Config(128, 64, 11, 8, True, 6, 128, preload=3, gluon=True)


def _gluon():
    try:
        from rollout.layers import gluon_gemm
    except ImportError:
        pytest.skip("this Triton has no Gluon Hopper module")
    return gluon_gemm


# (weight rows a program, K split, x rows a program) of the Gluon entries, by key
GLUON_ENTRIES = {KEY: (72, 1, 128), QKV_KEY: (64, 3, 128), DOWN_KEY: (64, 5, 128),
                 O_KEY: (64, 4, 128),
                 # 17-64 rows (forty-eighth session): one consumer warpgroup's 64 x rows
                 (32, 2048, 1536, False): (64, 3, 64), (64, 2048, 1536, False): (64, 3, 64),
                 (32, 1536, 1536, False): (64, 4, 64), (64, 1536, 1536, False): (64, 4, 64),
                 (32, 1536, 8960, False): (128, 7, 64), (64, 1536, 8960, False): (64, 5, 64),
                 # gate/up at 33-64 rows (forty-ninth session)
                 (64, 17920, 1536, True): (72, 1, 64)}


@pytest.mark.parametrize("key", list(GLUON_ENTRIES))
def test_table_names_the_gluon_kernel_and_its_fallback(key):
    """The gate/up, qkv, down and o entries at 65-128 rows, qkv's, o's and down's at 17-64 and
    gate/up's at 33-64 are the Gluon kernel (the plain projections split along K: qkv's bias
    needs it, down's and o's partials are summed by the add + norm after them); a GPU that
    cannot run it (here: no GPU) gets the TMA entry it replaced."""
    cfg = gemv_launch._TUNED[key]
    assert cfg.gluon and not cfg.tma
    assert (cfg.block_n, cfg.split_k, cfg.block_m) == GLUON_ENTRIES[key]
    for rows in (key[0] // 2 + 1, (3 * key[0]) // 4, key[0]):
        assert gemv_launch._config(rows, *key[1:]) == cfg
    fallback = gemv_launch.GLUON_FALLBACK[key]
    assert fallback.tma and not fallback.gluon
    x = torch.zeros(100, 1536, dtype=torch.bfloat16)
    assert triton_gemv._runnable(cfg, key, x) == fallback
    assert triton_gemv._runnable(fallback, KEY, x) == fallback  # other entries pass through


def test_tile_rows_are_a_power_of_two_and_extra_rows():
    g = _gluon()
    for block_n, tile in ((64, (64, 0)), (72, (64, 8)), (80, (64, 16)), (96, (64, 32)),
                          (128, (128, 0)), (192, (128, 64))):
        assert g.tile_rows(Config(block_n, 64, gluon=True)) == tile
    for block_n in (32, 60, 68, 100, 512):
        with pytest.raises(ValueError, match="block_n"):
            g.tile_rows(Config(block_n, 64, gluon=True))


def test_launch_args_refuse_what_the_kernel_cannot_run_and_clamp_the_preload():
    """Refused before any launch: a K split leaving its last ranges empty (o's K = 1,536 in 11
    ranges of 192 columns: 8 cover it), a bias unsplit (the epilogue has none), a split gated
    GEMM. The preloaded chunks never exceed the shortest K range (split 5: four ranges of 320
    columns and one of 256, 4 chunks), as the producer issues them unconditionally."""
    g = _gluon()
    x = torch.empty(128, 1536, dtype=torch.bfloat16)
    w = torch.empty(1536, 1536, dtype=torch.bfloat16)
    y = torch.empty(128, 1536, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="empty K range"):
        g._launch_args(x, w, y, False, DOWN)
    with pytest.raises(ValueError, match="bias only split"):
        g._launch_args(x, w, y, False, DOWN._replace(split_k=1), has_bias=True)
    with pytest.raises(ValueError, match="256 columns at most"):
        g._launch_args(x, torch.empty(3072, 1536, dtype=torch.bfloat16), y, True,
                       gemv_launch._TUNED[KEY]._replace(block_n=256))
    with pytest.raises(ValueError, match="no K split when gated"):
        g._launch_args(x, torch.empty(3072, 1536, dtype=torch.bfloat16), y, True,
                       DOWN._replace(split_k=2))
    cfg = DOWN._replace(block_n=64, split_k=5, preload=6)
    assert g._launch_args(x, w, y, False, cfg, has_bias=True)[2]["PRELOAD"] == 4
    assert g._launch_args(x, w, y, False, cfg._replace(split_k=4))[2]["PRELOAD"] == 6


_COMPILE_SM90 = """
import json, sys
import torch
from triton.runtime import driver
from tests.helpers import H200CompileTarget
driver.set_active(H200CompileTarget())
from rollout.layers import gemv_launch, gluon_gemm
cfgs = json.loads(sys.argv[1])
ptx = {}
for name, (gated, n, k, cfg) in cfgs.items():
    x = torch.empty(128, k, dtype=torch.bfloat16)
    w = torch.empty(n, k, dtype=torch.bfloat16)
    y = torch.empty(128, n // 2 if gated else n, dtype=torch.bfloat16)
    for pdl in (0, 1, 2):
        kernel = gluon_gemm.compile_for_sm90(x, w, y, gated, gemv_launch.Config(**cfg), pdl)
        ptx[f"{pdl}-{gated}"] = kernel.asm["ptx"]
json.dump(ptx, sys.stdout)
"""


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[str, str]:
    """The table's gate/up entry and down split along K compiled for sm_90 under each PDL mode
    ("{use_pdl}-{gated}" -> PTX), in a child process without TRITON_INTERPRET: Triton's
    interpreter patches triton.language for the whole process while it runs a kernel, so a
    compile here could meet the patches of a thread an earlier test left interpreting (one
    CI run saw it)."""
    _gluon()
    cfgs = {"gate_up": (True, 17920, 1536, gemv_launch._TUNED[KEY]._asdict()),
            "down": (False, 1536, 8960, DOWN._asdict())}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90, json.dumps(cfgs)], cwd=root,
                         env=env | {"PYTHONPATH": os.pathsep.join(
                             filter(None, [str(root), env.get("PYTHONPATH")]))},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("use_pdl", [0, 1, 2])
def test_compiles_for_sm90_and_waits_in_both_partitions(use_pdl, gated, sm90_ptx):
    """The table's configs (gate/up; down split along K), as `launch` would run them, compile
    to wgmma with the warps split (setmaxnreg); under PDL each partition waits
    (griddepcontrol.wait: the producer before x's loads, the consumers before their first MMA)
    and the kernel triggers its successor once."""
    ptx = sm90_ptx[f"{use_pdl}-{gated}"]
    assert "setmaxnreg" in ptx and ptx.count("wgmma.mma_async") > 0
    if gated:  # gate and up rows in one wgmma (x's tile read from shared memory once for
        # both), the extra rows' in another: 2 x (64 + 8) columns
        shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
        assert shapes == {"m64n128k16", "m64n16k16"}, shapes
    assert ptx.count("griddepcontrol.wait") == (2 if use_pdl else 0)
    assert ptx.count("griddepcontrol.launch_dependents") == (1 if use_pdl else 0)


# ---- on the H200 -----------------------------------------------------------------------------
def rand(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference(x, w, inter):
    from rollout.layers import triton_ops
    return triton_ops.silu_and_mul(F.linear(x, w))


def replayed(call):
    """What `call` returns when captured in a CUDA graph and replayed once."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    return out


def _hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is Hopper's (wgmma)")
    _gluon()


@gpu
@pytest.mark.parametrize("rows", [65, 100, 128])
def test_gpu_table_entry_matches_cublas_silu(rows):
    _hopper()
    inter, k = 8960, 1536
    w = rand(2 * inter, k, seed=3) * k ** -0.5
    x = rand(rows, k, seed=rows)
    assert triton_gemv._runnable(gemv_launch._TUNED[KEY], KEY, x).gluon
    assert triton_gemv.supports(x, w, gated=True)
    out = skinny_gate_up_silu(x, w, inter)
    assert rel_err(out, reference(x, w, inter)) <= 1e-2


@gpu
@pytest.mark.parametrize("inter,k", [(1000, 1536), (8960, 1000), (200, 96)])
def test_gpu_ragged_shapes(inter, k):
    """Output columns past the last tile (1,000 = 13 x 72 + 64: the last tile's extra rows lie
    outside gate and up), K past the last chunk of 64 (zero-filled by TMA), a single tile."""
    _hopper()
    cfg = gemv_launch._TUNED[KEY]
    w = rand(2 * inter, k, seed=5) * k ** -0.5
    for rows in (70, 128):
        x = rand(rows, k, seed=rows)
        out = skinny_gate_up_silu(x, w, inter, config=cfg)
        assert rel_err(out, reference(x, w, inter)) <= 1e-2, rows


@gpu
def test_gpu_tilings_and_pdl_variants_give_the_same_bits():
    """4 or 8 consumer warps, tiles of 128 or 64 x rows (two M blocks), 64 or 64 + 8 or 64 + 16
    weight rows a program, 4 or 6 stages, 0 to 6 stages' weights before the PDL wait: one
    output, eager and replayed from a CUDA graph."""
    _hopper()
    inter, k = 8960, 1536
    w = rand(2 * inter, k, seed=7) * k ** -0.5
    x = rand(128, k, seed=8)
    base = gemv_launch._TUNED[KEY]
    ref = skinny_gate_up_silu(x, w, inter, config=base)
    variants = [base._replace(num_warps=4), base._replace(block_m=64, num_warps=4),
                base._replace(block_n=64),
                base._replace(block_n=80), base._replace(num_stages=4, preload=4),
                base._replace(preload=0), base._replace(preload=2)]
    for cfg in variants:
        assert torch.equal(skinny_gate_up_silu(x, w, inter, config=cfg), ref), cfg
    assert torch.equal(replayed(lambda: skinny_gate_up_silu(x, w, inter, config=base)), ref)


@gpu
@pytest.mark.parametrize("rows", [65, 128])
def test_gpu_projection_split_along_k(rows):
    """A plain projection (down's shape, K = 8,960): split in 11 and 8 (fp32 partials summed in
    split order by the reduce kernel, or handed to their reader: the same sums), unsplit, 96 =
    64 + 32 rows a program; within 1e-2 of F.linear, eager and from a CUDA graph."""
    _hopper()
    from rollout.layers.triton_gemv import skinny_linear
    n, k = 1536, 8960
    w = rand(n, k, seed=9) * k ** -0.5
    x = rand(rows, k, seed=rows)
    ref = F.linear(x, w)
    for cfg in (DOWN, DOWN._replace(block_n=96, split_k=8), DOWN._replace(split_k=1)):
        out = skinny_linear(x, w, config=cfg)
        assert rel_err(out, ref) <= 1e-2, cfg
        if cfg.split_k > 1:
            deferred = skinny_linear(x, w, config=cfg, defer_split=True)
            assert deferred.partials.shape[0] == cfg.split_k
            assert torch.equal(deferred.tensor(), out)
    assert torch.equal(replayed(lambda: skinny_linear(x, w, config=DOWN)),
                       skinny_linear(x, w, config=DOWN))


@gpu
@pytest.mark.parametrize("name", ["qkv", "o"])
def test_gpu_qkv_and_o_split_along_k(name):
    """qkv's shape (with its bias, which only the partials' sum can add: unsplit, it is
    refused) and o's at 128 rows, split in 4 and 8 with 64 or 128 weight rows a program; within
    1e-2 of F.linear, and the deferred partials (+ bias) sum to the same bits."""
    _hopper()
    from rollout.layers.triton_gemv import skinny_linear
    n, k = (2048, 1536) if name == "qkv" else (1536, 1536)
    w = rand(n, k, seed=11) * k ** -0.5
    b = rand(n, seed=12) if name == "qkv" else None
    x = rand(128, k, seed=13)
    ref = F.linear(x, w, b)
    for cfg in (DOWN._replace(block_n=64, split_k=4), DOWN._replace(split_k=8)):
        out = skinny_linear(x, w, b, config=cfg)
        assert rel_err(out, ref) <= 1e-2, cfg
        assert torch.equal(skinny_linear(x, w, b, config=cfg, defer_split=True).tensor(), out)
    if b is not None:
        with pytest.raises(ValueError, match="bias"):
            skinny_linear(x, w, b, config=DOWN._replace(split_k=1))


@gpu
@pytest.mark.parametrize("rows", [17, 32, 50, 64])
def test_gpu_fewer_rows_than_the_x_tile(rows):
    """17-64 rows in a 64-row x tile (one consumer warpgroup; TMA zero-fills the rows past M,
    the epilogue stores none of them): down, o and qkv (+ bias) split along K in 5, 4 and 3,
    within 1e-2 of F.linear with their deferred partials summing to the same bits; gate/up +
    SiLU at the table's entry (64 + 8 gate and as many up rows, 8 stages) and on 64 + 0 rows
    within 1e-2 of cuBLAS + silu_and_mul, the same bits as each other; eager and from a CUDA
    graph."""
    _hopper()
    from rollout.layers.triton_gemv import skinny_linear
    tile = gemv_launch._GLUON_64_ROWS  # the table's 17-64-row entries, their splits set below
    for n, k, split, bias in ((1536, 8960, 5, False), (1536, 1536, 4, False),
                              (2048, 1536, 3, True)):
        w = rand(n, k, seed=n + k) * k ** -0.5
        b = rand(n, seed=1) if bias else None
        x = rand(rows, k, seed=rows)
        cfg = tile._replace(split_k=split)
        out = skinny_linear(x, w, b, config=cfg)
        assert rel_err(out, F.linear(x, w, b)) <= 1e-2, (n, k)
        assert torch.equal(skinny_linear(x, w, b, config=cfg, defer_split=True).tensor(), out)
    inter, k = 8960, 1536
    w = rand(2 * inter, k, seed=3) * k ** -0.5
    x = rand(rows, k, seed=rows)
    gated = gemv_launch._TUNED[(64, 2 * inter, k, True)]
    out = skinny_gate_up_silu(x, w, inter, config=gated)
    assert rel_err(out, reference(x, w, inter)) <= 1e-2
    assert torch.equal(skinny_gate_up_silu(x, w, inter, config=gated._replace(block_n=64)), out)
    assert torch.equal(replayed(lambda: skinny_gate_up_silu(x, w, inter, config=gated)), out)
