"""The Gluon decode attention (rollout/attention/triton_kernels/decode_gluon.py, experimental):
on a GPU only — Gluon does not run under the CPU interpreter. Oracle: softmax attention in
float64 on the gathered keys, and the Triton one-split kernel it would replace; contexts shorter
and longer than its ring; in a CUDA graph under PDL after the kernel that writes the new key
(its slot poisoned before every replay), every replay the bits of the launch without PDL."""
import pytest
import torch

pytest.importorskip("triton")

from tests.helpers import DEV, gpu  # noqa: E402
from tests.test_triton_kernels import make_paged, reference  # noqa: E402

CONFIGS = [(32, 6, 4), (64, 3, 4), (32, 4, 4), (64, 2, 4), (16, 8, 4), (32, 6, 8)]


def _case(batch: int, lo: int, hi: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    p = make_paged(lens, [n - 1 for n in lens], kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                   seed=seed)
    q = torch.randn(batch, 12, 128, generator=gen).to(DEV, torch.bfloat16)
    return p, q, torch.tensor(lens, device=DEV)


@gpu
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("keys", [(1, 300), (129, 256), (900, 1100)])
def test_gluon_decode_matches_reference(cfg, keys):
    from rollout.attention.triton_kernels import decode, decode_gluon
    config = decode_gluon.GluonDecodeConfig(*cfg)
    p, q, lens = _case(96, *keys, seed=sum(cfg) + keys[0])
    scale = 128 ** -0.5
    out = torch.empty_like(q)
    decode_gluon.decode_attention_gluon(q, p.k, p.v, p.req_to_token, p.rows, lens, scale, out,
                                        6, config)
    expected = torch.cat([reference(q[b:b + 1], p, b, scale) for b in range(q.shape[0])])
    assert not out.isnan().any()
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() <= 1e-2
    triton_out = decode.decode_attention(q, p.k, p.v, p.req_to_token, p.rows, lens, scale,
                                         decode.DecodeConfig(1, 128, 4, 2, True))
    assert torch.allclose(out.float(), triton_out.float(), rtol=3e-2, atol=3e-2)


@gpu
@pytest.mark.parametrize("cfg", [(32, 6, 4), (32, 4, 4)])
def test_gluon_decode_after_the_kernel_that_writes_the_new_key(monkeypatch, cfg):
    from rollout import pdl_policy, triton_pdl
    from rollout.attention.triton_kernels import decode_gluon
    from rollout.layers import triton_ops
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    config = decode_gluon.GluonDecodeConfig(*cfg)
    p, _, lens = _case(128, 1, 300, seed=4)
    gen = torch.Generator().manual_seed(5)
    new_slots = torch.stack([p.slots(b)[-1] for b in range(128)])
    qk_in = torch.randn(128, 14, 128, generator=gen).to(DEV, torch.bfloat16)
    v_new = torch.randn(128, 2, 128, generator=gen).to(DEV, torch.bfloat16)
    cos, sin = (torch.rand(128, 1, 64, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    qk, out = qk_in.clone(), torch.empty(128, 12, 128, device=DEV, dtype=torch.bfloat16)

    def step():
        p.k.index_fill_(0, new_slots, float("nan"))
        p.v.index_fill_(0, new_slots, float("nan"))
        qk.copy_(qk_in)
        triton_ops.apply_rotary_inplace(qk, cos, sin, triton_ops.KVStore(v_new, new_slots, p.k, p.v))
        decode_gluon.decode_attention_gluon(qk[:, :12], p.k, p.v, p.req_to_token, p.rows, lens,
                                            0.088, out, 6, config)

    assert triton_pdl.enabled()
    with pdl_policy.decode_forward():  # the early trigger, as in the engine's decode graphs
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
