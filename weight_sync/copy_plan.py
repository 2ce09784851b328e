"""CopyPlan: the writes a model's in-place load path makes for one weight layout, recorded once
and replayed per update as a few batched copies.

`record` runs the target's own `load_weights` over the source tensors under a torch function
mode that performs no write: each `dst.copy_(src)` whose `src` is a view of a source (the
loaders narrow the full HF tensor to this TP rank's slice, fused parameters such as qkv_proj or
gate_up_proj give a slice of the parameter as `dst`) becomes one (dst view, src view) pair;
`zero_`/`fill_` on the model's memory (e.g. the padded vocabulary rows of a TP rank) become
fix-ups replayed after the copies. So replaying the plan writes exactly what a fresh load writes.
Anything else the loaders do in place (a copy from a computed tensor, another in-place op) makes
the layout unplannable: `record` returns None and the caller loads the ordinary way each time.

`run` copies each (device, dtype) group with one `torch._foreach_copy_` call, except tensors of
at least `direct_copy_bytes` (contiguous on both sides), which go one `copy_` each: a plain
device copy is a memcpy at full bandwidth, while the multi-tensor kernel splits them into small
chunks. Small tensors (norms, biases, k/v) are most of the count and go in one launch."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

# Tensors at least this large are copied one `copy_` each (see the module docstring); None or a
# negative value sends everything through `_foreach_copy_`. WEIGHT_SYNC_DIRECT_COPY_MB overrides
# it for measurements (read when a plan is recorded).
DEFAULT_DIRECT_COPY_BYTES = 4 << 20
_FIXUPS = ("zero_", "fill_")


def direct_copy_bytes() -> Optional[int]:
    env = os.environ.get("WEIGHT_SYNC_DIRECT_COPY_MB")
    if env is None:
        return DEFAULT_DIRECT_COPY_BYTES
    mb = float(env)
    return None if mb < 0 else int(mb * (1 << 20))


@dataclass
class CopyPlan:
    groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)
    direct: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    fixups: list[Callable[[], object]] = field(default_factory=list)
    count: int = 0  # HF tensors the load path took (what load_weights would return)

    @property
    def num_copies(self) -> int:
        return len(self.direct) + sum(len(d) for d, _ in self.groups)

    @property
    def num_launches(self) -> int:
        """Calls made per run (each `_foreach_copy_` counts once)."""
        return len(self.direct) + len(self.groups) + len(self.fixups)

    @torch.inference_mode()  # the views were made there (in-place writes must be, too)
    def run(self) -> int:
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        for dst, src in self.direct:
            dst.copy_(src, non_blocking=True)
        for fix in self.fixups:
            fix()
        return self.count

    @classmethod
    def record(cls, load: Callable[[Iterable[tuple[str, torch.Tensor]]], int],
               sources: Sequence[tuple[str, torch.Tensor]],
               direct_bytes: Optional[int] = None) -> Optional["CopyPlan"]:
        """Run `load` (a target's `load_weights`) over `sources` without writing anything;
        returns the plan, or None when the load path does something a plan cannot replay."""
        recorder = _Recorder({t.untyped_storage().data_ptr() for _, t in sources if t.numel()})
        with recorder:
            count = load(list(sources))
        if recorder.unplannable or _overlaps(recorder.fixup_targets, [d for d, _ in recorder.pairs]):
            return None
        plan = cls(fixups=recorder.fixups, count=count)
        plan._group(recorder.pairs, direct_copy_bytes() if direct_bytes is None else direct_bytes)
        return plan

    def _group(self, pairs, direct_bytes: Optional[int]) -> None:
        by_key: dict[tuple, tuple[list, list]] = {}
        for dst, src in pairs:
            if dst.numel() == 0:
                continue
            dense = dst.is_contiguous() and src.is_contiguous()
            if dense and direct_bytes is not None and direct_bytes >= 0 \
                    and dst.numel() * dst.element_size() >= direct_bytes:
                self.direct.append((dst, src))
                continue
            # strided pairs (a TP rank's column slice) apart: one of them in a group would send
            # the whole group down the foreach slow path (a copy_ per tensor)
            key = (dst.device, src.device, dst.dtype, src.dtype, dense)
            dsts, srcs = by_key.setdefault(key, ([], []))
            dsts.append(dst)
            srcs.append(src)
        self.groups = list(by_key.values())


class _Recorder(TorchFunctionMode):
    """Lets view ops through; turns copies from a source into plan pairs and never writes."""

    def __init__(self, source_storages: set[int]):
        super().__init__()
        self.sources = source_storages
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fixups: list[Callable[[], object]] = []
        self.fixup_targets: list[torch.Tensor] = []
        self.unplannable: Optional[str] = None

    def _is_source(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.sources

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "to" and args and self._is_source(args[0]):
            # device moves are the copy's job; a dtype change would be a computed tensor
            dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
            if dtype is None or dtype == args[0].dtype:
                return args[0]
        if name == "copy_":
            dst, src = args[0], args[1]
            if self._is_source(src) and src.shape == dst.shape:
                self.pairs.append((dst, src))
            elif dst.numel():
                self.unplannable = f"copy_ from a computed tensor into {tuple(dst.shape)}"
            return dst
        if name in _FIXUPS and args and isinstance(args[0], torch.Tensor):
            if args[0].numel():
                self.fixups.append(lambda f=func, a=args, k=kwargs: f(*a, **k))
                self.fixup_targets.append(args[0])
            return args[0]
        if (name.endswith("_") and not name.startswith("__")) or name == "__setitem__" or "out" in kwargs:
            self.unplannable = f"in-place {name}"
            return args[0] if args else None
        return func(*args, **kwargs)


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) that a view can touch."""
    base = t.untyped_storage().data_ptr()
    start = t.data_ptr()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return base, start, start + extent * t.element_size()


def _overlaps(fixups: list[torch.Tensor], dsts: list[torch.Tensor]) -> bool:
    """A fix-up touching memory a copy writes would need the recorded order: not planned."""
    spans = [_span(d) for d in dsts]
    for f in fixups:
        b, s, e = _span(f)
        if any(b == b2 and s < e2 and s2 < e for b2, s2, e2 in spans):
            return True
    return False
