"""Spec: the forward's first kernel on a GPU (rollout/layers/triton_embed.py) gathers exactly
what the vocab embedding and `RotaryEmbedding.lookup` gather — the token's embedding row and the
position's cos/sin rows, bit for bit, as views of the same shapes. On CPU under the Triton
interpreter (fp32 and bf16 tables); on a GPU, bf16."""
import pytest
import torch

pytest.importorskip("triton")

from rollout.layers import triton_embed  # noqa: E402
from rollout.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.helpers import DEV, require_runnable_triton  # noqa: E402

require_runnable_triton(triton_embed._embed_rope_kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,head_dim,tokens", [(64, 16, 1), (96, 24, 7), (1536, 128, 3)])
def test_embed_and_rope_equals_the_two_gathers(dtype, hidden, head_dim, tokens):
    g = torch.Generator().manual_seed(tokens)
    weight = torch.randn(300, hidden, generator=g).to(dtype=dtype, device=DEV)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0).to(DEV)
    ids = torch.randint(0, 300, (tokens,), generator=g).to(DEV)
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEV)
    h, (cos, sin) = triton_embed.embed_and_rope(ids, positions, weight, rotary.half_table(dtype))
    want_cos, want_sin = rotary.lookup(positions, dtype)
    assert torch.equal(h, weight[ids])
    for got, want in ((cos, want_cos), (sin, want_sin)):
        assert got.shape == want.shape == (tokens, 1, head_dim // 2) and got.dtype == dtype
        assert torch.equal(got, want)


def test_embed_and_rope_refuses_strided_ids():
    weight = torch.zeros(10, 64, device=DEV)
    table = RotaryEmbedding(16, 32, 10000.0).to(DEV).half_table(torch.float32)
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEV)[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        triton_embed.embed_and_rope(ids, torch.zeros(4, dtype=torch.int64, device=DEV), weight, table)
