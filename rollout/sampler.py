"""Vectorised sampling over the batch: greedy, temperature, top-k → top-p → min-p (each on the
renormalised survivors of the previous, as HF applies them), and the log-probability of each
sampled token under softmax(logits / T) over the full vocabulary.

Randomness is counter-based: one uniform per row from a hash of (seed, position), computed on
the host with the batch (`SamplingBatchInfo.uniforms`, `random_stream.py`), turned into a token
by inverse-CDF over the filtered distribution. A row's draw thus never depends on which other
requests share the batch, and needs no generator state."""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from rollout.sampling_info import SamplingBatchInfo

# CUDA, no filter and no top-logprobs: two Triton kernels (`triton_sampler`) instead of ~20
# torch ops. ROLLOUT_FUSED_SAMPLER=0: the torch path everywhere.
FUSED_GPU_SAMPLER = os.environ.get("ROLLOUT_FUSED_SAMPLER", "1") != "0"
# ... which write the tokens and logprobs straight into pinned host memory (no copy to the host
# after them); ROLLOUT_SAMPLER_PACK_ON_HOST=0: a device pack and a copy
PACK_ON_HOST = os.environ.get("ROLLOUT_SAMPLER_PACK_ON_HOST", "1") != "0"
# ... and skip the division by T when every row's is 1 (ROLLOUT_SAMPLER_UNIT_T=0: divide anyway)
UNIT_T_SHORTCUT = os.environ.get("ROLLOUT_SAMPLER_UNIT_T", "1") != "0"


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_logprob_values: Optional[torch.Tensor] = None  # [B, k]
    top_logprob_ids: Optional[torch.Tensor] = None  # [B, k]
    # [2, B] float64 (tokens, logprobs) when the sampler wrote them ready for the host: in
    # pinned host memory (the fused GPU sampler: no copy left to make), or on the device (one copy)
    host_pack: Optional[torch.Tensor] = None
    # CUDA: passed once host_pack holds the values (None: the stream's work queued so far, as
    # the fused sampler writing the pack itself needs; a captured step copies it on a stream of
    # its own, `step_graphs`)
    ready: Optional[torch.cuda.Event] = None


def keep_mask(probs: torch.Tensor, info: SamplingBatchInfo) -> Optional[torch.Tensor]:
    """[B, vocab] bool: the tokens that survive top-k → top-p → min-p (None: no row filters).

    The survivors of each row are all tokens at or above one probability threshold, found on the
    sorted row; sampling then runs over the vocabulary in its own order. So a row that does not
    filter keeps everything and draws the same token whatever the rest of the batch asks for."""
    if not info.needs_filter:
        return None
    sorted_p, _ = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
    kept = sorted_p.masked_fill(rank >= info.top_ks.view(-1, 1), 0.0)
    mass_before = (kept.cumsum(-1) - kept) / kept.sum(-1, keepdim=True)
    kept = kept.masked_fill(mass_before >= info.top_ps.view(-1, 1), 0.0)
    kept = kept.masked_fill(kept < kept[:, :1] * info.min_ps.view(-1, 1), 0.0)
    num_kept = (kept > 0).sum(-1, keepdim=True).clamp(min=1)
    return probs >= sorted_p.gather(1, num_kept - 1)  # ties at the threshold survive together


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
    """logits: [B, vocab] float32, or the model's bf16/fp16 (what a decode CUDA graph leaves:
    exactly those values as float32) → one token per row (no host synchronisation).

    Work that cannot change the result is skipped from the batch's host-side flags: the
    division when every temperature is 1, the argmax when no row is greedy, the filter when no
    row filters (`keep_mask`): tokens and logprobs are bit for bit those of the full path. The
    full-vocabulary log-softmax is computed only for top-logprobs; otherwise the token's logprob
    is the log of its softmax probability (one pass over the vocabulary, not two)."""
    if (logits.is_cuda and FUSED_GPU_SAMPLER and not info.needs_filter and info.max_top_logprobs == 0
            and logits.stride(-1) == 1):
        from rollout import triton_sampler  # lazily: triton only where CUDA runs
        tokens, logprobs, pack = triton_sampler.sample_unfiltered(
            logits, info.temperatures, info.greedy, info.uniforms, pack_on_host=PACK_ON_HOST,
            unit_temperature=info.all_temperature_one and UNIT_T_SHORTCUT)
        return SampleOutput(tokens, logprobs, host_pack=pack)
    logits = logits.float()  # a no-op on float32
    scaled = logits if info.all_temperature_one else logits / info.temperatures.view(-1, 1)
    if info.max_top_logprobs > 0:
        logprobs_all = torch.log_softmax(scaled, dim=-1)
        probs = logprobs_all.exp()
    else:  # one pass over the vocabulary instead of two (log_softmax, then exp)
        logprobs_all, probs = None, torch.softmax(scaled, dim=-1)
    if info.all_greedy:
        tokens = logits.argmax(dim=-1)
    elif info.any_greedy:
        tokens = torch.where(info.greedy, logits.argmax(dim=-1), _draw(probs, info))
    else:
        tokens = _draw(probs, info)
    rows = tokens.view(-1, 1)
    if logprobs_all is None:
        # log of the token's probability: within a few fp32 ulps of log_softmax (a sampled or
        # greedy token's probability is far above fp32's denormal range)
        return SampleOutput(tokens, probs.gather(1, rows).log_().squeeze(1))
    out = SampleOutput(tokens, logprobs_all.gather(1, rows).squeeze(1))
    out.top_logprob_values, out.top_logprob_ids = logprobs_all.topk(info.max_top_logprobs, dim=-1)
    return out


