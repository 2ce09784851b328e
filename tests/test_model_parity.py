"""Spec: the engine's forward equals Hugging Face transformers on the same random weights
(fp32): prefill logits of a ragged batch, then 16 decode steps through the paged KV cache."""
import pytest
import torch

from tests.conftest import ARCHS
from tests.helpers import RunnerDriver, hf_last_logits, hf_model

PROMPTS = [[1, 5, 9], [42, 7, 300, 12, 8, 99, 3], [256, 17], list(range(60, 75))]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_matches_hf(tiny_dirs, arch):
    path = tiny_dirs[arch]
    hf, driver = hf_model(path), RunnerDriver(path)
    seqs = [list(p) for p in PROMPTS]
    logits = driver.prefill(seqs)
    assert logits.shape == (len(PROMPTS), hf.config.vocab_size)  # last token only
    worst = 0.0
    for step in range(17):
        expected = torch.stack([hf_last_logits(hf, s) for s in seqs])
        worst = max(worst, (logits - expected).abs().max().item())
        nxt = expected.argmax(-1).tolist()
        if step == 16:
            break
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = driver.decode(nxt)
    assert worst <= 1e-4, f"max |logit diff| {worst}"


def test_prefix_extend_matches_full_prefill(tiny_dirs):
    """EXTEND of a suffix after a cached prefix gives the logits of a full prefill."""
    path = tiny_dirs["Qwen3ForCausalLM"]
    hf, driver = hf_model(path), RunnerDriver(path)
    from rollout.batch_builder import build_batch
    from rollout.forward_batch import ForwardMode
    prompt = list(range(100, 120))
    driver.prefill([prompt[:8]])
    fb = build_batch(ForwardMode.EXTEND, driver.rows, [prompt[8:]], [8], driver.alloc,
                     driver.runner.device)
    logits = driver.runner.forward(fb)
    assert (logits[0] - hf_last_logits(hf, prompt)).abs().max().item() <= 1e-4


def test_mistral_matches_hf_and_sliding_windows_are_refused(tmp_path):
    """Mistral is Llama's decoder under its own name; a window shorter than the positions
    (Mistral 7B v0.1's 4,096, or Qwen's with use_sliding_window) would be computed as full
    attention, so it is a ConfigError, not a silent mismatch."""
    import json
    from rollout.config import ModelConfig
    from rollout.errors import ConfigError
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    path = str(make_tiny_model(tmp_path / "m", TinyModelSpec(architecture="MistralForCausalLM")))
    hf, driver = hf_model(path), RunnerDriver(path)
    assert type(hf).__name__ == "MistralForCausalLM"
    logits = driver.prefill([list(p) for p in PROMPTS])
    want = torch.stack([hf_last_logits(hf, p) for p in PROMPTS])
    assert (logits - want).abs().max() <= 1e-4
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    for bad in ({"sliding_window": 64}, {"architectures": ["Qwen2ForCausalLM"],
                                         "use_sliding_window": True, "sliding_window": 64}):
        (tmp_path / "config.json").write_text(json.dumps({**raw, **bad}))
        with pytest.raises(ConfigError, match="sliding-window attention"):
            ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "sliding_window": 1024}))
    assert ModelConfig.from_pretrained(tmp_path).architecture == "MistralForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps({**raw, "use_sliding_window": False,
                                                      "sliding_window": 64}))
    ModelConfig.from_pretrained(tmp_path)  # a window that is off


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_head_dim_apart_from_hidden_over_heads_matches_hf(tmp_path, arch):
    """Heads × head_dim wider than the hidden size (Qwen3-4B's 32 × 128 on a 2,560 hidden):
    q and o are not square, and the engine still equals HF through prefill and decode."""
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    path = str(make_tiny_model(tmp_path / "m", TinyModelSpec(
        architecture=arch, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, seed=3)))
    hf, driver = hf_model(path), RunnerDriver(path)
    assert hf.config.num_attention_heads * hf.config.head_dim != hf.config.hidden_size
    seqs = [list(p) for p in PROMPTS]
    logits = driver.prefill(seqs)
    worst = 0.0
    for step in range(6):
        expected = torch.stack([hf_last_logits(hf, s) for s in seqs])
        worst = max(worst, (logits - expected).abs().max().item())
        nxt = expected.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = driver.decode(nxt)
    assert worst <= 1e-4, f"max |logit diff| {worst}"
