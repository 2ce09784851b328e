"""Spec for the MoE kernels (`rollout.layers.triton_moe`: few tokens, and sorted blocks) against
the torch forms of
`rollout.layers.moe` (the routing of `SparseMoE.route`, the experts of `moe_experts`): under the
CPU interpreter in fp32 (and bf16, within its rounding), and on a GPU at Qwen3-30B-A3B's
layer shape in bf16."""
import pytest
import torch

from rollout.config import MoEConfig
from rollout.layers import triton_moe
from rollout.layers.moe import SparseMoE, moe_experts
from tests.helpers import DEV, gpu, require_runnable_triton

require_runnable_triton(triton_moe._route_kernel)


def _layer(experts, top_k, hidden, width, renorm, dtype, seed=0):
    torch.manual_seed(seed)
    layer = SparseMoE(MoEConfig(experts, top_k, width, renorm, frozenset({0})), hidden)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randn(experts, hidden) * 0.3)
        layer.experts.gate_up_proj.copy_(torch.randn(experts, 2 * width, hidden) * 0.05)
        layer.experts.down_proj.copy_(torch.randn(experts, hidden, width) * 0.05)
    return layer.to(DEV, dtype)


def _both(layer, x):
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
    want_w, want_ids = layer.route(x)
    logits = torch.nn.functional.linear(x, layer.gate.weight)
    got_w, got_ids = triton_moe.route(logits, layer.cfg.top_k, layer.cfg.norm_topk_prob, x.dtype)
    want = moe_experts(x, want_w, want_ids, gate_up, down)
    got = triton_moe.experts(x, got_w, got_ids, gate_up, down)
    return (got_w, got_ids, got), (want_w, want_ids, want)


@pytest.mark.parametrize("experts,top_k,hidden,width,tokens,renorm", [
    (8, 2, 64, 32, 1, True), (8, 2, 64, 32, 5, False), (6, 3, 48, 20, 3, True),
    (16, 4, 96, 24, 8, True)])
