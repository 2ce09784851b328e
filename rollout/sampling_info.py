"""Per-batch sampling tensors, built once per step from the requests' SamplingParams."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from rollout.host_to_device import to_device
from rollout.random_stream import seed_hash, uniform_from
from rollout.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B] float32; greedy rows hold 1.0 (logprobs under T=1)
    top_ks: torch.Tensor  # [B] int64; vocab size when off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    uniforms: torch.Tensor  # [B] float64: the row's draw, from (seed, position of the token)
    all_greedy: bool
    needs_filter: bool  # some row uses top-k/top-p/min-p
    max_top_logprobs: int
    # Host-side facts that let the sampler skip work with no effect on the result (the tensors
    # above stay the definition). Defaults are the safe "do everything" values.
    any_greedy: bool = True  # some row is greedy: argmax needed
    all_temperature_one: bool = False  # logits / T is logits itself: no division
    _hashed: Optional[np.ndarray] = field(default=None, repr=False)  # seed_hash(seeds), host
    # the packed fields as built on the host (numpy views, `_PACKED`): what a captured step's
    # static inputs take (`step_graphs`) without reading the device. Their uniforms are the
    # build's; a step's own come from `uniforms_at`.
    host: Optional[dict[str, np.ndarray]] = field(default=None, repr=False)

    def uniforms_at(self, positions: Sequence[int]) -> np.ndarray:
        """The rows' uniforms (float64, host) for the tokens at `positions`. A decode step of the
        same rows needs only these anew: `build_decode_batch` ships them with its indices and
        points `uniforms` at them there."""
        return uniform_from(None, positions, self._hashed)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
              positions: Sequence[int], vocab_size: int, device: torch.device) -> "SamplingBatchInfo":
        """Written on the host into one packed array, moved in one non-blocking copy, each
        tensor a view of it there (`_PACKED`). `positions`: of the token each row samples."""
        b = len(params)
        first = params[0] if b else None
        # rows of one prompt, often of the whole call, share one SamplingParams: read it once
        distinct = [first] if b and all(p is first for p in params) else params
        host = np.empty(_layout(b)[0], dtype=np.uint8)
        fields = _packed_views(host, b)
        for name, column in _columns(distinct, vocab_size).items():
            fields[name][:] = column  # one value broadcasts to every row
        hashed = seed_hash(list(seeds))
        fields["uniforms"][:] = uniform_from(None, positions, hashed)
        if device.type == "cpu":  # the host views are the tensors (one from_numpy each, no slicing)
            tensors = {name: torch.from_numpy(view) for name, view in fields.items()}
        else:
            tensors = _packed_views(to_device(torch.from_numpy(host), device), b)
        return cls(
            **tensors,
            all_greedy=all(p.is_greedy for p in distinct),
            needs_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in distinct),
            max_top_logprobs=max((p.logprobs for p in distinct), default=0),
            any_greedy=any(p.is_greedy for p in distinct),
            all_temperature_one=all(p.is_greedy or p.temperature == 1.0 for p in distinct),
            _hashed=hashed,
            host=fields,
        )


# The batch's tensors as views of one byte array: (name, numpy dtype, torch dtype). Each field
# starts at a multiple of _ALIGN bytes, as a dtype view needs (and a Triton kernel's pointer
# arguments are 16-byte aligned whatever the batch size).
_PACKED = (("uniforms", np.float64, torch.float64), ("top_ks", np.int64, torch.int64),
           ("temperatures", np.float32, torch.float32), ("top_ps", np.float32, torch.float32),
           ("min_ps", np.float32, torch.float32), ("greedy", np.bool_, torch.bool))
_ALIGN = 16


@functools.lru_cache(maxsize=None)
def _layout(b: int) -> tuple[int, tuple[tuple[str, Any, torch.dtype, int, int], ...]]:
    """Bytes of the packed array of b rows, and each field's (name, dtypes, start, stop) there."""
    fields, offset = [], 0
    for name, np_dtype, torch_dtype in _PACKED:
        size = np.dtype(np_dtype).itemsize * b
        fields.append((name, np_dtype, torch_dtype, offset, offset + size))
        offset += -(-size // _ALIGN) * _ALIGN
    # never 0 bytes: torch gives an empty array stride 0, and no dtype view then
    return max(offset, _ALIGN), tuple(fields)


def _packed_views(buf: Union[np.ndarray, torch.Tensor], b: int) -> dict:
    """name -> [b] view of the packed byte array `buf` (numpy or torch, uint8)."""
    numpy = isinstance(buf, np.ndarray)
    return {name: buf[start:stop].view(np_dtype if numpy else torch_dtype)
            for name, np_dtype, torch_dtype, start, stop in _layout(b)[1]}


def _columns(params: Sequence[SamplingParams], vocab_size: int) -> dict[str, list]:
    """The packed fields but the uniforms, one entry per row of `params`."""
    return dict(top_ks=[min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                temperatures=[p.temperature if p.temperature > 0 else 1.0 for p in params],
                top_ps=[p.top_p for p in params], min_ps=[p.min_p for p in params],
                greedy=[p.is_greedy for p in params])

