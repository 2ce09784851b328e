"""Spec for decode step graphs (rollout/step_graphs.py): a small decode batch's whole step —
input kernel, forward, fused sampler — replayed as one CUDA graph generates exactly what the
decode graph followed by the eager sampler generates (the oracle: the same engine with step
graphs off), whatever the batch's temperatures, greedy rows, padding, finishes and weight
updates; batches it does not serve (filters, top-logprobs) take the old path.

On CPU: the step's host-side source table (what the graph reads) from a decode batch. On a
GPU: the engine with and without step graphs."""
import glob

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollout import Engine, EngineConfig, SamplingParams
from rollout.batch_builder import build_decode_batch
from rollout.cuda_graph_runner import PAD_VALUES
from rollout.errors import ConfigError
from rollout.kv_allocator import KVAllocator
from rollout.sampling_info import SamplingBatchInfo
from rollout.step_graphs import IDLE_COLUMN, StepSource, write_step
from rollout.triton_graph_inputs import STEP_BS, STEP_ROWS, TAKE_PREVIOUS
from tests.helpers import gpu
from tests.test_generate import RAGGED

CPU = torch.device("cpu")
VOCAB = 300
PARAMS = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.7, seed=4)]


def _decode_batch():
    alloc = KVAllocator(8, 256, 64)
    rows = [alloc.alloc_row() for _ in PARAMS]
    kv_lens = [4, 9, 6]
    for r, n in zip(rows, kv_lens):
        alloc.alloc_slots(np.full(n, r), np.arange(n))
    positions = [n + 1 for n in kv_lens]
    info = SamplingBatchInfo.build(PARAMS, [11, 12, 13], positions, VOCAB, CPU)
    fb = build_decode_batch(rows, [21, 22, 23], kv_lens, alloc, CPU, sampling_info=info)
    return fb, info


@pytest.mark.parametrize("take_previous", [False, True])
def test_write_step_lays_out_the_graphs_source(take_previous):
    fb, info = _decode_batch()
    graph_bs = 4  # three rows in the graph of 4: one padded column
    table = np.full((STEP_ROWS, 8), -99, dtype=np.int64)
    write_step(table, fb, graph_bs, take_previous)
    view = StepSource(table)
    for i, name in enumerate(PAD_VALUES):  # the index rows, then the padded-row values
        want = getattr(fb, name).tolist()
        if name == "input_ids" and take_previous:
            want = [TAKE_PREVIOUS] * 3
        assert table[i, :4].tolist() == want + [PAD_VALUES[name]], name
    assert view.uniforms[:3].tolist() == info.uniforms_at(fb.seq_lens_cpu).tolist()
    assert np.array_equal(view.uniforms[:3], info.uniforms.numpy())  # the decode batch's own
    assert view.temperatures[:4].tolist() == pytest.approx([1.0, 1.0, 0.7, 1.0])
    assert view.greedy[:4].tolist() == [False, True, False, False]
    assert view.uniforms[3] == 0.5
    assert table[STEP_BS, 0] == 3
    assert (table[:, 4:] == -99).all()  # past the graph's batch: untouched


def test_idle_column_is_the_padded_rows_values():
    view = StepSource(IDLE_COLUMN[:, None].copy())
    assert IDLE_COLUMN[:len(PAD_VALUES)].tolist() == list(PAD_VALUES.values())
    assert (view.uniforms[0], view.temperatures[0], bool(view.greedy[0])) == (0.5, 1.0, False)


@pytest.mark.parametrize("bad", [-1, True, 2.0, "4"])
def test_step_graph_size_is_validated(bad):
    with pytest.raises(ConfigError, match="cuda_graph_step_max_bs"):
        EngineConfig(cuda_graph_step_max_bs=bad)


def test_step_graph_size_env_switch(monkeypatch):
    assert EngineConfig(cuda_graph_step_max_bs=0).graph_step_max_bs == 0
    monkeypatch.setenv("ROLLOUT_STEP_GRAPH_MAX_BS", "4")
    assert EngineConfig().graph_step_max_bs == 4
    assert EngineConfig(cuda_graph_step_max_bs=8).graph_step_max_bs == 8  # the config first
    monkeypatch.setenv("ROLLOUT_STEP_GRAPH_MAX_BS", "x")
    with pytest.raises(ConfigError, match="ROLLOUT_STEP_GRAPH_MAX_BS"):
        EngineConfig().graph_step_max_bs


# ---- on a GPU ------------------------------------------------------------------------------
ARCH = "Qwen2ForCausalLM"