CDF_BLOCK = 1024


_cpu_scratch = threading.local()
_CPU_SCRATCH_MAX = 2 << 20  # elements (16 MiB of float64) kept per thread at most


def _cpu_cdf_buffer(shape: torch.Size) -> torch.Tensor:
    """A float64 CPU buffer of `shape`, reused by this thread's calls: a fresh one (2 MB at
    64 x 4096) costs several times the scan itself in page faults. The caller must be done with
    it before its next call (`sample` returns only tensors computed from it)."""
    n = math.prod(shape)
    if n > _CPU_SCRATCH_MAX:  # large batches x vocabularies: not worth holding on to
        return torch.empty(shape, dtype=torch.float64)
    buf = getattr(_cpu_scratch, "cdf", None)
    if buf is None or buf.numel() < n:
        # a normal tensor even when made under inference_mode (the engine's): callers outside
        # it (tests, a trainer's own sampling) may write it in place too
        with torch.inference_mode(False):
            buf = _cpu_scratch.cdf = torch.empty(n, dtype=torch.float64)
    return buf[:n].view(shape)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the first index whose float64 prefix sum of `probs` exceeds u * total."""
    if probs.device.type == "cpu":  # the same scan (cumsum with dtype= casts first), in place
        cdf = _cpu_cdf_buffer(probs.shape).copy_(probs).cumsum_(-1)  # in a reused buffer
    else:
        cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    target = u.view(-1, 1).mul(cdf[:, -1:])
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)


def inverse_cdf_blocked(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` in two levels: float64 sums of blocks of CDF_BLOCK tokens pick the block,
    a prefix sum inside that one block picks the token. The same function up to the order of
    float64 additions; on a GPU a full-vocabulary float64 scan per row is the sampler's
    costliest kernel (≈0.3 ms for 128 rows × 152k), this reads the probabilities once."""
    rows, vocab = probs.shape
    blocks_n = -(-vocab // CDF_BLOCK)
    blocks = torch.nn.functional.pad(probs, (0, blocks_n * CDF_BLOCK - vocab)).view(rows, blocks_n, CDF_BLOCK)
    block_mass = blocks.sum(-1, dtype=torch.float64)
    block_cdf = block_mass.cumsum(-1)
    target = u.view(-1, 1).mul(block_cdf[:, -1:])
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks_n - 1)
    before = block_cdf.gather(1, block) - block_mass.gather(1, block)
    inside = blocks.gather(1, block.view(rows, 1, 1).expand(rows, 1, CDF_BLOCK)).squeeze(1)
    cdf = torch.cumsum(inside, -1, dtype=torch.float64).add_(before)
    offset = torch.searchsorted(cdf, target, right=True).clamp_(max=CDF_BLOCK - 1)
    return (block * CDF_BLOCK + offset).clamp_(max=vocab - 1)


def _draw(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Inverse CDF, in vocabulary order, of the filtered distribution at one uniform per row."""
    mask = keep_mask(probs, info)
    if mask is not None:
        probs = probs * mask
    u = info.uniforms
    choice = (inverse_cdf_blocked if probs.is_cuda else inverse_cdf)(probs, u)
    # u * total can round up to total (u within 2^-53 of 1): fall back to the likeliest survivor
    landed = probs.gather(1, choice) > 0
    if probs.device.type == "cpu" and bool(landed.all()):  # a host check costs nothing on CPU:
        return choice.squeeze(1)  # skip the fallback's pass over the vocabulary (never on GPU)
    return torch.where(landed, choice, probs.argmax(-1, keepdim=True)).squeeze(1)
