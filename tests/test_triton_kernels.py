"""Spec: the Triton attention kernels and backend equal plain softmax attention.

On CPU the kernels run under the Triton interpreter (fp32, tiny ragged batches), checked against
an independent per-request reference, against the torch_native backend, and end to end against
Hugging Face. On a GPU (tests marked `gpu`): bf16 kernels against torch_native, and the decode
CUDA graphs against eager, also after an in-place weight reload."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from rollout.attention.torch_native import TorchNativeBackend  # noqa: E402
from rollout.attention.triton_backend import TritonBackend  # noqa: E402
from rollout.attention.triton_kernels import decode, decode_attention, extend_attention  # noqa: E402
from rollout.attention.triton_kernels.extend import ExtendConfig  # noqa: E402
from rollout.batch_builder import build_batch  # noqa: E402
from rollout.config import EngineConfig  # noqa: E402
from rollout.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from tests.helpers import (DEV, RunnerDriver, eager_graph_capture, gpu, hf_last_logits,  # noqa: E402
                           hf_model, require_runnable_triton)
from tests.test_model_parity import PROMPTS  # noqa: E402

require_runnable_triton(decode._decode_partial_kernel)



SEQ_LENS = [1, 40, 17, 33, 5]
PREFIX_LENS = [0, 25, 0, 32, 3]  # extend: 1, 15, 17, 1, 2 new tokens


@dataclasses.dataclass
class Paged:
    """A random paged KV cache: request b's token j at slot req_to_token[rows[b], j]."""

    k: torch.Tensor
    v: torch.Tensor
    req_to_token: torch.Tensor
    rows: torch.Tensor
    seq_lens: list
    prefix_lens: list

    def slots(self, b: int) -> torch.Tensor:
        return self.req_to_token[self.rows[b], : self.seq_lens[b]].long()


def make_paged(seq_lens, prefix_lens, kv_heads, head_dim, dtype=torch.float32, seed=0) -> Paged:
    gen = torch.Generator().manual_seed(seed)
    total, batch = sum(seq_lens), len(seq_lens)
    slots = torch.randperm(total, generator=gen) + 1  # scattered; slot 0 is the dummy
    req_to_token = torch.zeros(batch + 3, max(seq_lens) + 8, dtype=torch.int32)
    rows = torch.randperm(batch + 3, generator=gen)[:batch]
    for b, n in enumerate(seq_lens):
        req_to_token[rows[b], :n] = slots[sum(seq_lens[:b]): sum(seq_lens[:b]) + n].int()
    k, v = (torch.randn(total + 1, kv_heads, head_dim, generator=gen) for _ in range(2))
    to = dict(device=DEV)
    return Paged(k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), req_to_token.to(**to),
                 rows.to(**to), list(seq_lens), list(prefix_lens))


def reference(q: torch.Tensor, p: Paged, b: int, scale: float) -> torch.Tensor:
    """Request b's last q.shape[0] tokens, causal, plain softmax over its gathered keys."""
    n, heads = q.shape[0], q.shape[1]
    group = heads // p.k.shape[1]
    k = p.k[p.slots(b)].double().repeat_interleave(group, 1)  # [L, H, D]
    v = p.v[p.slots(b)].double().repeat_interleave(group, 1)
    length = p.seq_lens[b]
    q_pos = torch.arange(length - n, length, device=q.device)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def extend_meta(p: Paged):
    ext = torch.tensor([s - pre for s, pre in zip(p.seq_lens, p.prefix_lens)], device=DEV)
    return ext, torch.tensor(p.prefix_lens, device=DEV), torch.cumsum(ext, 0) - ext


# ---- kernels against the reference ---------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("num_splits", [1, 3, 8])  # 8 > some lengths: empty splits
def test_decode_kernel_matches_reference(head_dim, num_splits):
    p = make_paged(SEQ_LENS, [n - 1 for n in SEQ_LENS], kv_heads=2, head_dim=head_dim)
    q = torch.randn(len(SEQ_LENS), 4, head_dim, device=DEV)
    scale = head_dim ** -0.5
    outs = []
    for preload_kv in (False, True):  # the first block's earlier keys loaded before the wait
        # NaN scratch: the splits a short sequence leaves empty must not leak into the result
        scratch = decode.decode_buffers(len(SEQ_LENS), 4, head_dim, num_splits, DEV)
        scratch.part_o.fill_(float("nan"))
        scratch.part_lse.fill_(float("nan"))
        outs.append(decode_attention(q, p.k, p.v, p.req_to_token, p.rows,
                                     torch.tensor(SEQ_LENS, device=DEV), scale,
                                     decode.DecodeConfig(num_splits, preload_kv=preload_kv),
                                     buffers=scratch))
    expected = torch.cat([reference(q[b:b + 1], p, b, scale) for b in range(len(SEQ_LENS))])
    assert (outs[0] - expected).abs().max().item() <= 1e-4
    assert torch.equal(outs[1], outs[0])  # the same sums in the same order


@gpu
@pytest.mark.parametrize("config", [
    decode.DecodeConfig(8, num_stages=2), decode.DecodeConfig(8, num_stages=3),
    decode.DecodeConfig(8, num_stages=2, preload_kv=True),
    decode.DecodeConfig(1, block_n=128, num_warps=4, num_stages=2, preload_kv=True),
    decode.DecodeConfig(1, block_n=128, num_warps=4, num_stages=2, preload_kv=True,
                        prefetch_l2=True),
    decode.DecodeConfig(4, block_n=64, num_warps=2, num_stages=3, prefetch_l2=True),
    decode.DecodeConfig(1, block_n=64, num_warps=2, num_stages=4),
    decode.DecodeConfig(8, block_n=256, num_warps=8, num_stages=2, per_head=True),
    decode.DecodeConfig(8, block_n=64, num_warps=4, num_stages=2, per_head=True),
    decode.DecodeConfig(1, block_n=64, num_warps=4, num_stages=2, per_head=True)])
