"""Spec for the `rollout` console script: the demo and JSONL generation."""
import json
import subprocess
import sys

from rollout import Engine, EngineConfig, SamplingParams
from rollout.cli import main


def test_demo_prints_table_and_throughput(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path / "cache"))
    assert main(["demo", "--n", "2", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "4 prompts x 2 samples" in out and "tok/s" in out and "logprob sum" in out


def test_generate_jsonl_matches_engine(tiny_dirs, tmp_path):
    path = tiny_dirs["Qwen2ForCausalLM"]
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi there"}\n{"prompt_token_ids": [5, 6, 7], '
                   '"sampling_params": {"n": 2, "seed": 3}}\n')
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", path, "--input", str(inp), "--output", str(out),
                 "--max-new-tokens", "6", "--temperature", "0"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (1, 0), (1, 1)]
    engine = Engine(EngineConfig(model_path=path))
    ref = engine.generate(["hi there"], SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert rows[0]["token_ids"] == ref.token_ids
    assert max(abs(a - b) for a, b in zip(rows[0]["logprobs"], ref.logprobs)) < 1e-5


def test_help_explains_options():
    res = subprocess.run([sys.executable, "-m", "rollout.cli", "generate", "--help"],
                         capture_output=True, text=True, check=True)
    for option in ("--model", "--input", "--output", "--temperature", "--n"):
        assert option in res.stdout
