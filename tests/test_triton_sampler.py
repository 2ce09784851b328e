"""Spec: rollout/triton_sampler.py draws what the torch sampler draws (no filter, any
temperature, greedy rows), row by row whatever the batch, with the logprob of the drawn token
under softmax(logits / T) within 1e-5; on a GPU its frequencies match softmax (chi-square).
Every launch shape meets it (chunks a statistics program, warps: ROLLOUT_SAMPLER_LAUNCH).

On CPU the kernels run under the Triton interpreter (fp32, tests/conftest.py); both paths invert the same CDF in
vocabulary order with float64 sums, summed in another order, so a draw could differ only where
u * total falls within rounding of a token boundary (not on these rows)."""
import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

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


# the default launch, the one of large batches (the vocabulary's 3 chunks in one program, a 4th
# past its end) and one whose second statistics program holds the partial chunk and one past
launches = pytest.mark.parametrize("launch", [triton_sampler.SamplerLaunch(),
                                              triton_sampler.MANY_ROWS_LAUNCH,
                                              triton_sampler.SamplerLaunch(2, 4, 2)],
                                   ids=["default", "many-rows", "two-chunks-a-program"])


def _info(params, seeds, positions, device):
    return SamplingBatchInfo.build(params, seeds, positions, VOCAB, device)


def _fused(logits, info, launch):
    return triton_sampler.sample_unfiltered(logits.to(DEV), info.temperatures, info.greedy,
                                            info.uniforms, launch)


def _torch_path(logits, params, seeds, positions):
    return sample(logits, _info(params, seeds, positions, torch.device("cpu")))


def _assert_draws_as_torch(logits, params, seeds, positions, launch):
    """Equal tokens, logprobs within 1e-5, greedy rows on the first argmax; the host pack exact."""
    want = _torch_path(logits, params, seeds, positions)
    tokens, logprobs, pack = _fused(logits, _info(params, seeds, positions, DEV), launch)
    assert torch.equal(tokens.cpu(), want.tokens)
    assert torch.allclose(logprobs.cpu(), want.logprobs, atol=1e-5, rtol=0)
    # the host copy's [2, B] float64: exactly the tokens and the logprobs
    assert pack.dtype == torch.float64 and pack.shape == (2, len(params))
    assert torch.equal(pack.cpu(), torch.stack((tokens.double(), logprobs.double())).cpu())
    greedy = torch.tensor([p.is_greedy for p in params])
    assert torch.equal(tokens.cpu()[greedy], logits[greedy].argmax(-1))


@launches
def test_fused_sampler_draws_what_the_torch_sampler_draws(launch):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS) * 4, VOCAB, generator=gen) * 3.0
    params = PARAMS * 4
    seeds, positions = list(range(100, 100 + len(params))), [7 + i for i in range(len(params))]
    _assert_draws_as_torch(logits, params, seeds, positions, launch)


def test_unit_temperature_shortcut_changes_nothing():
    """Every row at T = 1 (greedy rows too: their T is 1): skipping the division draws the same
    tokens with the same logprobs bit for bit, and the sampler takes the shortcut from the
    batch's flag."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(8, VOCAB, generator=gen) * 3.0).to(DEV)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)] * 4
    info = _info(params, list(range(8)), [5] * 8, DEV)
    assert info.all_temperature_one
    plain, short = (triton_sampler.sample_unfiltered(logits, info.temperatures, info.greedy,
                                                     info.uniforms, unit_temperature=unit)
                    for unit in (False, True))
    for a, b in zip(plain, short):
        assert torch.equal(a, b)
    assert torch.equal(sample(logits, info).tokens, plain[0])


def test_per_row_unit_temperature_changes_nothing():
    """A captured step's sampler (`step_graphs`) checks each row's T: rows at T = 1 skip the
    division, the others divide; every token, logprob and host-pack value is the dividing
    launch's, bit for bit, at any mix of temperatures and greedy rows."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(len(PARAMS) * 2, VOCAB, generator=gen) * 3.0).to(DEV)
    info = _info(PARAMS * 2, list(range(len(PARAMS) * 2)), [9] * (len(PARAMS) * 2), DEV)
    assert not info.all_temperature_one
    divide, per_row = (triton_sampler.sample_unfiltered(logits, info.temperatures, info.greedy,
                                                        info.uniforms, unit_temperature=mode)
                       for mode in (triton_sampler.DIVIDE, triton_sampler.UNIT_T_PER_ROW))
    for a, b in zip(divide, per_row):
        assert torch.equal(a, b)


