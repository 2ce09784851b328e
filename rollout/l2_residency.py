"""Weights held in the GPU's L2 cache from one decode step to the next.

A batch-1 decode step streams every weight through the L2 once (3.1 GB a step for Qwen2-1.5B
against an H200's 50 MB of L2), so under the default policy nothing a step reads is still there
at the next one. Here a set of weights, up to a byte budget, is marked resident: the one-row
GEMVs load them with the L2 `evict_last` policy (PTX `createpolicy` + `.L2::cache_hint`, what
Triton's `eviction_policy` emits) into a part of the L2 set aside for persisting lines
(`cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)`, CUDA's L2 set-aside), where the other
weights' streaming cannot evict them; the next step reads them from the L2 instead of HBM.
Optionally the other weights load with `evict_first`.

Experimental, off unless configured (environment, read once):
  ROLLOUT_L2_RESIDENT_MB     the budget in MiB (0: off; clamped to the device's set-aside limit)
  ROLLOUT_L2_RESIDENT_KINDS  which weights, in order of preference, by the module name that owns
                             them (default "o_proj,qkv_proj"), layer by layer from layer 0
  ROLLOUT_L2_STREAM          the other weights' policy: "" (normal, default) or "evict_first"
A hint: it changes which bytes come from HBM, never a value."""
from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
POLICIES = ("", "evict_first", "evict_last")

@dataclass(frozen=True)
class L2Settings:
    """What the environment asks for (see the module docstring), validated on creation."""
    budget_mb: float = 0.0
    kinds: tuple[str, ...] = ("o_proj", "qkv_proj")
    stream: str = ""

    def __post_init__(self) -> None:
        if not self.budget_mb >= 0:
            raise ValueError(f"ROLLOUT_L2_RESIDENT_MB={self.budget_mb}: a budget is >= 0 MiB")
        if self.stream not in POLICIES[:2]:
            raise ValueError(f"ROLLOUT_L2_STREAM={self.stream!r}: '' or 'evict_first'")

    @classmethod
    def from_env(cls, environ=os.environ) -> "L2Settings":
        try:
            budget = float(environ.get("ROLLOUT_L2_RESIDENT_MB", "0") or 0)
        except ValueError:
            raise ValueError("ROLLOUT_L2_RESIDENT_MB="
                             f"{environ['ROLLOUT_L2_RESIDENT_MB']!r}: a number of MiB") from None
        kinds = environ.get("ROLLOUT_L2_RESIDENT_KINDS", ",".join(cls.kinds))
        return cls(budget, tuple(filter(None, kinds.replace(" ", "").split(","))),
                   environ.get("ROLLOUT_L2_STREAM", ""))


SETTINGS = L2Settings.from_env()


def policy(weight: torch.Tensor) -> str:
    """The L2 eviction policy a kernel loads `weight` with (a launch's constexpr)."""
    return getattr(weight, "l2_policy", SETTINGS.stream)


def choose(named_weights: list[tuple[str, torch.Tensor]], kinds: tuple[str, ...],
           budget_bytes: int) -> list[str]:
    """Names of the weights to keep resident: kind by kind in `kinds`' order, in model order
    within a kind, while the next one fits the budget."""
    chosen, used = [], 0
    for kind in kinds:
        for name, w in named_weights:
            size = w.numel() * w.element_size()
            if name.split(".")[-2:-1] == [kind] and used + size <= budget_bytes:
                chosen.append(name)
                used += size
    return chosen


def apply(model: torch.nn.Module, device: torch.device,
          settings: L2Settings = SETTINGS) -> list[str]:
    """Reserve the set-aside and mark the chosen weights; [] when off or when the device has no
    set-aside. Call before the decode graphs are captured (their launches keep the policy)."""
    if settings.budget_mb <= 0 or device.type != "cuda":
        return []
    granted = _reserve(device, int(settings.budget_mb * 2**20))
    if granted <= 0:
        return []
    weights = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    chosen = choose(weights, settings.kinds, granted)
    for name, p in weights:
        if name in chosen:
            p.l2_policy = "evict_last"
    logger.info("L2: %.1f MiB set aside, %d weights resident (%s)", granted / 2**20, len(chosen),
                ", ".join(settings.kinds))
    return chosen


def _reserve(device: torch.device, nbytes: int) -> int:
    """Sets the context's persisting-L2 limit to min(nbytes, the device's maximum); the bytes
    granted (0 when the driver has no such limit)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.empty(1, device=device)  # the primary context current on this thread
        most = ctypes.c_int(0)
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        if cuda.cuDeviceGetAttribute(ctypes.byref(most), CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
                                     ordinal) != 0 or most.value <= 0:
            return 0
        want = min(nbytes, most.value)
        if cuda.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(want)) != 0:
            return 0
        got = ctypes.c_size_t(0)
        cuda.cuCtxGetLimit(ctypes.byref(got), CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
        logger.info("L2 set-aside: asked %d, device maximum %d, set %d", nbytes, most.value,
                    got.value)
        return int(got.value)
