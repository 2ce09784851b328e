"""Spec: rollout/layers/triton_attn_o.py — o of a one-row decode that merges the split-KV
attention's partials itself — equals the attention merge kernel followed by o.

On CPU the kernels run under the Triton interpreter (fp32 and bf16, ragged lengths, splits left
empty by short sequences, NaN in the unwritten scratch): the per-head partials are o's weight
columns of that head times the attention output of `decode_attention` (the merge kernel's,
rounded to the dtype: bit for bit the same inputs), up to fp32 summation order. On a GPU
(`gpu`): a Qwen2-1.5B-shaped model's decode at one row, eager and in the decode graph, against
the same model with the merge kernel and the one-row GEMV (ROLLOUT_ATTN_O_MERGE=0)."""
import pytest
import torch

pytest.importorskip("triton")

from rollout.attention.base import DecodePartials  # noqa: E402
from rollout.attention.triton_kernels import decode  # noqa: E402
from rollout.layers import triton_attn_o  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402
from tests.test_triton_kernels import make_paged  # noqa: E402

require_runnable_triton(triton_attn_o._merge_o_kernel)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _attention(seq_len: int, splits: int, dtype: torch.dtype, seed: int = 0):
    """(DecodePartials of one query row over a random paged cache, that row's merged output from
    `decode_attention`)."""
    p = make_paged([seq_len], [seq_len - 1], KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1)
                    ).to(DEV, dtype)
    lens, scale, cfg = torch.tensor([seq_len], device=DEV), HEAD_DIM ** -0.5, decode.DecodeConfig(splits)
    # NaN scratch: splits a short sequence leaves empty must weigh nothing
    scratch = [t.fill_(float("nan")) for t in decode.decode_buffers(1, HEADS, HEAD_DIM, splits, DEV)]
    parts = decode.decode_partials(q, p.k, p.v, p.req_to_token, p.rows, lens, scale, cfg, scratch)
    merged = decode.decode_attention(q, p.k, p.v, p.req_to_token, p.rows, lens, scale, cfg)
    return DecodePartials(*parts, lens), merged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len,splits", [(3, 4), (37, 4), (37, 2), (64, 3)])
@pytest.mark.parametrize("config", [triton_attn_o.MergeOConfig(16, 2),
                                    triton_attn_o.MergeOConfig(64, 4)])
def test_equals_the_merge_kernel_then_o(dtype, seq_len, splits, config):
    n = 40  # not a multiple of block_n: masked columns
    attn, merged = _attention(seq_len, splits, dtype)
    w = torch.randn(n, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(7)).to(DEV, dtype)
    got = triton_attn_o.merge_o(attn, w, config)
    assert got.partials.shape == (HEADS, 1, n) and got.out.dtype == dtype
    x = merged.reshape(HEADS, HEAD_DIM).double()  # the merge kernel's rounded output
    per_head = torch.einsum("hd,nhd->hn", x, w.double().view(n, HEADS, HEAD_DIM))
    assert torch.allclose(got.partials[:, 0].double(), per_head, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got.tensor().double(), per_head.sum(0, keepdim=True),
                          rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


def test_bad_inputs_are_refused():
    attn, _ = _attention(9, 2, torch.float32)
    w = torch.randn(8, HEADS * HEAD_DIM, device=DEV)
    with pytest.raises(ValueError, match="do not fit"):
        triton_attn_o.merge_o(attn, w[:, :-1])
    two_rows = DecodePartials(attn.part_o.expand(2, -1, -1, -1), attn.part_lse.expand(2, -1, -1),
                              attn.seq_lens.expand(2))
    with pytest.raises(ValueError, match="do not fit"):
        triton_attn_o.merge_o(two_rows, w)
    kv = torch.zeros(5, KV_HEADS, HEAD_DIM, device=DEV)
    with pytest.raises(ValueError, match="two splits"):
        decode.decode_partials(torch.zeros(1, HEADS, HEAD_DIM, device=DEV), kv, kv, None, None,
                               None, 1.0, decode.DecodeConfig(1))


def test_env_config(monkeypatch):
    for spec, want in (("1", triton_attn_o.MergeOConfig()), ("0", None),
                       ("32,4", triton_attn_o.MergeOConfig(32, 4))):
        monkeypatch.setenv("ROLLOUT_ATTN_O_MERGE", spec)
        assert triton_attn_o.config_from_env() == want
    for bad in ("yes", "24,4", "16"):
        monkeypatch.setenv("ROLLOUT_ATTN_O_MERGE", bad)
        with pytest.raises(ValueError, match="ROLLOUT_ATTN_O_MERGE"):
            triton_attn_o.config_from_env()


@gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_model_decode_with_and_without_the_merge_in_o(tmp_path, monkeypatch, graph):
    """A model with Qwen2-1.5B's shapes (random bf16 weights, two layers): its one-row decode
    logits, eager and from the decode CUDA graph, match those with the merge kernel and the
    one-row GEMV within bf16 rounding (o's sums run in another order) with the same argmax,
    and the merging o ran."""
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    from tests.test_split_sum import decode_logits
    spec = TinyModelSpec(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, dtype="bfloat16")
    path = str(make_tiny_model(tmp_path / "m", spec))
    calls, real = [], triton_attn_o.merge_o
    monkeypatch.setattr(triton_attn_o, "merge_o", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(triton_attn_o, "ENV_CONFIG", triton_attn_o.MergeOConfig())
    merged = decode_logits(path, 1, graph).float()
    assert calls, "the merging o never ran"
    monkeypatch.setattr(triton_attn_o, "ENV_CONFIG", None)
    plain = decode_logits(path, 1, graph).float()
    assert (merged - plain).abs().max().item() <= 0.05 * plain.abs().max().item()
    assert torch.equal(merged.argmax(-1), plain.argmax(-1))