FIRST, MIDDLE, LAST = (slice(i * triton_sampler.CHUNK, (i + 1) * triton_sampler.CHUNK) for i in range(3))


def _chunk_maxima_far_apart(x, shape):
    """x [rows, VOCAB] with its chunks' maxima set far apart, as `shape` says."""
    if shape == "middle":  # one chunk holds the mass
        x[:, MIDDLE] += 40.0
    elif shape == "last":  # the partial one
        x[:, LAST] += 40.0
    elif shape == "spike":  # one token
        x[:, MIDDLE.start + 99] += 40.0
    elif shape == "steps":
        x[:, FIRST] -= 30.0
        x[:, MIDDLE] += 15.0
    elif shape == "ties":  # eight tokens within 0.21 of the max (a draw at T = 0.05); the max twice
        x[:, MIDDLE] += 40.0
        top = x[:, MIDDLE].amax(-1, keepdim=True)
        x[:, MIDDLE.start + 100:MIDDLE.start + 500:50] = top - 0.03 * torch.arange(8)
        x[:, -1:] = top
    else:  # "-inf": a chunk of -inf logits only
        x[:, FIRST] = float("-inf")
    return x


def _far_apart_rows():
    """Three rows of each shape at each temperature, down to 0.05, where exp(m_c - m) underflows
    float32 for most chunks (and float64 after a +40 shift), and greedy."""
    gen = torch.Generator().manual_seed(4)
    logits, params = [], []
    for t in (1.0, 0.5, 0.05, 0.0):
        for shape in ("middle", "last", "spike", "steps", "ties", "-inf"):
            logits.append(_chunk_maxima_far_apart(torch.randn(3, VOCAB, generator=gen) * 3.0, shape))
            params += [SamplingParams(temperature=t)] * 3
    return torch.cat(logits), params


@launches
def test_fused_sampler_draws_as_torch_with_chunk_maxima_far_apart(launch):
    logits, params = _far_apart_rows()
    seeds, positions = list(range(300, 300 + len(params))), [5] * len(params)
    _assert_draws_as_torch(logits, params, seeds, positions, launch)


@launches
def test_u_zero_draws_the_first_token_of_positive_probability(launch):
    """The inverse CDF at u = 0 draws the first token whose probability is not 0, as torch
    does: the first after a chunk and a half of -inf logits, at T = 0.05 too, where that token
    is 60 below the row's max (probability e^-60, its chunk's max as far below the row's)."""
    first = triton_sampler.CHUNK + 1000
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * 3.0
    logits[:, :first] = float("-inf")
    logits[1, -1] = logits[1].max() + 3.0
    logits[1, first] = logits[1, -1] - 3.0
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.05)]

    def at_u_zero(device):
        info = _info(params, [1, 2], [0, 0], device)
        return dataclasses.replace(info, uniforms=torch.zeros_like(info.uniforms))

    tokens, logprobs, _ = _fused(logits, at_u_zero(DEV), launch)
    want = sample(logits, at_u_zero(torch.device("cpu")))
    assert want.tokens.tolist() == [first, first] and torch.equal(tokens.cpu(), want.tokens)
    assert torch.allclose(logprobs.cpu(), want.logprobs, atol=1e-5, rtol=0)


@launches
def test_fused_sampler_rows_do_not_depend_on_the_batch(launch):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 2.0
    seeds, positions = [5, 6, 7, 8, 9, 10], [3] * len(PARAMS)
    batch = _fused(logits, _info(PARAMS, seeds, positions, DEV), launch)
    alone = _fused(logits[3:4], _info(PARAMS[3:4], seeds[3:4], positions[3:4], DEV), launch)
    assert batch[0][3] == alone[0][0] and batch[1][3] == alone[1][0]