def _gpu_engine(tiny_dirs, step_max_bs: int, dtype: str = "float32", **kw) -> Engine:
    return Engine(EngineConfig(model_path=tiny_dirs[ARCH], device="cuda", dtype=dtype,
                               cuda_graph_batch_sizes=(1, 2, 4, 8, 16), cuda_graph_prefill_tokens=(),
                               cuda_graph_step_max_bs=step_max_bs, kv_cache_tokens=8192, **kw))


@pytest.fixture(scope="module")
def gpu_pair(tiny_dirs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _gpu_engine(tiny_dirs, 0), _gpu_engine(tiny_dirs, 8)


def _params(n: int, seed: int = 50) -> list[SamplingParams]:
    """Ragged lengths (finishes while other rows run on: the batch shrinks and re-pads), greedy
    rows, T = 1 and other temperatures, one seed each."""
    return [SamplingParams(max_new_tokens=6 + 7 * (i % 3), temperature=(1.0, 0.0, 0.8)[i % 3],
                           seed=seed + i) for i in range(n)]


def _assert_same(a, b):
    """Bit for bit: the same kernels on the same logits."""
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


@gpu
@pytest.mark.parametrize("n", [1, 3, 8, 12])
def test_step_graphs_generate_what_the_decode_graph_and_sampler_generate(gpu_pair, n):
    """1 request (the graph of 1), 3 (of 4, padded), 8, and 12: past the step graphs' 8, its
    steps the old path's until finishes bring it down to 8 and under."""
    plain, stepped = gpu_pair
    prompts = [RAGGED[i % len(RAGGED)] for i in range(n)]
    before = stepped.runner.graph_runner.steps.replays
    _assert_same(plain.generate(prompts, _params(n)), stepped.generate(prompts, _params(n)))
    assert stepped.runner.graph_runner.steps.replays > before  # the step graphs ran
    assert plain.runner.graph_runner.steps is None


@gpu
def test_unserved_batches_take_the_old_path(gpu_pair):
    """Top-k and top-logprobs batches: the decode graph and the torch sampler, as before."""
    plain, stepped = gpu_pair
    prompts = RAGGED[:3]
    steps = stepped.runner.graph_runner.steps
    for extra in ({"top_k": 5}, {"logprobs": 2}):
        params = [SamplingParams(max_new_tokens=8, temperature=0.9, seed=7 + i, **extra)
                  for i in range(3)]
        before = steps.replays
        want, got = plain.generate(prompts, params), stepped.generate(prompts, params)
        _assert_same(want, got)
        assert [o.top_logprobs for o in want] == [o.top_logprobs for o in got]
        assert steps.replays == before


@gpu
def test_step_graphs_see_weight_updates(gpu_pair, tiny_dirs):
    """Weights are copied in place: the captured steps compute with the new ones (the oracle:
    the engine without step graphs, updated alike)."""
    plain, stepped = gpu_pair
    files = sorted(glob.glob(f"{tiny_dirs[ARCH]}/*.safetensors"))
    weights = {k: v for f in files for k, v in load_file(f).items()}
    scaled = {k: v * 1.5 if k.endswith("mlp.down_proj.weight") else v for k, v in weights.items()}
    prompts = RAGGED[:2]
    try:
        for eng in (plain, stepped):
            eng.update_weights_from_tensor(list(scaled.items()))
        _assert_same(plain.generate(prompts, _params(2)), stepped.generate(prompts, _params(2)))
    finally:
        for eng in (plain, stepped):
            eng.update_weights_from_tensor(list(weights.items()))


@gpu
def test_step_graphs_without_overlap(tiny_dirs, gpu_pair):
    """Input ids from the host every step (no step in flight)."""
    plain, _ = gpu_pair
    sequential = _gpu_engine(tiny_dirs, 8, overlap_schedule=False)
    prompts = RAGGED[:3]
    _assert_same(plain.generate(prompts, _params(3)), sequential.generate(prompts, _params(3)))
    assert sequential.runner.graph_runner.steps.replays > 0


@gpu
def test_step_graphs_in_bf16(tiny_dirs):
    """The engine's dtype on the benchmark's path (the one-row Triton GEMMs, their loads before
    the PDL wait): bf16 logits into the captured sampler. Many steps: a captured step whose
    forward read its inputs before the input kernel had written them forked at one token."""
    plain, stepped = (_gpu_engine(tiny_dirs, m, dtype="bfloat16") for m in (0, 4))
    for k in range(6):
        prompts = [RAGGED[(k + i) % len(RAGGED)] for i in range(1 + k % 4)]
        params = [p for p in _params(len(prompts), seed=100 * k)]
        for p in params:
            p.max_new_tokens += 30
        _assert_same(plain.generate(prompts, params), stepped.generate(prompts, params))
    assert stepped.runner.graph_runner.steps.replays > 0