def test_fp32_equals_the_torch_forms(experts, top_k, hidden, width, tokens, renorm):
    layer = _layer(experts, top_k, hidden, width, renorm, torch.float32)
    x = torch.randn(tokens, hidden, device=DEV)
    (got_w, got_ids, got), (want_w, want_ids, want) = _both(layer, x)
    assert torch.equal(got_ids.long(), want_ids)  # ties are measure-zero with random logits
    assert torch.allclose(got_w, want_w, atol=1e-6, rtol=1e-5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_bf16_within_rounding():
    layer = _layer(8, 2, 64, 32, True, torch.bfloat16)
    x = torch.randn(4, 64, device=DEV).bfloat16()
    (got_w, got_ids, got), (want_w, want_ids, want) = _both(layer, x)
    assert torch.equal(got_ids.long(), want_ids)
    assert (got_w.float() - want_w.float()).abs().max() <= 2 ** -8
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_routing_nan_logits_still_names_real_experts():
    """A CUDA graph's padded rows may hold NaN before their first write: their ids must stay
    in range (the sorted-blocks form scatters by them)."""
    logits = torch.randn(3, 8, device=DEV)
    logits[1] = float("nan")
    logits[2, :4] = float("nan")
    weights, ids = triton_moe.route(logits, 3, True, torch.float32)
    assert ((ids >= 0) & (ids < 8)).all() and (ids.sort(-1).values.diff(dim=-1) > 0).all()
    assert torch.equal(ids[0].long(), torch.topk(torch.softmax(logits[0], -1), 3).indices)


def test_routing_kernel_records_ids_at_the_slots():
    """Routing replay on the decode path: the routing kernel writes each token's ids (int16) at
    its KV slot of the layer's record, and nothing else; a record that does not fit is refused."""
    from rollout.routing_record import RoutingPool
    logits = torch.randn(4, 8, device=DEV)
    pool = RoutingPool(2, 16, 3, DEV)
    pool.ids.fill_(-1)
    loc = torch.tensor([5, 0, 11, 7], device=DEV)
    _, ids = triton_moe.route(logits, 3, True, torch.float32, (pool.layer(1), loc))
    want = torch.full((2, 16, 3), -1, dtype=torch.int16, device=DEV)
    want[1, loc] = ids.to(torch.int16)
    assert torch.equal(pool.ids, want)
    # slots out of range (a compile-ahead dry forward's garbage inputs) are not written
    _, ids = triton_moe.route(logits, 3, True, torch.float32,
                              (pool.layer(0), torch.tensor([99, -3, 2, 16], device=DEV)))
    want[0, 2] = ids[2].to(torch.int16)
    assert torch.equal(pool.ids, want)
    with pytest.raises(ValueError, match="routing record"):
        triton_moe.route(logits, 3, True, torch.float32, (pool.layer(1), loc[:3]))


def test_experts_kernels_clamp_ids_out_of_range():
    """A compile-ahead dry forward may hand the expert kernels an unwritten ids buffer: ids out
    of range read the nearest real expert instead of memory past the weights."""
    layer = _layer(8, 2, 64, 32, True, torch.float32)
    x = torch.randn(3, 64, device=DEV)
    weights, _ = layer.route(x)
    garbage = torch.tensor([[-5, 3], [8, 1 << 30], [2, -1]], device=DEV, dtype=torch.int32)
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
    got = triton_moe.experts(x, weights, garbage, gate_up, down)
    want = triton_moe.experts(x, weights, garbage.clamp(0, 7), gate_up, down)
    assert torch.equal(got, want)


def test_align_blocks_groups_every_pair_once():
    torch.manual_seed(3)
    experts, top_k, tokens, bm = 6, 2, 11, 4
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    rows, block_expert = triton_moe.align_blocks(ids, experts, bm)
    pairs = tokens * top_k
    real = rows[rows < pairs].long()
    assert sorted(real.tolist()) == list(range(pairs))  # each pair once, the rest the sentinel
    assert rows.numel() == block_expert.numel() * bm
    flat = ids.reshape(-1).long()
    for b, e in enumerate(block_expert.tolist()):
        block = rows[b * bm:(b + 1) * bm].long()
        block = block[block < pairs]
        if e == experts:  # past the last expert's blocks: empty
            assert block.numel() == 0
        else:
            assert block.numel() > 0 and (flat[block] == e).all()
    assert (block_expert == experts).sum() > 0


# 16-bit under the interpreter in fp16: its tl.dot of bf16 tiles returns garbage (triton 3.9's
# interpreter; bf16 is the GPU spec's)
@pytest.mark.parametrize("dtype,tokens", [(torch.float32, 5), (torch.float32, 20),
                                          (torch.float16, 12)])
def test_sorted_blocks_equal_the_torch_form(monkeypatch, dtype, tokens):
    monkeypatch.setattr(triton_moe, "BLOCK_CONFIG", (16, 16, 16, 16, 16, 4, 2))
    layer = _layer(8, 2, 48, 40, True, dtype)  # widths not multiples of the tiles: masks
    x = torch.randn(tokens, 48, device=DEV).to(dtype)
    weights, ids = layer.route(x)
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
    got = triton_moe.experts_blocked(x, weights, ids, gate_up, down)
    want = moe_experts(x, weights, ids, gate_up, down)
    tol = 1e-5 if dtype == torch.float32 else 0.02 * want.abs().max().item()
    assert (got - want).abs().max() <= tol


@gpu
def test_gpu_sorted_blocks_at_the_30b_a3b_layer_shape():
    layer = _layer(128, 8, 2048, 768, True, torch.bfloat16, seed=2)
    for tokens in (17, 64, 128):
        x = torch.randn(tokens, 2048, device=DEV).bfloat16()
        weights, ids = layer.route(x)
        gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
        got = triton_moe.experts_blocked(x, weights, ids, gate_up, down)
        want = moe_experts(x, weights, ids, gate_up, down)
        assert (got - want).abs().max() <= 0.01 * want.abs().max()


@gpu
def test_gpu_bf16_at_the_30b_a3b_layer_shape():
    layer = _layer(128, 8, 2048, 768, True, torch.bfloat16, seed=1)
    for tokens in (1, 3, 8):
        x = torch.randn(tokens, 2048, device=DEV).bfloat16()
        (got_w, got_ids, got), (want_w, want_ids, want) = _both(layer, x)
        # bf16 router logits tie often among 128 experts: the kernel takes the lowest of tied
        # experts, torch.topk any of them. The chosen probabilities must agree; the outputs
        # wherever the chosen experts do.
        probs = torch.softmax(torch.nn.functional.linear(x, layer.gate.weight).float(), -1)
        chosen = lambda ids: probs.gather(1, ids.long()).sort(-1).values  # noqa: E731
        assert torch.equal(chosen(got_ids), chosen(want_ids))
        same = (got_ids.long().sort(-1).values == want_ids.sort(-1).values).all(-1)
        assert same.any()
        assert (got[same] - want[same]).abs().max() <= 0.01 * want[same].abs().max()
