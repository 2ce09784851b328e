"""Spec: rollout/triton_sampler.py draws what the torch sampler draws (no filter, any
temperature, greedy rows), row by row whatever the batch, with the logprob of the drawn token
under softmax(logits / T) within 1e-5; on a GPU its frequencies match softmax (chi-square).

On CPU the kernels run under the Triton interpreter (fp32, tests/conftest.py); both paths invert the same CDF in
vocabulary order with float64 sums, summed in another order, so a draw could differ only where
u * total falls within rounding of a token boundary (not on these rows)."""
import pytest
import torch

pytest.importorskip("triton")

from scipy.stats import chisquare  # noqa: E402

from rollout import triton_sampler  # noqa: E402
from rollout.sampler import sample  # noqa: E402
from rollout.sampling_info import SamplingBatchInfo  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402

require_runnable_triton(triton_sampler._pick)

VOCAB = 2 * triton_sampler.CHUNK + 700  # three chunks, the last one partial
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
          SamplingParams(temperature=0.0), SamplingParams(temperature=1.3),
          SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)]


def _info(params, seeds, positions, device):
    return SamplingBatchInfo.build(params, seeds, positions, VOCAB, device)


def _fused(logits, info):
    return triton_sampler.sample_unfiltered(logits.to(DEV), info.temperatures, info.greedy,
                                            info.uniforms)


def _torch_path(logits, params, seeds, positions):
    return sample(logits, _info(params, seeds, positions, torch.device("cpu")))


def test_fused_sampler_draws_what_the_torch_sampler_draws():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS) * 4, VOCAB, generator=gen) * 3.0
    params = PARAMS * 4
    seeds, positions = list(range(100, 100 + len(params))), [7 + i for i in range(len(params))]
    want = _torch_path(logits, params, seeds, positions)
    tokens, logprobs, pack = _fused(logits, _info(params, seeds, positions, DEV))
    assert torch.equal(tokens.cpu(), want.tokens)
    assert torch.allclose(logprobs.cpu(), want.logprobs, atol=1e-5, rtol=0)
    # the host copy's [2, B] float64: exactly the tokens and the logprobs
    assert pack.dtype == torch.float64 and pack.shape == (2, len(params))
    assert torch.equal(pack.cpu(), torch.stack((tokens.double(), logprobs.double())).cpu())
    greedy = torch.tensor([p.is_greedy for p in params])
    assert torch.equal(tokens.cpu()[greedy], logits[greedy].argmax(-1))


def test_fused_sampler_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 2.0
    seeds, positions = [5, 6, 7, 8, 9, 10], [3] * len(PARAMS)
    batch = _fused(logits, _info(PARAMS, seeds, positions, DEV))
    alone = _fused(logits[3:4], _info(PARAMS[3:4], seeds[3:4], positions[3:4], DEV))
    assert batch[0][3] == alone[0][0] and batch[1][3] == alone[1][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_sample_as_their_float32_values(dtype):
    """A decode graph hands the sampler the LM head's bf16/fp16 logits: both samplers draw what
    they draw from those values cast to float32, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(len(PARAMS), VOCAB, generator=gen) * 3.0).to(dtype)
    seeds, positions = [21, 22, 23, 24, 25, 26], [9] * len(PARAMS)
    info = _info(PARAMS, seeds, positions, DEV)
    half, full = _fused(logits, info), _fused(logits.float(), info)
    for a, b in zip(half, full):
        assert torch.equal(a, b)
    want = _torch_path(logits.float(), PARAMS, seeds, positions)
    got = _torch_path(logits, PARAMS, seeds, positions)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)


@gpu
def test_fused_sampler_frequencies_match_softmax():
    vocab, draws = 3000, 60_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 1.5
    params = [SamplingParams(temperature=0.8)] * draws
    info = SamplingBatchInfo.build(params, list(range(draws)), [11] * draws, vocab, DEV)
    tokens, logprobs, _ = triton_sampler.sample_unfiltered(
        logits.to(DEV).expand(draws, vocab).contiguous(), info.temperatures, info.greedy, info.uniforms)
    probs = torch.softmax(logits.double() / 0.8, -1)
    expected = probs * draws
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    top = expected > 5  # chi-square over the likely tokens, the tail pooled
    obs = torch.cat((counts[top], counts[~top].sum().view(1))).numpy()
    exp = torch.cat((expected[top], expected[~top].sum().view(1))).numpy()
    assert chisquare(obs, exp).pvalue > 1e-3
    assert torch.allclose(logprobs.cpu().double(), probs.log()[tokens.cpu()], atol=1e-5, rtol=0)
