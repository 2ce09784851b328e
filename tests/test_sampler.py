"""Spec for the sampler: empirical frequencies match the top-k → top-p → min-p filtered
distribution (chi-square), draws depend only on (seed, position)."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rollout.random_stream import uniform_from
from rollout.sampler import sample
from rollout.sampling_info import SamplingBatchInfo
from rollout.sampling_params import SamplingParams

VOCAB = 24


def reference_distribution(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Independent, sequential definition: temperature, then top-k, then top-p over the
    renormalised survivors, then min-p relative to the most likely survivor."""
    p = torch.softmax(logits.double() / sp.temperature, -1)
    order = sorted(range(len(p)), key=lambda i: -p[i].item())
    keep = order[: sp.top_k] if sp.top_k > 0 else order
    total, kept, acc = sum(p[i].item() for i in keep), [], 0.0
    for i in keep:
        if acc >= sp.top_p:
            break
        kept.append(i)
        acc += p[i].item() / total
    top = p[kept[0]].item()
    kept = [i for i in kept if p[i].item() >= sp.min_p * top]
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=8),
    SamplingParams(temperature=1.3, top_p=0.75),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.85, min_p=0.05),
]


@pytest.mark.parametrize("sp", CASES, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}-m{s.min_p}")
def test_frequencies_match_filtered_distribution(sp):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 1.5
    draws = 40_000
    info = SamplingBatchInfo.build([sp] * draws, list(range(draws)), [17] * draws, VOCAB, torch.device("cpu"))
    tokens = sample(logits.expand(draws, VOCAB).contiguous(), info).tokens
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = reference_distribution(logits, sp) * draws
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    assert chisquare(counts[support].numpy(), expected[support].numpy()).pvalue > 1e-3


def test_uniforms_are_uniform_and_pure():
    seeds, pos = np.arange(-25_000, 25_000), np.full(50_000, 3)
    u = uniform_from(seeds, pos)
    assert 0.0 <= u.min() and u.max() < 1.0
    counts, _ = np.histogram(u, bins=20, range=(0, 1))
    assert chisquare(counts).pvalue > 1e-3
    assert np.array_equal(uniform_from(seeds[7:9], pos[7:9]), u[7:9])
    assert not np.array_equal(uniform_from(seeds, pos + 1), u)


def test_uniforms_are_splitmix64():
    """The stream is splitmix64 (reference: its published finaliser, Python ints mod 2^64)."""
    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & (2**64 - 1)
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return x ^ (x >> 31)
    for seed, pos in [(0, 0), (1, 17), (-5, 2**40), (2**63 - 1, 7)]:
        want = (mix(mix(seed % 2**64) ^ pos) >> 11) * 2.0 ** -53
        assert uniform_from([seed], [pos])[0] == want


def test_greedy_rows_take_argmax_and_report_t1_logprob():
    logits = torch.randn(3, VOCAB)
    sps = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=0.0)]
    info = SamplingBatchInfo.build(sps, [0, 1, 2], [0, 0, 0], VOCAB, torch.device("cpu"))
    out = sample(logits, info)
    assert out.tokens[0] == logits[0].argmax() and out.tokens[2] == logits[2].argmax()
    assert torch.allclose(out.logprobs[0], torch.log_softmax(logits[0], -1)[out.tokens[0]])
    assert torch.allclose(out.logprobs[1], torch.log_softmax(logits[1] / 0.5, -1)[out.tokens[1]])


