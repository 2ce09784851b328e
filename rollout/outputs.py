"""GenerateOutput: what generate() returns for each sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from rollout.request import Request


@dataclass
class GenerateOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under softmax(logits / T), full vocab (T=1 if greedy)
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # version that produced the last token (the engine's at finish if none)
    token_weight_versions: list[int]
    prompt_index: int = 0
    sample_index: int = 0
    text: Optional[str] = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_retractions: int = 0
    rerun_after_failure: bool = False  # re-run on another replica after its first one died
    # finish_reason "stop": the stop token id (a stop_token_ids entry or an EOS id) or the stop
    # string that ended the sample; else None
    matched_stop: Union[int, str, None] = None
    # prompt tokens whose KV came from the prefix cache (at its last admission), not computed
    cached_tokens: int = 0
    # with EngineConfig.record_routed_experts (MoE): int16 [len(prompt) + len(tokens) - 1,
    # sparse layers, top_k], the experts each token fed through the model was routed to
    # (prompt tokens, then every output token but the last), for routing replay in the trainer
    routed_experts: Optional[np.ndarray] = None

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))

    @classmethod
    def from_request(cls, req: Request, engine_version: int, text: Optional[str] = None) -> "GenerateOutput":
        versions = list(req.token_versions)
        return cls(
            prompt_token_ids=list(req.prompt_ids), token_ids=list(req.output_ids),
            logprobs=list(req.logprobs), finish_reason=req.finish_reason or "abort",
            weight_version=versions[-1] if versions else engine_version,
            token_weight_versions=versions, prompt_index=req.prompt_index,
            sample_index=req.sample_index, text=text, top_logprobs=list(req.top_logprobs),
            num_retractions=req.num_retractions, matched_stop=req.matched_stop,
            cached_tokens=req.cached_tokens,
            routed_experts=req.routed_experts.array() if req.routed_experts is not None else None)