@launches
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_sample_as_their_float32_values(dtype, launch):
    """A decode graph hands the sampler the LM head's bf16/fp16 logits: both samplers draw what
    they draw from those values cast to float32, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(len(PARAMS), VOCAB, generator=gen) * 3.0).to(dtype)
    seeds, positions = [21, 22, 23, 24, 25, 26], [9] * len(PARAMS)
    info = _info(PARAMS, seeds, positions, DEV)
    half, full = _fused(logits, info, launch), _fused(logits.float(), info, launch)
    for a, b in zip(half, full):
        assert torch.equal(a, b)
    want = _torch_path(logits.float(), PARAMS, seeds, positions)
    got = _torch_path(logits, PARAMS, seeds, positions)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)


def test_launch_from_the_environment(monkeypatch):
    monkeypatch.setenv("ROLLOUT_SAMPLER_LAUNCH", "4,8,2")
    assert triton_sampler.launch_from_env() == triton_sampler.SamplerLaunch(4, 8, 2)
    monkeypatch.delenv("ROLLOUT_SAMPLER_LAUNCH")
    assert triton_sampler.launch_from_env() is None
    assert triton_sampler.launch_for(1) == triton_sampler.SamplerLaunch()
    assert triton_sampler.launch_for(128) == triton_sampler.MANY_ROWS_LAUNCH
    for bad in ("3,8,8", "4,8", "4,8,8,1", "a,b,c", "0,8,8", "4,64,8"):
        monkeypatch.setenv("ROLLOUT_SAMPLER_LAUNCH", bad)
        with pytest.raises(ValueError, match="ROLLOUT_SAMPLER_LAUNCH"):
            triton_sampler.launch_from_env()


@triton.jit
def _scaled_logits_kernel(L, T, O, V, BLOCK: tl.constexpr, COMPILED: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = triton_sampler._scaled_logits(L, V, row, offs, V, tl.load(T + row), False, COMPILED)
    tl.store(O + row * V + offs, x, mask=offs < V)


def test_logits_over_temperature_are_the_ieee_quotient():
    """logits / T as torch divides, bit for bit (compiled: the Markstein step, not
    x · rcp.approx(T)), over logits from 0.01 to ~3,000 in size and ±inf, T from 0.05 to 3."""
    gen = torch.Generator().manual_seed(9)
    temps = torch.tensor([0.05, 0.1, 0.3, 0.6, 0.7, 0.9, 1.3, 3.0])
    logits = torch.randn(len(temps), 4096, generator=gen) * 10 ** (torch.rand(len(temps), 4096,
                                                                             generator=gen) * 5 - 2)
    logits[:, :3] = torch.tensor([float("inf"), float("-inf"), 0.0])
    out = torch.empty(len(temps), 4096, device=DEV)
    _scaled_logits_kernel[(len(temps), 4)](logits.to(DEV), temps.to(DEV), out, 4096, BLOCK=1024,
                                           COMPILED=triton_sampler._COMPILED)
    assert torch.equal(out.cpu(), logits / temps[:, None])


def _rn32(value: Fraction) -> float:
    """A rational rounded to the nearest float32, ties to even (normal range)."""
    if value == 0:
        return 0.0
    a = abs(value)
    e = math.floor(math.log2(a))
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    scaled = a * Fraction(2) ** (23 - e)
    whole, rest = divmod(scaled.numerator, scaled.denominator)
    if 2 * rest > scaled.denominator or (2 * rest == scaled.denominator and whole % 2):
        whole += 1
    return math.copysign(float(Fraction(whole) * Fraction(2) ** (e - 23)), value)


def test_the_division_step_rounds_as_ieee_division():
    """The arithmetic `triton_sampler._div` relies on (Markstein's theorem), in exact rational
    arithmetic: with r = RN(1/t) and q = RN(x·r), RN(q + r·RN(x - q·t)) — two fmas — is
    RN(x / t)."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        t = np.float32(rng.uniform(0.05, 3.0))
        x = np.float32(rng.normal() * 10 ** rng.uniform(-2, 3))
        r = np.float32(1) / t
        q = np.float32(x * r)
        residual = _rn32(Fraction(float(x)) - Fraction(float(q)) * Fraction(float(t)))  # fma
        got = _rn32(Fraction(float(q)) + Fraction(float(r)) * Fraction(residual))
        assert got == float(x / t)


@gpu
def test_fused_sampler_writes_the_pack_into_pinned_host_memory():
    """pack_on_host: `_pick` writes the [2, B] pack into pinned host memory itself, exactly the
    device tokens and logprobs, readable once the stream has passed it; and the engine's steps
    read their tokens from it (LaunchedStep copies nothing)."""
    from rollout.launched_step import LaunchedStep
    from rollout.sampler import SampleOutput
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(len(PARAMS), VOCAB, generator=gen) * 3.0).to(DEV)
    info = _info(PARAMS, list(range(len(PARAMS))), [3] * len(PARAMS), DEV)
    tokens, logprobs, pack = triton_sampler.sample_unfiltered(
        logits, info.temperatures, info.greedy, info.uniforms, pack_on_host=True)
    assert pack.device.type == "cpu" and pack.is_pinned()
    step = LaunchedStep([], SampleOutput(tokens, logprobs, host_pack=pack))
    got = step.wait()
    assert got.tokens == tokens.tolist()
    assert got.logprobs == logprobs.double().tolist()
    assert torch.equal(pack, torch.stack((tokens.double(), logprobs.double())).cpu())