def test_unfiltered_rows_draw_the_same_whatever_the_other_rows_filter():
    """Batch invariance: a plain row's draw must not change when a top-k row joins the batch."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)).expand(200, VOCAB)
    plain = [SamplingParams(temperature=1.0)] * 200
    cpu = torch.device("cpu")
    alone = sample(logits.contiguous(), SamplingBatchInfo.build(plain, range(200), [5] * 200, VOCAB, cpu))
    mixed_logits = torch.cat((logits, logits[:1])).contiguous()
    info = SamplingBatchInfo.build(plain + [SamplingParams(top_k=3)], range(201), [5] * 201, VOCAB, cpu)
    assert torch.equal(sample(mixed_logits, info).tokens[:200], alone.tokens)


def test_cpu_scan_buffer_made_under_inference_mode_serves_outside_it():
    """The CPU inverse CDF scans in a per-thread buffer that grows on demand. Grown inside
    torch.inference_mode (the engine's step), it must stay writable outside it (a direct call,
    a trainer's own sampling), and give the same draws there."""
    from rollout.sampler import _cpu_scratch, inverse_cdf
    _cpu_scratch.cdf = None
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(8, 300, generator=g), -1)
    u = torch.rand(8, generator=g, dtype=torch.float64)
    with torch.inference_mode():
        inside = inverse_cdf(torch.softmax(torch.randn(16, 400, generator=g), -1),
                             torch.rand(16, generator=g, dtype=torch.float64))
        assert inside.shape == (16, 1)
        again = inverse_cdf(probs, u)
    assert torch.equal(inverse_cdf(probs, u), again)


def test_blocked_inverse_cdf_equals_the_flat_one():
    """The GPU's two-level inverse CDF picks the token the full float64 prefix sum picks, for
    peaked and flat rows, zeros (filtered tokens), a vocabulary that is not a multiple of the
    block, and uniforms at the edges."""
    from rollout.sampler import inverse_cdf, inverse_cdf_blocked
    g = torch.Generator().manual_seed(0)
    vocab = 3 * 1024 + 77
    logits = torch.randn(64, vocab, generator=g) * torch.linspace(0.1, 8, 64).view(-1, 1)
    probs = torch.softmax(logits, -1)
    probs[::3] *= (torch.rand(probs[::3].shape, generator=g) > 0.5)  # filtered-out tokens
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2.0 ** -53
    flat, blocked = inverse_cdf(probs, u), inverse_cdf_blocked(probs, u)
    assert blocked.shape == flat.shape == (64, 1)
    assert torch.equal(blocked, flat)


def test_batch_info_rows_hold_their_own_params():
    """Rows sharing one SamplingParams object (a call's prompts usually do) and rows of their
    own give each row its params, in the dtypes the sampler reads."""
    greedy_k = SamplingParams(temperature=0.0, top_k=5)
    warm = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1, logprobs=2)
    for params in ([greedy_k] * 3, [warm] * 3, [greedy_k, warm, greedy_k]):
        info = SamplingBatchInfo.build(params, [1, 2, 3], [4, 5, 6], VOCAB, torch.device("cpu"))
        assert info.top_ks.dtype == torch.int64 and info.greedy.dtype == torch.bool
        assert info.temperatures.dtype == info.top_ps.dtype == info.min_ps.dtype == torch.float32
        assert info.uniforms.dtype == torch.float64
        assert info.top_ks.tolist() == [p.top_k if p.top_k > 0 else VOCAB for p in params]
        assert info.greedy.tolist() == [p.is_greedy for p in params]
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32).tolist()  # noqa: E731
        assert info.temperatures.tolist() == f32([p.temperature or 1.0 for p in params])
        assert info.top_ps.tolist() == f32([p.top_p for p in params])
        assert info.min_ps.tolist() == f32([p.min_p for p in params])
        assert info.uniforms.tolist() == uniform_from([1, 2, 3], [4, 5, 6]).tolist()
        assert info.all_greedy == all(p.is_greedy for p in params)
        assert info.max_top_logprobs == max(p.logprobs for p in params)


@pytest.mark.parametrize("rows", [0, 1, 3, 64])
def test_packed_sampling_tensors_viewed_after_the_copy_equal_the_host_ones(rows):
    """Off the CPU the tensors are views of the one copied byte array: the same values as the
    host views, each field at a 16-byte-aligned offset."""
    from rollout.sampling_info import _layout, _packed_views
    host = np.zeros(_layout(rows)[0], dtype=np.uint8)
    fields = _packed_views(host, rows)
    rng = np.random.default_rng(rows)
    for name, view in fields.items():
        view[:] = rng.integers(0, 2, rows) if name == "greedy" else rng.integers(1, 100, rows)
    copied = torch.from_numpy(host.copy())
    for name, t in _packed_views(copied, rows).items():
        assert torch.equal(t, torch.from_numpy(fields[name])), name
        assert (t.data_ptr() - copied.data_ptr()) % 16 == 0, name
