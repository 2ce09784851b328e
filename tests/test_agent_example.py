"""The agentic-rollout example (examples/agent_rollout.py): its trajectories' calls run batched
(far fewer engine steps than turns × tokens), every turn after the first finds the whole
conversation so far in the prefix cache, and re-scoring the samples gives their logprobs."""
from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_agent_rollout_example():
    spec = importlib.util.spec_from_file_location("agent_example", REPO / "examples" / "agent_rollout.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    new = 12
    summary = example.main(["--trajectories", "8", "--turns", "3", "--new-tokens", str(new)])
    runs = summary["trajectories"]
    assert [r["task"] for r in runs] == list(range(8))
    turns = sum(len(r["turns"]) for r in runs)
    assert summary["steps"] <= turns * new // 3
    for r in runs:
        for before, turn in zip(r["turns"], r["turns"][1:]):
            # the last turn's prompt and sample, all but its last token (never computed)
            assert turn["cached"] == len(before["ids"]) - 1
    assert summary["score_gap"] <= 1e-4
