"""The bucket format: named tensors flattened into one contiguous 1-D tensor per dtype, with the
metadata (name, shape, offset) that lets the receiver take zero-copy views. One transfer moves
one bucket; metadata travels first and is validated before any data lands."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from weight_sync.errors import WeightUpdateError
from weight_sync.spec import TensorSpec

DEFAULT_BUCKET_BYTES = 512 << 20

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                               torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                               torch.bool)}


def dtype_from_name(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise WeightUpdateError(f"dtype {name} is not one weight sync carries: {sorted(_DTYPES)}")
    return dtype


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the bucket's dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketMeta:
    """Everything about a bucket except its bytes (small, picklable, sent first)."""

    dtype_name: str
    numel: int
    entries: tuple[BucketEntry, ...]
    checksum: Optional[int] = None

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype_name)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(e.name, e.shape, self.dtype) for e in self.entries]


@dataclass
class Bucket:
    meta: BucketMeta
    flat: torch.Tensor  # 1-D, meta.dtype, meta.numel elements

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view) pairs: no copy."""
        return views(self.meta, self.flat)


def views(meta: BucketMeta, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for e in meta.entries:
        yield e.name, flat[e.offset:e.offset + e.numel].view(e.shape)


def check_carried(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The specs, after a WeightUpdateError for the first dtype weight sync does not carry."""
    specs = list(specs)
    for s in specs:
        if str(s.dtype) not in _DTYPES:
            raise WeightUpdateError(f"tensor {s.name!r} has dtype {s.dtype}, which weight sync does "
                                    f"not carry: {sorted(_DTYPES)}")
    return specs


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> list[BucketMeta]:
    """Group specs by dtype, in order, into buckets of at most `bucket_bytes` (a tensor larger
    than that gets a bucket of its own)."""
    by_dtype: dict[torch.dtype, list[TensorSpec]] = {}
    for s in check_carried(specs):
        by_dtype.setdefault(s.dtype, []).append(s)
    metas = []
    for dtype, group in by_dtype.items():
        elem = torch.empty(0, dtype=dtype).element_size()
        entries: list[BucketEntry] = []
        used = 0
        for s in group:
            if entries and (used + s.numel) * elem > bucket_bytes:
                metas.append(BucketMeta(str(dtype), used, tuple(entries)))
                entries, used = [], 0
            entries.append(BucketEntry(s.name, tuple(s.shape), used))
            used += s.numel
        if entries:
            metas.append(BucketMeta(str(dtype), used, tuple(entries)))
    return metas


def pack(meta: BucketMeta, tensors: dict[str, torch.Tensor], device: Optional[torch.device] = None,
         out: Optional[torch.Tensor] = None, with_checksum: bool = False) -> Bucket:
    """Copy the named tensors into one flat tensor laid out by `meta` (into `out` if given)."""
    first = tensors[meta.entries[0].name]
    flat = out if out is not None else torch.empty(meta.numel, dtype=meta.dtype,
                                                   device=device or first.device)
    srcs = [tensors[e.name].detach().reshape(-1) for e in meta.entries]
    if all(t.device == flat.device for t in srcs):
        torch.cat(srcs, out=flat)  # one multi-tensor kernel, not one copy per tensor
    else:
        for e, src in zip(meta.entries, srcs):
            flat[e.offset:e.offset + e.numel].copy_(src, non_blocking=True)
    if with_checksum:
        meta = BucketMeta(meta.dtype_name, meta.numel, meta.entries, checksum(flat))
    return Bucket(meta, flat)


def pack_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 device: Optional[torch.device] = None, with_checksum: bool = False) -> list[Bucket]:
    tensors = named_tensor_dict(named)
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    return [pack(m, tensors, device, with_checksum=with_checksum) for m in plan_buckets(specs, bucket_bytes)]


def named_tensor_dict(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{name: tensor} from (name, tensor) pairs; a WeightUpdateError for anything else."""
    try:
        tensors = dict(named)
    except (TypeError, ValueError) as e:
        raise WeightUpdateError(f"weights must be (name, tensor) pairs: {e}") from None
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"weights must be (name, tensor) pairs; got {name!r}: {type(t).__name__}")
    return tensors


def checksum(flat: torch.Tensor) -> int:
    """CRC32 of the bucket's bytes (computed on the host)."""
    data = flat.detach().contiguous().view(torch.uint8)
    if data.device.type != "cpu":
        data = data.cpu()
    return zlib.crc32(memoryview(data.numpy()))


def verify(meta: BucketMeta, flat: torch.Tensor) -> bool:
    return meta.checksum is None or checksum(flat) == meta.checksum


@dataclass
class UpdateManifest:
    """All buckets' metadata for one update, known before any bytes move."""

    buckets: list[BucketMeta] = field(default_factory=list)

    def specs(self) -> list[TensorSpec]:
        return [s for m in self.buckets for s in m.specs()]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.buckets)