@gpu
@launches
def test_fused_sampler_frequencies_match_softmax(launch):
    vocab, draws = 3000, 60_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 1.5
    params = [SamplingParams(temperature=0.8)] * draws
    info = SamplingBatchInfo.build(params, list(range(draws)), [11] * draws, vocab, DEV)
    tokens, logprobs, _ = triton_sampler.sample_unfiltered(
        logits.to(DEV).expand(draws, vocab).contiguous(), info.temperatures, info.greedy, info.uniforms,
        launch)
    probs = torch.softmax(logits.double() / 0.8, -1)
    expected = probs * draws
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    top = expected > 5  # chi-square over the likely tokens, the tail pooled
    obs = torch.cat((counts[top], counts[~top].sum().view(1))).numpy()
    exp = torch.cat((expected[top], expected[~top].sum().view(1))).numpy()
    assert chisquare(obs, exp).pvalue > 1e-3
    assert torch.allclose(logprobs.cpu().double(), probs.log()[tokens.cpu()], atol=1e-5, rtol=0)


def test_launch_into_fills_given_buffers_as_sample_unfiltered_returns():
    """The kernels into the caller's buffers (what a graph that samples captures) draw what
    `sample_unfiltered` draws; a buffer of the wrong shape is refused before any launch."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, VOCAB, generator=gen) * 4
    info = _info([SamplingParams(temperature=t) for t in (1.0, 0.7, 0.0)], [1, 2, 3], [4, 5, 6], DEV)
    want = triton_sampler.sample_unfiltered(logits.to(DEV), info.temperatures, info.greedy,
                                            info.uniforms)
    chunks = -(-VOCAB // triton_sampler.CHUNK)
    stats = tuple(torch.full((3, chunks), float("nan"), device=DEV) for _ in range(2))
    tokens = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    logprobs, packed = torch.zeros(3, device=DEV), torch.zeros(2, 3, dtype=torch.float64, device=DEV)
    triton_sampler.launch_into(logits.to(DEV), info.temperatures, info.greedy, info.uniforms,
                               stats, tokens, logprobs, packed)
    assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])
    assert torch.equal(packed, want[2])
    short = tuple(s[:, :-1] for s in stats)
    before = tokens.clone()
    with pytest.raises(ValueError, match="stats"):
        triton_sampler.launch_into(logits.to(DEV), info.temperatures, info.greedy, info.uniforms,
                                   short, tokens, logprobs, packed)
    assert torch.equal(tokens, before)