def test_decode_after_the_kernel_that_writes_the_new_key(monkeypatch, config):
    """In a CUDA graph, under PDL: the rotary kernel writes each request's new key and value
    into its KV slot (poisoned before every replay), the decode kernel reads the step's lengths
    and request rows (and with `preload_kv` the earlier keys and values of its first block)
    before its PDL wait and the cache after it. Every replay gives the bits of the same kernels
    launched without PDL (bf16, 128 requests of 1-300 keys, 8 splits or one, or a program a
    query head over one or several blocks of keys)."""
    from rollout import triton_pdl
    from rollout.layers import triton_ops
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator().manual_seed(4)
    lens_cpu = torch.randint(1, 301, (128,), generator=gen).tolist()
    p = make_paged(lens_cpu, [n - 1 for n in lens_cpu], kv_heads=2, head_dim=128,
                   dtype=torch.bfloat16)
    new_slots = torch.stack([p.slots(b)[-1] for b in range(128)])
    qk_in = torch.randn(128, 14, 128, generator=gen).to(DEV, torch.bfloat16)  # 12 q + 2 k heads
    v_new = torch.randn(128, 2, 128, generator=gen).to(DEV, torch.bfloat16)
    cos, sin = (torch.rand(128, 1, 64, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    lens = torch.tensor(lens_cpu, device=DEV)
    qk, out = qk_in.clone(), torch.empty(128, 12, 128, device=DEV, dtype=torch.bfloat16)
    scratch = decode.decode_buffers(128, 12, 128, 8, DEV)

    def step():
        p.k.index_fill_(0, new_slots, float("nan"))  # what the slots held: never to be read
        p.v.index_fill_(0, new_slots, float("nan"))
        qk.copy_(qk_in)
        triton_ops.apply_rotary_inplace(qk, cos, sin, triton_ops.KVStore(v_new, new_slots, p.k, p.v))
        decode_attention(qk[:, :12], p.k, p.v, p.req_to_token, p.rows, lens, 0.088,
                         config, scratch, out)

    assert triton_pdl.enabled()
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replays = []
    for _ in range(20):
        graph.replay()
        replays.append(out.clone())
    monkeypatch.setattr(triton_pdl, "_enabled", False)
    step()
    assert not out.isnan().any()
    assert all(torch.equal(r, out) for r in replays)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_l2_prefetch_is_a_hint(splits):
    """`prefetch_l2` (the first KV head's programs ask L2 for every head's earlier keys and
    values before the PDL wait) changes no bit. On CPU the interpreter runs without it (inline
    PTX); on a GPU bf16 Qwen2-1.5B heads, 128 requests of 1-300 keys, with it."""
    cuda = DEV.type == "cuda"
    gen = torch.Generator().manual_seed(9)
    lens = torch.randint(1, 301, (128,), generator=gen).tolist() if cuda else SEQ_LENS
    head_dim, dtype = (128, torch.bfloat16) if cuda else (16, torch.float32)
    p = make_paged(lens, [n - 1 for n in lens], kv_heads=2, head_dim=head_dim, dtype=dtype)
    q = torch.randn(len(lens), 12, head_dim, generator=gen).to(DEV, dtype)
    seq_lens = torch.tensor(lens, device=DEV)
    with_prefetch = decode.DecodeConfig(splits, 128 if cuda else 16, 4, 2, True, False, True)
    assert decode._prefetch_row_bytes(with_prefetch, q, p.k, p.v) == (2 * head_dim * 2 if cuda else 0)
    outs = [decode_attention(q, p.k, p.v, p.req_to_token, p.rows, seq_lens, 0.1, cfg)
            for cfg in (with_prefetch, with_prefetch._replace(prefetch_l2=False))]
    assert torch.equal(outs[0], outs[1])
    expected = torch.cat([reference(q[b:b + 1], p, b, 0.1) for b in range(len(lens))])
    assert (outs[0].float() - expected.float()).abs().max().item() <= (2e-2 if cuda else 1e-4)
    # rows that are not one contiguous run of KV heads: no prefetch (no wrong addresses)
    strided = torch.zeros(p.k.shape[0], 2, head_dim * 2, device=DEV, dtype=dtype)[..., :head_dim]
    assert decode._prefetch_row_bytes(with_prefetch, q, strided, strided) == 0


@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("preload_kv", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_launch_configs_match_reference(block_n, preload_kv, splits):
    """Another keys-per-block (and the warps/stages a tuned table may pick; the first block
    preloaded, then more blocks after it: one split of 40 keys at 16 keys a block): the same
    function; scratch larger than the splits used, as the backend allocates it."""
    p = make_paged(SEQ_LENS, [n - 1 for n in SEQ_LENS], kv_heads=2, head_dim=16)
    q = torch.randn(len(SEQ_LENS), 4, 16, device=DEV)
    scratch = decode.decode_buffers(len(SEQ_LENS), 4, 16, 8, DEV)
    cfg = decode.DecodeConfig(splits=splits, block_n=block_n, num_warps=2, num_stages=2,
                              preload_kv=preload_kv)
    out = decode_attention(q, p.k, p.v, p.req_to_token, p.rows, torch.tensor(SEQ_LENS, device=DEV),
                           0.25, buffers=scratch, config=cfg)
    expected = torch.cat([reference(q[b:b + 1], p, b, 0.25) for b in range(len(SEQ_LENS))])
    assert (out - expected).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="splits"):
        decode_attention(q, p.k, p.v, p.req_to_token, p.rows, torch.tensor(SEQ_LENS, device=DEV),
                         0.25, buffers=decode.decode_buffers(len(SEQ_LENS), 4, 16, splits - 1, DEV),
                         config=cfg)


@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("block_n,splits", [(64, 8), (16, 1), (16, 3), (16, 8)])
def test_decode_per_head_kernel_matches_reference(head_dim, block_n, splits):
    """One program per (request, query head, split) (decode_head.py): plain softmax attention
    for ragged contexts of 1-40 keys, GQA groups of 2, a padded head dim. At 64 keys a block
    every context is short (the first split alone, the others exit); at 16 the longer ones are
    split and merged by the last split to arrive (at 8 splits of an 18-key context the last
    ones are empty), or with one split run block by block. The merge leaves the arrival
    counters 0, so a second call (here on other queries) starts from a clean slate; NaN
    scratch never leaks."""
    lens = [1, 40, 18, 33, 5]
    p = make_paged(lens, [n - 1 for n in lens], kv_heads=2, head_dim=head_dim)
    scale = head_dim ** -0.5
    cfg = decode.DecodeConfig(splits, block_n=block_n, num_warps=4, num_stages=2, per_head=True)
    scratch = decode.decode_buffers(len(lens), 4, head_dim, 8, DEV)
    scratch.part_o.fill_(float("nan"))
    scratch.part_lse.fill_(float("nan"))
    for seed in (0, 1):
        q = torch.randn(len(lens), 4, head_dim, device=DEV,
                        generator=torch.Generator(DEV).manual_seed(seed))
        out = torch.full_like(q, float("nan"))
        decode_attention(q, p.k, p.v, p.req_to_token, p.rows, torch.tensor(lens, device=DEV),
                         scale, config=cfg, buffers=scratch, out=out)
        expected = torch.cat([reference(q[b:b + 1], p, b, scale) for b in range(len(lens))])
        assert (out - expected).abs().max().item() <= 1e-4
        assert not scratch.arrivals.any()


def test_decode_scratch_too_small_is_refused():
    """Scratch with fewer splits, requests or heads than the launch needs: a ValueError before
    any launch."""
    p = make_paged(SEQ_LENS, [n - 1 for n in SEQ_LENS], kv_heads=2, head_dim=16)
    q = torch.randn(len(SEQ_LENS), 4, 16, device=DEV)
    lens = torch.tensor(SEQ_LENS, device=DEV)
    cfg = decode.DecodeConfig(4, block_n=16, per_head=True)
    for bad, match in ((decode.decode_buffers(len(SEQ_LENS), 4, 16, 2, DEV), "splits"),
                       (decode.decode_buffers(len(SEQ_LENS) - 1, 4, 16, 8, DEV), "arrival"),
                       (decode.decode_buffers(len(SEQ_LENS), 2, 16, 8, DEV), "arrival")):
        with pytest.raises(ValueError, match=match):
            decode_attention(q, p.k, p.v, p.req_to_token, p.rows, lens, 0.25, config=cfg,
                             buffers=bad)


def test_decode_launch_table_from_the_environment(monkeypatch):
    """ROLLOUT_DECODE_ATTN_CONFIGS replaces the built-in table (splits capped by the scratch);
    a malformed one is refused with the entry named."""
    monkeypatch.delenv("ROLLOUT_DECODE_ATTN_CONFIGS", raising=False)
    assert decode.launch_table_from_env() is None
    assert decode.decode_launch_config(1, kv_heads=2) == decode.PER_HEAD_ONE_REQUEST
    assert decode.decode_launch_config(2, kv_heads=2) == decode.DecodeConfig(8, num_stages=2,
                                                                             preload_kv=True)
    monkeypatch.setenv("ROLLOUT_DECODE_ATTN_CONFIGS", "16:4,64,4,2; 256:1,64,2,3")
    table = decode.launch_table_from_env()
    configs = [decode.decode_launch_config(b, table=table, kv_heads=2) for b in (1, 16, 17, 512)]
    assert configs == [decode.DecodeConfig(4, 64, 4, 2)] * 2 + [decode.DecodeConfig(1, 64, 2, 3)] * 2
    assert decode.decode_launch_config(8, max_splits=2, table=table, kv_heads=2).splits == 2
    monkeypatch.setenv("ROLLOUT_DECODE_ATTN_CONFIGS", "16:8,32,4,2,1;256:1,128,4,2,0")
    table = decode.launch_table_from_env()
    assert (decode.decode_launch_config(1, table=table, kv_heads=2)
            == decode.DecodeConfig(8, 32, 4, 2, True))
    assert decode.decode_launch_config(128, table=table, kv_heads=2).preload_kv is False
    monkeypatch.setenv("ROLLOUT_DECODE_ATTN_CONFIGS", "1:1,256,16,2,1,1;256:1,128,4,2,1")
    table = decode.launch_table_from_env()
    assert decode.decode_launch_config(1, table=table, kv_heads=2).per_head is True
    assert decode.decode_launch_config(2, table=table, kv_heads=2).per_head is False
    # a long-context config after '|': past 257 keys
    monkeypatch.setenv("ROLLOUT_DECODE_ATTN_CONFIGS", "2:8,32,4,2,1|16,256,8,2,1,1;256:1,128,4,2,1")
    table = decode.launch_table_from_env()
    launch = decode.decode_launch(2, max_splits=8, table=table, kv_heads=2)
    assert launch.long == decode.DecodeConfig(8, 256, 8, 2, True, True)  # capped at 8 splits
    assert launch.launch_classes() == (1, 258)
    assert decode.decode_launch_config(1, table=table, max_keys=257, kv_heads=2).per_head is False
    assert decode.decode_launch_config(1, table=table, max_keys=258, kv_heads=2).per_head is True
    assert decode.decode_launch(3, table=table, kv_heads=2).launch_classes() == (1,)
    # the L2 prefetch flag, seventh
    monkeypatch.setenv("ROLLOUT_DECODE_ATTN_CONFIGS", "64:4,64,2,3;256:1,128,4,2,1,0,1")
    table = decode.launch_table_from_env()
    assert decode.decode_launch_config(128, table=table, kv_heads=2) == decode.DecodeConfig(
        1, 128, 4, 2, True, False, True)
    assert decode.decode_launch_config(32, table=table, kv_heads=2).prefetch_l2 is False
    for bad in ("16:4,64", "x:1,64,2,3", "16:4,48,4,2", "16:0,64,4,2", ";", "16:8,32,4,2,2",
                "16:8,32,4,2,1,2", "16:8,32,4,2,1,1,2", "16:8,32,4,2,1,1,1,1",
                "2:8,32,4,2,1|8,256,8,2,2",
                "2:8,32,4,2,1|8,256,8,2,1,1|8,256,8,2,1,1", "0:8,32,4,2"):
        monkeypatch.setenv("ROLLOUT_DECODE_ATTN_CONFIGS", bad)
        with pytest.raises(ValueError, match="decode attention config"):
            decode.launch_table_from_env()


def test_decode_launches_by_context_length():
    """The built-in table past 257 keys: 8 splits of 128-key blocks up to 16 requests; from 17
    requests on one launch whatever the context."""
    for batch in (1, 2, 16):
        launch = decode.decode_launch(batch, kv_heads=2)
        assert launch.launch_classes() == (1, 258)
        assert decode.decode_launch_config(batch, max_keys=257, kv_heads=2) == launch.short
        long = decode.decode_launch_config(batch, max_keys=258, kv_heads=2)
        assert long == decode.DecodeConfig(8, 128, 4, 3, True)
    assert decode.decode_launch(2, max_splits=2, kv_heads=2).long.splits == 2
    # one request: the per-head kernel for a short context of up to 2 KV heads (measured with
    # Qwen2-1.5B's), the split kernel for more KV heads
    assert decode.decode_launch_config(1, max_keys=257, kv_heads=2).per_head is True
    assert decode.decode_launch_config(1, max_keys=257, kv_heads=1).per_head is True
    assert decode.decode_launch_config(1, max_keys=257, kv_heads=8).per_head is False
    assert decode.decode_launch_config(2, max_keys=257, kv_heads=2).per_head is False
    # the L2 prefetch of the context before the PDL wait: 17-32 requests only (a CUDA-graph
    # size edge: a batch and the graph it is padded to launch alike)
    assert [decode.decode_launch_config(b, kv_heads=2).prefetch_l2
            for b in (16, 17, 32, 33, 64, 128)] == [False, True, True, False, False, False]
    for batch in (17, 32, 64, 128, 256):
        assert decode.decode_launch(batch, kv_heads=2).launch_classes() == (1,)
        assert (decode.decode_launch_config(batch, max_keys=10 ** 5, kv_heads=2)
                == decode.decode_launch_config(batch, kv_heads=2))


def test_decode_launches_by_kv_heads():
    """Past 16 requests the launch follows the programs a split launches (requests x KV heads):
    Qwen2-1.5B's 2 KV heads keep their measured table up to 128 requests, Qwen3-1.7B's 8 take
    one split of 128-key blocks at 17-32 requests and of 64-key blocks past 32 (as Qwen2's past
    128), and each class edge is a CUDA-graph size, so a batch and the graph it is padded to
    launch alike."""
    one_split_128 = decode.DecodeConfig(1, 128, 4, 2, preload_kv=True)
    one_split_64 = decode.DecodeConfig(1, 64, 2, 4)
    qwen2 = {b: decode.decode_launch_config(b, kv_heads=2) for b in (17, 32, 33, 64, 65, 128, 129)}
    assert [c.splits for c in qwen2.values()] == [4, 4, 4, 4, 1, 1, 1]
    assert qwen2[65] == qwen2[128] == one_split_128 and qwen2[129] == one_split_64
    qwen3 = {b: decode.decode_launch_config(b, kv_heads=8) for b in (16, 17, 32, 33, 256)}
    assert qwen3[16] == decode.decode_launch_config(16, kv_heads=2)  # few requests: unchanged
    assert qwen3[17] == qwen3[32] == one_split_128
    assert qwen3[33] == qwen3[256] == one_split_64
    sizes = EngineConfig().graph_batch_sizes
    for kv_heads in (1, 2, 4, 8):
        for batch in range(1, 257):
            graph = min(s for s in sizes if s >= batch)
            assert (decode.decode_launch(batch, kv_heads=kv_heads)
                    == decode.decode_launch(graph, kv_heads=kv_heads)), (kv_heads, batch, graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_kernel_equals_indexed_assignment(dtype):
    """The fused KV store writes exactly what `buf[loc] = x.to(buf.dtype)` writes, from strided
    views of a fused QKV output, and nothing else (poisoned buffers)."""
    from rollout.attention.triton_kernels.store_kv import rows_are_flat, store_kv
    if DEV.type == "cpu" and dtype is torch.bfloat16:
        pytest.skip("the interpreter runs the fp32 case; bf16 runs on the GPU")
    tokens, kv_heads, head_dim = 7, 2, 24
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, device=DEV)
    k = qkv[:, 4 * head_dim:(4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    assert rows_are_flat(k) and rows_are_flat(v) and not k.is_contiguous()
    loc = torch.randperm(40, device=DEV)[:tokens]
    bufs = [torch.full((40, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEV) for _ in range(4)]
    store_kv(k, v, loc, bufs[0], bufs[1])
    bufs[2][loc], bufs[3][loc] = k.to(dtype), v.to(dtype)
    for got, want in ((bufs[0], bufs[2]), (bufs[1], bufs[3])):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("tokens", [1, 5, 1500])
def test_req_to_token_write_kernel_equals_indexed_assignment(tokens):
    """ReqToTokenPool.write's one-launch kernel (a GPU's) leaves the table exactly as the
    indexed assignment of the int32 cast does (the CPU's), from the rows of a packed index
    tensor (a decode batch's) or past one program's block of tokens (a prefill's)."""
    from rollout.attention.triton_kernels import req_to_token
    from rollout.memory import ReqToTokenPool
    g = torch.Generator().manual_seed(tokens)
    cells = torch.randperm(6 * 400, generator=g)[:tokens]  # distinct (row, position) pairs
    slots = torch.randint(0, 2**20, (tokens,), generator=g)
    packed = torch.stack([cells // 400, cells % 400, slots]).to(DEV)  # rows, positions, slots
    fused, plain = ReqToTokenPool(6, 400, DEV), ReqToTokenPool(6, 400, DEV)
    fused._fused, plain._fused = req_to_token, None
    for pool in (fused, plain):
        pool.req_to_token.fill_(-7)
        pool.write(packed[0], packed[1], packed[2])
    assert torch.equal(fused.req_to_token, plain.req_to_token)
    assert plain.req_to_token[packed[0], packed[1]].tolist() == slots.tolist()


@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("config", [None, (64, 32, 4, 3), (16, 16, 2, 2), (16, 16, 4, 2, True),
                                    (32, 16, 4, 3, True)])
@pytest.mark.parametrize("heads", [4, 6])
def test_extend_kernel_matches_reference(head_dim, config, heads):
    """The default launch and others (new tokens a program, keys a step, warps, stages, query
    heads packed by KV head: groups of 2, and of 3 padded to 4 rows a token)."""
    p = make_paged(SEQ_LENS, PREFIX_LENS, kv_heads=2, head_dim=head_dim, seed=1)
    ext, prefix, start = extend_meta(p)
    q = torch.randn(int(ext.sum()), heads, head_dim, device=DEV)
    scale = head_dim ** -0.5
    out = extend_attention(q, p.k, p.v, p.req_to_token, p.rows, start, ext, prefix,
                           int(ext.max()), scale,
                           config=ExtendConfig(*config) if config is not None else None)
    expected = torch.cat([reference(q[s:s + n], p, b, scale)
                          for b, (s, n) in enumerate(zip(start.tolist(), ext.tolist()))])
    assert (out - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.skipif(
    DEV.type == "cuda", reason="compiled, fp32's FMA dot may add in another order")),
    torch.bfloat16])
def test_extend_packed_rows_equal_the_unpacked_kernels(dtype):
    """Packing a KV head's query heads into one program changes which program computes a row,
    not the row's sums: bit for bit the unpacked launch with the same blocks."""
    p = make_paged(SEQ_LENS, PREFIX_LENS, kv_heads=2, head_dim=32, seed=4, dtype=dtype)
    ext, prefix, start = extend_meta(p)
    q = torch.randn(int(ext.sum()), 6, 32, device=DEV).to(dtype)
    outs = [extend_attention(q, p.k, p.v, p.req_to_token, p.rows, start, ext, prefix,
                             int(ext.max()), 32 ** -0.5, config=ExtendConfig(16, 16, 4, 2, packed))
            for packed in (False, True)]
    if dtype == torch.float32 and DEV.type == "cpu":
        # the interpreter's tl.dot is numpy's matmul, whose BLAS may order a 16-row and a
        # 48-row product's sums differently on some CPUs (OpenBLAS picks its kernels by CPU)
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-6
    else:
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("config", [None, (16, 16, 2, 2), (16, 16, 4, 2, True)])
def test_extend_block_table_equals_the_grid_launch(config):
    """A program table (`extend_blocks`, a CUDA graph's launch) gives each (request, block) the
    grid launch's program: the same rows bit for bit, with zero-length requests in between and
    after (a graph's padded request rows) and the table sized for more tokens than the batch has
    (its padded token rows, left untouched)."""
    from rollout.attention.triton_kernels.extend import UNUSED_BLOCK, extend_blocks
    seq_lens, prefix_lens = SEQ_LENS[:3] + [4] + SEQ_LENS[3:] + [1], PREFIX_LENS[:3] + [4] + PREFIX_LENS[3:] + [1]
    p = make_paged(seq_lens, prefix_lens, kv_heads=2, head_dim=16, seed=2)
    ext, prefix, start = extend_meta(p)  # request 3 and the last: no new tokens
    q = torch.randn(int(ext.sum()), 4, 16, device=DEV)
    cfg = ExtendConfig(*config) if config is not None else ExtendConfig()
    grid_out = extend_attention(q, p.k, p.v, p.req_to_token, p.rows, start, ext, prefix,
                                int(ext.max()), 0.25, config=cfg)
    padded_q = torch.cat([q, torch.randn(9, 4, 16, device=DEV)])
    blocks = extend_blocks(ext, padded_q.shape[0], cfg.block_m)
    used = [(r, m) for r, m in zip(blocks.request.tolist(), blocks.m_block.tolist()) if m != UNUSED_BLOCK]
    assert used == [(b, m) for b, n in enumerate(ext.tolist()) for m in range(-(-n // cfg.block_m))]
    out = torch.full_like(padded_q, 7.0)
    extend_attention(padded_q, p.k, p.v, p.req_to_token, p.rows, start, ext, prefix, 0, 0.25,
                     out=out, config=cfg, blocks=blocks)
    assert torch.equal(out[:q.shape[0]], grid_out)
    assert bool((out[q.shape[0]:] == 7.0).all())


def test_extend_packed_config_under_16_rows_is_refused():
    """A packed launch of fewer than the 16 rows tl.dot takes (a group of 2 × 4 tokens) is a
    ValueError naming the config, raised before any launch."""
    p = make_paged(SEQ_LENS, PREFIX_LENS, kv_heads=2, head_dim=16, seed=4)
    ext, prefix, start = extend_meta(p)
    q = torch.randn(int(ext.sum()), 4, 16, device=DEV)
    with pytest.raises(ValueError, match="under the 16 rows"):
        extend_attention(q, p.k, p.v, p.req_to_token, p.rows, start, ext, prefix, int(ext.max()),
                         0.25, config=ExtendConfig(4, 16, 4, 2, True))


# ---- the backend against torch_native -----------------------------------------------------------
def backend_outputs(p: Paged, mode: ForwardMode, heads: int, head_dim: int, seed: int = 0):
    """(triton, torch_native) outputs of one layer's attention for the batch described by p."""
    ext = [s - pre for s, pre in zip(p.seq_lens, p.prefix_lens)]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(ext), heads, head_dim, generator=gen).to(device=DEV, dtype=p.k.dtype)
    fb = batch_for(p, mode, ext)
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=p.req_to_token), device=DEV,
        model_config=SimpleNamespace(num_attention_heads=heads, head_dim=head_dim,
                                     num_key_value_heads=p.k.shape[1]),
        tp=SimpleNamespace(size=1))
    layer = SimpleNamespace(layer_id=0, scaling=head_dim ** -0.5, num_heads=heads,
                            num_kv_heads=p.k.shape[1])
    outs = []
    for backend in (TritonBackend(runner), TorchNativeBackend(runner)):
        backend.init_forward_metadata(fb)
        run = backend.forward_decode if mode.is_decode else backend.forward_extend
        outs.append(run(q, layer, fb))
    return outs


def batch_for(p: Paged, mode: ForwardMode, ext: list) -> ForwardBatch:
    t = lambda xs: torch.tensor(xs, device=DEV)  # noqa: E731
    n = sum(ext)
    return ForwardBatch(
        forward_mode=mode, batch_size=len(ext), input_ids=t([0] * n), positions=t([0] * n),
        req_pool_indices=p.rows, seq_lens=t(p.seq_lens), out_cache_loc=t([0] * n),
        seq_lens_cpu=p.seq_lens, extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=p.prefix_lens,
        extend_seq_lens=t(ext), extend_prefix_lens=t(p.prefix_lens),
        token_to_kv_pool=SimpleNamespace(k_buffers=[p.k], v_buffers=[p.v]))


@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_backend_matches_torch_native(mode, head_dim):
    prefix = [n - 1 for n in SEQ_LENS] if mode.is_decode else PREFIX_LENS
    p = make_paged(SEQ_LENS, prefix, kv_heads=2, head_dim=head_dim, seed=2)
    triton_out, native_out = backend_outputs(p, mode, heads=4, head_dim=head_dim)
    assert (triton_out - native_out).abs().max().item() <= 1e-4


def test_model_with_triton_backend_matches_hf(tiny_dirs):
    """The parity test of test_model_parity, shortened: prefill then 3 decode steps."""
    path = tiny_dirs["Qwen3ForCausalLM"]
    hf = hf_model(path)
    driver = RunnerDriver(path, device=DEV.type, attention_backend="triton", cuda_graph=False)
    assert isinstance(driver.runner.attn_backend, TritonBackend)
    seqs = [list(s) for s in PROMPTS]
    logits, worst = driver.prefill(seqs), 0.0
    for step in range(4):
        expected = torch.stack([hf_last_logits(hf, s) for s in seqs])
        worst = max(worst, (logits.cpu() - expected).abs().max().item())
        nxt = expected.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        if step < 3:
            logits = driver.decode(nxt)
    assert worst <= 1e-4, f"max |logit diff| {worst}"


def greedy(driver: RunnerDriver, prompts, steps: int):
    """Greedy tokens and the logits that chose them, [steps, batch, vocab]."""
    logits = driver.prefill([list(s) for s in prompts])
    tokens, seen = [], []
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        tokens.append(nxt)
        seen.append(logits)
        logits = driver.decode(nxt)
    return tokens, torch.stack(seen)


GRAPH_PROMPTS = PROMPTS + [[5, 6, 7, 8, 9]]  # 5 requests: replays the graph of 8, padded


def test_graph_runner_padding_on_cpu(tiny_dirs, monkeypatch):
    """The CudaGraphRunner's bookkeeping (static buffers, padding 5 -> 8, backend replay hook)
    without CUDA: each "graph" re-runs the forward eagerly on the static buffers, which is
    exactly what a captured graph would read. The backend's graph metadata reads the request
    rows and seq_lens in the static input table itself (no copies of its own)."""
    from rollout.cuda_graph_runner import CudaGraphRunner

    monkeypatch.setattr(CudaGraphRunner, "_capture_graphs", eager_graph_capture)
    path = tiny_dirs["Qwen3ForCausalLM"]
    # decode graphs only: the interpreter would run every stand-in prefill graph's forward
    cfg = dict(device=DEV.type, attention_backend="triton", cuda_graph=False,
               cuda_graph_prefill_tokens=())
    graphed = RunnerDriver(path, cuda_graph_batch_sizes=(1, 2, 4, 8), **cfg)
    graphed.runner.graph_runner = CudaGraphRunner(graphed.runner)
    eager = RunnerDriver(path, **cfg)
    g_tokens, g_logits = greedy(graphed, GRAPH_PROMPTS, 3)
    e_tokens, e_logits = greedy(eager, GRAPH_PROMPTS, 3)
    assert graphed.runner.graph_runner.num_replays == 3
    assert g_tokens == e_tokens
    assert (g_logits - e_logits).abs().max().item() <= 1e-5
    meta, inputs = graphed.runner.attn_backend.meta, graphed.runner.graph_runner.inputs
    assert meta.req_pool_indices.data_ptr() == inputs.req_pool_indices.data_ptr()
    assert meta.seq_lens.data_ptr() == inputs.seq_lens.data_ptr()
    assert meta.seq_lens.tolist() == graphed.lens + [1] * 3  # the padded rows' length


@pytest.mark.skipif(DEV.type == "cuda", reason="the interpreter's launch classes (a GPU has others)")
def test_graph_runner_launch_classes_on_cpu(tiny_dirs, monkeypatch):
    """Decode graphs per (batch size, launch class): at one and two requests the backend
    launches other blocks past 17 keys on CPU (past 257 up to 16 requests on a GPU), so a
    batch whose longest context crosses that replays the other class's graph from the next step
    on, with the eager forward's logits; three requests and more have one class here."""
    from rollout.cuda_graph_runner import CudaGraphRunner

    monkeypatch.setattr(CudaGraphRunner, "_capture_graphs", eager_graph_capture)
    path = tiny_dirs["Qwen2ForCausalLM"]
    cfg = dict(device=DEV.type, attention_backend="triton", cuda_graph=False,
               cuda_graph_batch_sizes=(1, 2, 4), cuda_graph_prefill_tokens=())
    graphed = RunnerDriver(path, **cfg)
    runner = graphed.runner.graph_runner = CudaGraphRunner(graphed.runner)
    assert sorted(runner.graphs) == [(1, 0), (1, 1), (2, 0), (2, 1), (4, 0)]
    eager = RunnerDriver(path, **cfg)
    backend = graphed.runner.attn_backend
    for prompts, keys in (([list(range(3, 18))], [(1, 0), (1, 0), (1, 1), (1, 1)]),
                          ([[5, 6, 7], list(range(2, 30))], [(2, 1)] * 4),
                          ([[5, 6, 7]] * 3, [(4, 0)] * 4)):
        g_logits, e_logits, seen, configs = greedy_both(graphed, eager, prompts, len(keys))
        assert seen == keys
        assert configs == [backend.decode_launch(bs).config(17 + cls) for bs, cls in keys]
        assert (g_logits - e_logits).abs().max().item() <= 1e-5


def test_graph_runner_small_graphs_read_inputs_of_their_own(tiny_dirs, monkeypatch):
    """The batch-1 graphs (SMALL_INPUTS_BS, default 1) read a [6, 1] static table of their own
    (on an H200 the shared table's rows, max_bs x 8 bytes apart, cost the batch-1 step ~3.5 µs),
    the others the shared one: one request, then two, then one again decode with the eager
    forward's logits, and the backend's metadata reads the table of the graph replayed."""
    from rollout import cuda_graph_runner
    from rollout.cuda_graph_runner import CudaGraphRunner

    monkeypatch.setattr(CudaGraphRunner, "_capture_graphs", eager_graph_capture)
    cfg = dict(device=DEV.type, attention_backend="triton", cuda_graph=False,
               cuda_graph_batch_sizes=(1, 2, 4), cuda_graph_prefill_tokens=())
    graphed = RunnerDriver(tiny_dirs["Qwen2ForCausalLM"], **cfg)
    runner = graphed.runner.graph_runner = CudaGraphRunner(graphed.runner)
    eager = RunnerDriver(tiny_dirs["Qwen2ForCausalLM"], **cfg)
    assert cuda_graph_runner.SMALL_INPUTS_BS == 1
    small, shared = runner.small_inputs, runner.inputs
    assert small.table.shape == (6, 1) and shared.table.shape == (6, 4)
    meta = lambda: graphed.runner.attn_backend.meta  # noqa: E731
    for prompts, table in (([[3, 4, 5]], small), ([[5, 6, 7], [8, 9]], shared), ([[7] * 9], small)):
        g_logits, e_logits, seen, _ = greedy_both(graphed, eager, prompts, 3)
        assert [bs for bs, _ in seen] == [len(prompts)] * 3
        assert (g_logits - e_logits).abs().max().item() <= 1e-5
        assert meta().seq_lens.data_ptr() == table.seq_lens.data_ptr()
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv("ROLLOUT_GRAPH_SMALL_INPUTS_BS", bad)
        with pytest.raises(ValueError, match="ROLLOUT_GRAPH_SMALL_INPUTS_BS"):
            cuda_graph_runner._small_inputs_bs()


def greedy_both(graphed: RunnerDriver, eager: RunnerDriver, prompts, steps: int):
    """Greedy decode steps of a graphed and an eager driver (each picking its own tokens): their
    logits [steps, batch, vocab], the graph key each graphed step replayed and the attention
    launch its metadata held."""
    logits, seen, configs = [], [], []
    runner = graphed.runner.graph_runner
    for driver in (graphed, eager):
        out, outs = driver.prefill([list(p) for p in prompts]), []
        for _ in range(steps):
            out = driver.decode(out.argmax(-1).tolist())
            outs.append(out)
            if driver is graphed:
                seen.append(runner.last_key)
                configs.append(graphed.runner.attn_backend.meta.config)
        logits.append(torch.stack(outs))
    return logits[0], logits[1], seen, configs


def test_prefill_graphs_on_cpu(tiny_dirs, monkeypatch):
    """Prefills replay the prefill graph of the next token and request sizes up (padded token
    rows write the dummy slot and are dropped, padded request rows compute nothing), fresh and
    after a cached prefix (a chunked prompt), one request or several of ragged lengths, with the
    logits and the KV of the eager prefill: the decode steps after them agree too. Prompt-logprob
    batches, and batches past the largest sizes, stay eager."""
    from rollout.cuda_graph_runner import CudaGraphRunner

    monkeypatch.setattr(CudaGraphRunner, "_capture_graphs", eager_graph_capture)
    path = tiny_dirs["Qwen2ForCausalLM"]
    cfg = dict(device=DEV.type, attention_backend="triton", cuda_graph=False,
               cuda_graph_batch_sizes=(1, 2, 4), cuda_graph_prefill_tokens=(4, 8, 16, 32),
               cuda_graph_prefill_requests=(1, 2, 8))
    graphed = RunnerDriver(path, **cfg)
    runner = graphed.runner.graph_runner = CudaGraphRunner(graphed.runner)
    prefill = runner.prefill
    assert prefill.keys == [(32, 8), (32, 2), (32, 1), (16, 8), (16, 2), (16, 1), (8, 8), (8, 2),
                            (8, 1), (4, 4), (4, 2), (4, 1)]  # 8 requests clipped to 4 tokens
    eager = RunnerDriver(path, **cfg)
    cases = (([[3, 1, 4, 1, 5]], (8, 1)), ([[9, 2, 6, 5, 3, 5, 8, 9]], (8, 1)), ([[7] * 13], (16, 1)),
             ([[2]], (4, 1)), ([[1, 2], [3]], (4, 2)), ([[5, 1, 2], [8] * 9, [4]], (16, 8)),
             ([[6, 2, 3], [9], [1, 1], [4, 4, 4, 4, 4], [7]], (16, 8)))
    for prompts, key in cases:
        replays = prefill.num_replays
        g_tokens, g_logits = greedy(graphed, prompts, 3)
        e_tokens, e_logits = greedy(eager, prompts, 3)
        assert prefill.num_replays == replays + 1 and prefill.last_key == key
        assert g_tokens == e_tokens
        assert (g_logits - e_logits).abs().max().item() <= 1e-5
    # cached prefixes of 6 and 2 tokens, then 9 and 3 new ones beside a fresh 4-token prompt
    replays = prefill.num_replays
    for driver in (graphed, eager):
        driver.prefill([[4, 4, 2, 7, 1, 3], [8, 6]])
        rows = driver.rows + [driver.alloc.alloc_row()]
        fb = build_batch(ForwardMode.EXTEND, rows, [[5, 9, 8, 6, 1, 2, 2, 7, 3], [1, 2, 3], [6, 5, 4, 3]],
                         driver.lens + [0], driver.alloc, DEV)
        driver.rows, driver.lens = rows, [15, 5, 4]
        driver.chunked = driver.forward(fb)
        driver.chunked_next = driver.decode(driver.chunked.argmax(-1).tolist())
    assert prefill.last_key == (16, 8) and prefill.num_replays == replays + 2
    assert (graphed.chunked - eager.chunked).abs().max().item() <= 1e-5
    assert (graphed.chunked_next - eager.chunked_next).abs().max().item() <= 1e-5
    replays = prefill.num_replays
    many = build_batch(ForwardMode.EXTEND, [graphed.alloc.alloc_row() for _ in range(9)],
                       [[i + 1] for i in range(9)], [0] * 9, graphed.alloc, DEV)
    assert not runner.can_run(many)  # 9 requests: past the largest request size
    long = build_batch(ForwardMode.EXTEND, [graphed.alloc.alloc_row()], [list(range(1, 34))], [0],
                       graphed.alloc, DEV)
    assert not runner.can_run(long)  # 33 tokens: past the largest graph
    all_logits = dataclasses.replace(long, input_ids=long.input_ids[:3], return_all_logits=True)
    assert not runner.can_run(all_logits)
    assert prefill.num_replays == replays
    # captured again after replays (memory resume, a prefetch change): from idle static inputs,
    # not the last prefill's rows (a 9-token request's index 8 is past the 4-token graph's rows)
    runner.release()
    runner.recapture()
    assert runner.inputs.table.equal(runner.inputs.pad)
    g_tokens, g_logits = greedy(graphed, [[6, 1, 2]], 2)
    e_tokens, e_logits = greedy(eager, [[6, 1, 2]], 2)
    assert prefill.num_replays == replays + 1
    assert g_tokens == e_tokens and (g_logits - e_logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("pending", [False, True])
def test_graph_inputs_fill_packed_and_per_field(pending):
    """A decode batch's index fields are rows of one tensor: the static table takes them with
    the step's req_to_token write in one kernel; separate tensors (a hand-made batch) go field by
    field, then the pool's write; both pad rows bs..graph_bs and take pending input ids (overlap
    scheduling: the previous step's device tokens) in."""
    from rollout.batch_builder import build_decode_batch
    from rollout.cuda_graph_runner import PAD_FIELDS, PAD_VALUES, GraphInputs
    from rollout.kv_allocator import KVAllocator
    from rollout.memory import ReqToTokenPool
    from rollout.model_runner import ModelRunner
    alloc = KVAllocator(8, 256, 64)
    rows = [alloc.alloc_row() for _ in range(3)]
    fb = build_decode_batch(rows, [11, 12, 13], [4, 9, 2], alloc, DEV)
    want = torch.stack([getattr(fb, name) for name in PAD_VALUES])
    assert torch.equal(fb.stacked(PAD_FIELDS), want)
    if pending:
        want[0] = torch.tensor([21, 22, 23], device=DEV)
    pads = torch.tensor(list(PAD_VALUES.values()), device=DEV).view(-1, 1).expand(-1, 5)
    for batch in (fb, dataclasses.replace(fb, positions=fb.positions.clone())):
        assert (batch.stacked(PAD_FIELDS) is None) == (batch is not fb)
        batch.input_ids_source = torch.tensor([21, 22, 23], device=DEV) if pending else None
        runner = SimpleNamespace(req_to_token_pool=ReqToTokenPool(8, 256, DEV))
        runner.take_inputs = ModelRunner.take_inputs.__get__(runner)
        inputs = GraphInputs.allocate(8, DEV)
        inputs.table.fill_(-1)
        inputs.fill(batch, 8, runner)
        assert torch.equal(inputs.table[:, :3], want)
        assert torch.equal(inputs.table[:, 3:], pads)
        assert torch.equal(inputs.seq_lens[:3], fb.seq_lens)  # the named rows view the table
        table = runner.req_to_token_pool.req_to_token
        assert table[fb.token_req_pool_indices, fb.positions].tolist() == fb.out_cache_loc.tolist()
        assert int((table != 0).sum()) == 3  # nothing else written
        assert batch.input_ids_source is None  # taken in


def test_graph_logits_are_copied_unless_read_at_once(tiny_dirs, monkeypatch):
    """replay() hands out the graph's output buffer only to a caller that reads it before the
    next forward (the engine's sampling); anyone else gets a copy that later replays leave alone."""
    from rollout.cuda_graph_runner import CudaGraphRunner

    monkeypatch.setattr(CudaGraphRunner, "_capture_graphs", eager_graph_capture)
    cfg = dict(device=DEV.type, attention_backend="triton", cuda_graph=False,
               cuda_graph_prefill_tokens=())
    driver = RunnerDriver(tiny_dirs["Qwen2ForCausalLM"], cuda_graph_batch_sizes=(1, 2, 4), **cfg)
    runner = driver.runner.graph_runner = CudaGraphRunner(driver.runner)
    logits = driver.prefill([[1, 2, 3], [4, 5]])
    kept = driver.decode(logits.argmax(-1).tolist())
    before = kept.clone()
    fb = build_batch(ForwardMode.DECODE, driver.rows, [[7], [8]], driver.lens, driver.alloc, DEV)
    fb.logits_read_at_once = True
    transient = driver.forward(fb)
    assert transient.data_ptr() == runner.outputs[2, 0].data_ptr()
    assert transient.dtype == kept.dtype == torch.float32  # a float32 model's head: no cast
    assert torch.equal(kept, before)  # the earlier copy was not overwritten by the replay


def test_bf16_graph_hands_the_sampler_the_heads_logits(tiny_dirs, monkeypatch):
    """A bf16 decode graph's logits stay bf16 for a caller that reads them at once (the
    sampler converts as it loads); anyone else gets float32 copies of the same values. The
    same step (same tokens, positions and KV slots) is run both ways."""
    from rollout.cuda_graph_runner import CudaGraphRunner

    if DEV.type != "cuda":
        monkeypatch.setattr(CudaGraphRunner, "_capture_graphs", eager_graph_capture)
    cfg = dict(device=DEV.type, dtype="bfloat16", attention_backend="triton",
               cuda_graph_batch_sizes=(1, 2, 4))
    if DEV.type != "cuda":  # decode graphs only: the interpreter would run the prefill graphs'
        cfg.update(cuda_graph=False, cuda_graph_prefill_tokens=())
    driver = RunnerDriver(tiny_dirs["Qwen2ForCausalLM"], **cfg)
    if DEV.type != "cuda":
        driver.runner.graph_runner = CudaGraphRunner(driver.runner)
    runner = driver.runner.graph_runner
    logits = driver.prefill([[1, 2, 3], [4, 5]])
    fb = build_batch(ForwardMode.DECODE, driver.rows, [[7], [8]], driver.lens, driver.alloc, DEV)
    copied = driver.forward(fb)
    fb.logits_read_at_once = True
    transient = driver.forward(fb)
    assert runner.num_replays == 2 and logits.dtype == copied.dtype == torch.float32
    assert transient.dtype == torch.bfloat16
    assert transient.data_ptr() == runner.outputs[2, 0].data_ptr()
    assert torch.equal(transient.float(), copied)


# ---- GPU ----------------------------------------------------------------------------------------
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@gpu
@pytest.mark.parametrize("head_dim", [128, 96])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_bf16_backend_matches_torch_native(mode, head_dim):
    lens = [1, 300, 77, 513, 64, 129]
    prefix = [n - 1 for n in lens] if mode.is_decode else [0, 100, 0, 500, 63, 1]
    p = make_paged(lens, prefix, kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16, seed=3)
    triton_out, native_out = backend_outputs(p, mode, heads=8, head_dim=head_dim)
    assert rel_err(triton_out, native_out) <= 1e-2


@gpu
@pytest.mark.parametrize("batch,heads,kv_heads", [(32, 16, 8), (128, 16, 8), (17, 32, 4),
                                                  (32, 32, 4), (64, 32, 4), (128, 32, 4)])
def test_bf16_backend_matches_torch_native_with_qwen3_kv_heads(batch, heads, kv_heads):
    """Qwen3-1.7B's heads (16 query, 8 KV heads of 128) and Qwen3-30B-A3B's (32 / 4): the
    launches the backend picks by requests x KV heads (Qwen3-1.7B: one split of 128-key blocks
    at 32 requests, of 64-key blocks at 128; Qwen3-30B-A3B: four splits of 64-key blocks at
    17 and 32 requests, one split of 128-key blocks at 64, of 64-key blocks at 128) against
    torch_native, ragged contexts of 1-300 keys."""
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 301, (batch,), generator=gen).tolist()
    p = make_paged(lens, [n - 1 for n in lens], kv_heads=kv_heads, head_dim=128,
                   dtype=torch.bfloat16, seed=5)
    triton_out, native_out = backend_outputs(p, ForwardMode.DECODE, heads=heads, head_dim=128)
    assert rel_err(triton_out, native_out) <= 1e-2


def graph_driver(path) -> RunnerDriver:
    return RunnerDriver(path, device="cuda", attention_backend="triton",
                        cuda_graph_batch_sizes=(1, 2, 4, 8))


@gpu
def test_cuda_graph_greedy_matches_eager(tiny_dirs):
    path = tiny_dirs["Qwen3ForCausalLM"]
    graphed = graph_driver(path)
    eager = RunnerDriver(path, device="cuda", attention_backend="triton", cuda_graph=False)
    g_tokens, g_logits = greedy(graphed, GRAPH_PROMPTS, 16)
    e_tokens, e_logits = greedy(eager, GRAPH_PROMPTS, 16)
    assert graphed.runner.graph_runner.num_replays >= 16
    assert g_tokens == e_tokens
    assert (g_logits - e_logits).abs().max().item() <= 1e-3


@gpu
def test_cuda_graph_long_context_class_matches_eager(tiny_dirs):
    """Captured decode graphs of both launch classes: one request whose context passes 257 keys
    mid-decode (the short class's graph, then the long class's: 128-key blocks) and two requests,
    one long, against the eager forward, which launches by the same rule."""
    path = tiny_dirs["Qwen2ForCausalLM"]
    graphed = graph_driver(path)
    runner = graphed.runner.graph_runner
    assert set(runner.graphs) == {(bs, cls) for bs in (1, 2, 4, 8) for cls in (0, 1)}
    eager = RunnerDriver(path, device="cuda", attention_backend="triton", cuda_graph=False)
    for prompts, classes in (([list(range(1, 251))], [0] * 7 + [1] * 5),
                             ([list(range(3, 303)), [5, 6, 7]], [1] * 4)):
        g_logits, e_logits, seen, _ = greedy_both(graphed, eager, prompts, len(classes))
        assert [key[1] for key in seen] == classes
        assert g_logits.argmax(-1).tolist() == e_logits.argmax(-1).tolist()
        assert (g_logits - e_logits).abs().max().item() <= 1e-3


@gpu
def test_prefill_graphs_match_eager_prefill(tiny_dirs):
    """Captured prefill graphs (default sizes) against the eager prefill: one-request prompts of
    ragged lengths, batches of ragged prompts (padded requests and tokens), then decode steps
    over the KV they wrote."""
    path = tiny_dirs["Qwen2ForCausalLM"]
    graphed = graph_driver(path)
    eager = RunnerDriver(path, device="cuda", attention_backend="triton",
                         cuda_graph_batch_sizes=(1, 2, 4, 8), cuda_graph_prefill_tokens=())
    prefill = graphed.runner.graph_runner.prefill
    assert prefill is not None and eager.runner.graph_runner.prefill is None
    batches = [[prompt] for prompt in GRAPH_PROMPTS + [list(range(1, 300))]]
    batches += [GRAPH_PROMPTS, [list(range(1, 300)), [4], list(range(7, 90))],
                [[i % 50 + 1] * (i % 7 + 1) for i in range(70)]]  # 70 requests: the graph of 256
    for prompts in batches:
        replays = prefill.num_replays
        g_tokens, g_logits = greedy(graphed, prompts, 6)
        e_tokens, e_logits = greedy(eager, prompts, 6)
        assert prefill.num_replays == replays + 1
        assert g_tokens == e_tokens
        assert (g_logits - e_logits).abs().max().item() <= 1e-3


@gpu
def test_cuda_graph_after_weight_reload(tiny_dirs, tmp_path):
    """Weights are copied in place, so the captured graphs compute with the new weights."""
    from rollout.tiny_model import TinyModelSpec, make_tiny_model, random_state_dict
    graphed = graph_driver(tiny_dirs["Qwen3ForCausalLM"])
    greedy(graphed, GRAPH_PROMPTS, 2)
    spec = TinyModelSpec(architecture="Qwen3ForCausalLM", seed=11)
    graphed.runner.load_weights(random_state_dict(spec))
    replays = graphed.runner.graph_runner.num_replays
    fresh = RunnerDriver(str(make_tiny_model(tmp_path / "new", spec)), device="cuda",
                         attention_backend="triton", cuda_graph=False)
    g_tokens, g_logits = greedy(graphed, GRAPH_PROMPTS, 8)
    e_tokens, e_logits = greedy(fresh, GRAPH_PROMPTS, 8)
    assert graphed.runner.graph_runner.num_replays > replays
    assert g_tokens == e_tokens
    assert (g_logits - e_logits).abs().max().item() <= 1e-3
