"""Turns generate() arguments into validated Requests. Every check runs before any work starts."""
from __future__ import annotations

import itertools
import random
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from rollout.errors import InvalidRequestError, KVCacheBudgetError
from rollout.prompt_group import PromptGroup, new_group
from rollout.request import Request
from rollout.random_stream import mix_seed
from rollout.sampling_params import SamplingParams
from rollout.stop_strings import StopStrings

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
    def __init__(self, limits: PromptLimits, tokenizer: Any, seed: int, share_prompt_kv: bool = True):
        self.limits, self.tokenizer = limits, tokenizer
        self.share_prompt_kv = share_prompt_kv  # a prompt's n samples share its KV (prompt_group)
        self._rng = random.Random(seed)
        self._next_rid = 0
        # generate calls from several threads build at once (agenerate, agent loops): a call's
        # request ids and drawn seeds are taken under this lock, so no two requests share an id
        # (the call board, drops and aborts find requests by it) and a call's seeds are one run
        self._lock = threading.Lock()

    def build(self, prompts: Sequence[Prompt], params: ParamsArg) -> list[Request]:
        check_prompt_list(prompts)
        per_prompt = params_list(params, len(prompts), self.limits.vocab_size)
        if self.tokenizer is None and any(sp.stop for sp in per_prompt):
            raise InvalidRequestError("stop strings need the model's tokenizer.json (it has none); "
                                      "use stop_token_ids")
        ids, arrays = self._encode_all(prompts)
        groups = prompt_groups(arrays, per_prompt) if self.share_prompt_kv else [None] * len(ids)
        with self._lock:
            return [req for i, (p, a, sp, g) in enumerate(zip(ids, arrays, per_prompt, groups))
                    for req in self._expand(i, p, a, sp, g)]

    def _expand(self, index: int, prompt: list[int], array: np.ndarray, sp: SamplingParams,
                group: Optional[PromptGroup]) -> list[Request]:
        base = resolve_seed(sp, self._rng)
        stops = StopStrings(self.tokenizer, sp.stop) if sp.stop else None
        out = []
        for k in range(sp.n):
            seed = base if sp.n == 1 else mix_seed(base, k)
            out.append(Request(self._next_rid, prompt, sp, seed, self.limits.max_len, index, k,
                               prompt_array=array, group=group, stop_strings=stops))
            self._next_rid += 1
        return out

    def encode_checked(self, index: int, prompt: Prompt) -> list[int]:
        """A prompt's token ids, validated (what every request goes through)."""
        return self._encode(index, prompt)

    def _encode(self, index: int, prompt: Prompt) -> list[int]:
        ids = self._typed_ids(index, prompt)
        self._check_ids(index, ids)
        return ids

    def _encode_all(self, prompts: Sequence[Prompt]) -> tuple[list[list[int]], list[np.ndarray]]:
        """Every prompt's ids, and each as a read-only view of one int64 array of them all (what
        the batch builder copies). Raises what `_encode` of each prompt in turn would raise
        first, in two passes over the tokens instead of three: the type check, then the
        conversion, whose min and max stand for every prompt's range check (a min and a max
        of each list over Python ints cost more than the conversion)."""
        ids: list[list[int]] = []
        first_error: Optional[Exception] = None
        for i, p in enumerate(prompts):
            try:
                ids.append(self._typed_ids(i, p))
            except Exception as e:  # re-raised below, unless a prompt before it fails a later check
                first_error = e
                break
        flat = _int64_array(ids)
        vocab = self.limits.vocab_size
        if flat is None or (len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= vocab)):
            for i, p in enumerate(ids):  # some token is out of range: the per-prompt checks name it
                self._check_ids(i, p)
        for i, p in enumerate(ids):
            self._check_lengths(i, p)
        if first_error is not None:
            raise first_error
        flat.flags.writeable = False
        ends = list(itertools.accumulate(map(len, ids)))
        return ids, [flat[end - len(p):end] for p, end in zip(ids, ends)]

    def _typed_ids(self, index: int, prompt: Prompt) -> list[int]:
        """A prompt's token ids: type-checked and not empty (the checks before the range check)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"prompt {index} is a string but the model has no tokenizer.json;"
                                          " pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            ids = _as_ids(index, prompt)
        if not ids:
            raise InvalidRequestError(f"prompt {index} is empty")
        return ids

    def _check_ids(self, index: int, ids: list[int]) -> None:
        vocab = self.limits.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # C loops; the culprit only when there is one
            bad = next(t for t in ids if t < 0 or t >= vocab)
            raise InvalidRequestError(f"prompt {index} has token id {bad} outside [0, {vocab})")
        self._check_lengths(index, ids)

    def _check_lengths(self, index: int, ids: list[int]) -> None:
        if len(ids) >= self.limits.max_context:
            raise InvalidRequestError(
                f"prompt {index} has {len(ids)} tokens; the context length is {self.limits.max_context}, "
                "which must also leave room for one generated token")
        if len(ids) >= self.limits.kv_capacity:
            raise KVCacheBudgetError(
                f"prompt {index} has {len(ids)} tokens but the KV cache holds {self.limits.kv_capacity}: "
                "raise kv_cache_tokens / kv_cache_bytes")


def _int64_array(ids: list[list[int]]) -> Optional[np.ndarray]:
    """The prompts' ids (ints, by their type check) in one int64 array; None when one does not
    fit in int64 (then it is out of range, and the per-prompt range check names it)."""
    try:
        return np.fromiter(itertools.chain.from_iterable(ids), np.int64, sum(map(len, ids)))
    except OverflowError:
        return None


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


def prompt_groups(arrays: Sequence[np.ndarray], params: Sequence[SamplingParams]
                  ) -> list[Optional[PromptGroup]]:
    """Each prompt's group: every sample of one call whose prompt has the same tokens shares
    its KV — its `n` samples, and the samples of the same prompt given again (as RL loops often
    repeat a prompt instead of asking for n; the KV depends on the tokens alone, not on the
    sampling parameters). Prompts are told apart by a hash of their tokens, then compared."""
    buckets: dict[tuple[int, int], list[int]] = {}  # (length, hash) -> distinct prompts' indices
    owners = []  # per prompt: the index of the first prompt with its tokens
    for i, a in enumerate(arrays):
        bucket = buckets.setdefault((len(a), hash(a.tobytes())), [])
        owner = next((j for j in bucket if np.array_equal(arrays[j], a)), None)
        if owner is None:
            bucket.append(i)
            owner = i
        owners.append(owner)
    samples: dict[int, int] = {}
    for owner, sp in zip(owners, params):
        samples[owner] = samples.get(owner, 0) + sp.n
    groups = {j: new_group(len(arrays[j]), n) for j, n in samples.items()}
    return [groups[j] for j in owners]


def check_prompt_list(prompts: Any) -> None:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidRequestError("prompts must be a list of prompts (token-id lists or strings)")
    if len(prompts) == 0:
        raise InvalidRequestError("prompts is empty: give at least one prompt")


def resolve_seed(sp: SamplingParams, rng: random.Random) -> int:
    """A prompt's base seed: its own, else the next draw of the engine's seeded stream (one
    draw per such prompt, in prompt order; a RolloutController draws the same way)."""
    return sp.seed if sp.seed is not None else rng.getrandbits(63)


def params_list(params: ParamsArg, n: int, vocab_size: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, each checked against the model (`check_for_model`)."""
    out = _params_list(params, n)
    for sp in {id(sp): sp for sp in out}.values():  # usually one object for every prompt
        sp.check_for_model(vocab_size)
    return out


def _params_list(params: ParamsArg, n: int) -> list[SamplingParams]:
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
