"""SamplingParams: per-request generation settings, validated on creation."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout.errors import InvalidRequestError


# Below this a temperature is 0 in the sampler's float32 (or its logits / T overflow): say so
# rather than sample from NaNs. Greedy is temperature 0.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0  # in [0, 1)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: Optional[int] = None  # None: drawn from the engine's seeded stream
    n: int = 1  # samples per prompt
    logprobs: int = 0  # top-k logprobs per token to return besides the sampled token's
    # stop strings: the request ends at the first token whose decoded output contains one (a
    # str is one stop string; needs the model's tokenizer.json)
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _int_at_least("max_new_tokens", self.max_new_tokens, 1)
        _int_at_least("n", self.n, 1)
        _int_at_least("logprobs", self.logprobs, 0)
        _finite("temperature", self.temperature)
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                                      f"got {self.temperature}")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p < 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1), got {self.min_p}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an int in [-2**63, 2**63) or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self.stop_token_ids = _id_tuple(self.stop_token_ids)
        self.stop = _stop_tuple(self.stop)

    def check_for_model(self, vocab_size: int) -> None:
        """The checks that need the model (and, as the fields can be assigned after creation, the
        field checks again): raised before a request is built from these params."""
        self.__post_init__()
        if self.logprobs > vocab_size:
            raise InvalidRequestError(f"logprobs={self.logprobs}: the vocabulary has {vocab_size} tokens")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


def _strict_init(self, *args, **kwargs):
    unknown = sorted(set(kwargs) - _FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown SamplingParams field(s) {unknown}; valid: {sorted(_FIELDS)}")
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _strict_init


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_at_least(name: str, v: Any, low: int) -> None:
    if not _is_int(v) or v < low:
        raise InvalidRequestError(f"{name} must be an integer >= {low}, got {v!r}")


def _finite(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidRequestError(f"{name} must be a finite number, got {v!r}")


def _id_tuple(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    try:
        out = tuple(ids)
    except TypeError:
        raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {ids!r}") from None
    if not all(_is_int(i) and i >= 0 for i in out):
        raise InvalidRequestError(f"stop_token_ids must be non-negative ints, got {ids!r}")
    return out


def _stop_tuple(stops: Any) -> tuple[str, ...]:
    if stops is None:
        return ()
    if isinstance(stops, str):
        stops = (stops,)
    try:
        out = tuple(stops)
    except TypeError:
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stops!r}") from None
    if not all(isinstance(s, str) and s for s in out):
        raise InvalidRequestError(f"stop must hold non-empty strings, got {stops!r}")
    return out
