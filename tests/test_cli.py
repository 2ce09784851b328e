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


def _generate_rows(path: str, tmp_path, lines: str, *options: str) -> list[dict]:
    """`rollout generate` on these JSONL lines: its output rows."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(lines)
    assert main(["generate", "--model", path, "--input", str(inp), "--output", str(out),
                 *options]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_jsonl_matches_engine(tiny_dirs, tmp_path):
    path = tiny_dirs["Qwen2ForCausalLM"]
    rows = _generate_rows(path, tmp_path, '{"prompt": "hi there"}\n{"prompt_token_ids": [5, 6, 7], '
                          '"sampling_params": {"n": 2, "seed": 3}}\n',
                          "--max-new-tokens", "6", "--temperature", "0")
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


def test_generate_bad_lines_and_outputs_fail_first_and_name_the_line(tiny_dirs, tmp_path):
    """Each bad input line exits with its line number before the model loads; an output whose
    directory is missing fails before the run; an engine error names the input line (blank
    lines are skipped, so the prompt index is not the line); no output file appears."""
    import pytest
    path = tiny_dirs["Qwen2ForCausalLM"]
    out = tmp_path / "out.jsonl"
    cases = {
        '[1, 2, 3]': "input line 2 must be a JSON object, got list",
        '{"prompt_token_ids": [1], "sampling_params": null}': "input line 2: 'sampling_params' must be an object",
        '{"prompt_token_ids": [1], "sampling_params": {"top_p": 0}}': r"input line 2: top_p must be in",
        '{"prompt_token_ids": [1, 999999]}': "input line 3: prompt 1 has token id 999999",
    }
    for line, message in cases.items():
        inp = tmp_path / "in.jsonl"
        inp.write_text('{"prompt_token_ids": [5, 6]}\n' + ("\n" if "999999" in line else "") + line + "\n")
        with pytest.raises(SystemExit, match=message):
            main(["generate", "--model", path, "--input", str(inp), "--output", str(out)])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    inp.write_text('{"prompt_token_ids": [5, 6]}\n')
    for bad in (tmp_path / "no" / "o.jsonl", inp / "o.jsonl", tmp_path):  # no dir, a file, a dir
        with pytest.raises(SystemExit, match="cannot write the output"):
            main(["generate", "--model", path, "--input", str(inp), "--output", str(bad)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_generate_writes_through_a_symlink_and_keeps_the_file_mode(tiny_dirs, tmp_path):
    import os
    path = tiny_dirs["Qwen2ForCausalLM"]
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt_token_ids": [5, 6]}\n')
    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    real.write_text("old\n")
    os.chmod(real, 0o640)
    link.symlink_to(real)
    args = ["generate", "--model", path, "--input", str(inp), "--max-new-tokens", "2"]
    assert main(args + ["--output", str(link)]) == 0
    assert link.is_symlink() and json.loads(real.read_text())["prompt_index"] == 0
    assert main(args + ["--output", str(real)]) == 0
    assert (os.stat(real).st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "link.jsonl", "real.jsonl"]


def test_generate_stop_option_is_every_lines_default(tiny_dirs, tmp_path):
    import string
    stops = [a for c in string.printable[:94] for a in ("--stop", c)]  # any ASCII character
    stopped, plain = _generate_rows(
        tiny_dirs["Qwen2ForCausalLM"], tmp_path,
        '{"prompt_token_ids": [5, 6, 7], "sampling_params": {"seed": 3}}\n'
        '{"prompt_token_ids": [5, 6, 7], "sampling_params": {"seed": 3, "stop": []}}\n',
        "--max-new-tokens", "32", *stops)
    assert stopped["finish_reason"] == "stop" and plain["finish_reason"] != "stop"
    assert stopped["matched_stop"] in string.printable[:94] and plain["matched_stop"] is None
    assert stopped["token_ids"] == plain["token_ids"][:len(stopped["token_ids"])]
