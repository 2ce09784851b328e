"""Turns generate() arguments into validated Requests. Every check runs before any work starts."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from rollout.errors import InvalidRequestError, KVCacheBudgetError
from rollout.request import Request
from rollout.random_stream import mix_seed
from rollout.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]
ParamsArg = Union[None, SamplingParams, dict, Sequence[Union[SamplingParams, dict]]]


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_context: int  # the model's (or configured) context length
    kv_capacity: int  # tokens the KV pool holds

    @property
    def max_len(self) -> int:
        """Prompt + output tokens one request may reach."""
        return min(self.max_context, self.kv_capacity)


class RequestBuilder:
    def __init__(self, limits: PromptLimits, tokenizer: Any, seed: int):
        self.limits, self.tokenizer = limits, tokenizer
        self._rng = random.Random(seed)
        self._next_rid = 0

    def build(self, prompts: Sequence[Prompt], params: ParamsArg) -> list[Request]:
        check_prompt_list(prompts)
        per_prompt = params_list(params, len(prompts))
        ids = [self._encode(i, p) for i, p in enumerate(prompts)]
        return [req for i, (p, sp) in enumerate(zip(ids, per_prompt)) for req in self._expand(i, p, sp)]

    def _expand(self, index: int, prompt: list[int], sp: SamplingParams) -> list[Request]:
        base = resolve_seed(sp, self._rng)
        out = []
        for k in range(sp.n):
            seed = base if sp.n == 1 else mix_seed(base, k)
            out.append(Request(self._next_rid, prompt, sp, seed, self.limits.max_len, index, k))
            self._next_rid += 1
        return out

    def encode_checked(self, index: int, prompt: Prompt) -> list[int]:
        """A prompt's token ids, validated (what every request goes through)."""
        return self._encode(index, prompt)

    def _encode(self, index: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"prompt {index} is a string but the model has no tokenizer.json;"
                                          " pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            ids = _as_ids(index, prompt)
        self._check_ids(index, ids)
        return ids

    def _check_ids(self, index: int, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError(f"prompt {index} is empty")
        vocab = self.limits.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # C loops; the culprit only when there is one
            bad = next(t for t in ids if t < 0 or t >= vocab)
            raise InvalidRequestError(f"prompt {index} has token id {bad} outside [0, {vocab})")
        if len(ids) >= self.limits.max_context:
            raise InvalidRequestError(
                f"prompt {index} has {len(ids)} tokens; the context length is {self.limits.max_context}, "
                "which must also leave room for one generated token")
        if len(ids) >= self.limits.kv_capacity:
            raise KVCacheBudgetError(
                f"prompt {index} has {len(ids)} tokens but the KV cache holds {self.limits.kv_capacity}: "
                "raise kv_cache_tokens / kv_cache_bytes")


def _as_ids(index: int, prompt: Any) -> list[int]:
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise InvalidRequestError(f"prompt {index} must be a list of token ids or a string, "
                                  f"got {type(prompt).__name__}")
    ids = list(prompt)
    # every element's type in one C loop, the per-element isinstance checks only when something
    # other than a plain int is there (bool is not int's type; other int subclasses pass below)
    if not set(map(type, ids)) <= {int}:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"prompt {index} holds {t!r}; token ids must be ints")
    return ids


def check_prompt_list(prompts: Any) -> None:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidRequestError("prompts must be a list of prompts (token-id lists or strings)")
    if len(prompts) == 0:
        raise InvalidRequestError("prompts is empty: give at least one prompt")


def resolve_seed(sp: SamplingParams, rng: random.Random) -> int:
    """A prompt's base seed: its own, else the next draw of the engine's seeded stream (one
    draw per such prompt, in prompt order; a RolloutController draws the same way)."""
    return sp.seed if sp.seed is not None else rng.getrandbits(63)


def params_list(params: ParamsArg, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, (SamplingParams, dict)):
        return [_one(params)] * n
    if not isinstance(params, Sequence):
        raise InvalidRequestError(f"sampling_params must be SamplingParams, a dict or a list of them, "
                                  f"got {type(params).__name__}")
    if len(params) != n:
        raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts")
    return [_one(p) for p in params]


def _one(p: Any) -> SamplingParams:
    if isinstance(p, SamplingParams):
        return p
    if isinstance(p, dict):
        return SamplingParams.from_dict(p)
    raise InvalidRequestError(f"sampling params must be SamplingParams or dict, got {type(p).__name__}")


def optional_tokenizer(model_dir: str) -> Optional[Any]:
    from pathlib import Path
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))
