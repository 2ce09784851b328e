"""Spec for batch-1 CPU decode through OpenBLAS (`rollout/layers/one_row_blas.py`).

Oracles: torch's F.linear for one GEMV, HF `generate` for a batch-1 generation. The thread mode
is process state the caller sees, so it must never leak out of the engine: torch's thread count
is back and the mode off whenever generate returns or yields."""
import pytest
import torch
import torch.nn.functional as F

from rollout import Engine, EngineConfig, SamplingParams
from rollout.layers.one_row_blas import ONE_ROW_BLAS, OneRowBlas
from tests.conftest import ARCHS
from tests.helpers import hf_model

pytestmark = pytest.mark.skipif(not ONE_ROW_BLAS.available,
                                reason="numpy's BLAS is not OpenBLAS or torch's OpenMP cannot pause")


@pytest.fixture()
def gemv_calls(monkeypatch):
    calls = []
    real = OneRowBlas.gemv

    def counted(x, array, bias=None):
        calls.append(array.shape)
        return real(x, array, bias)
    monkeypatch.setattr(OneRowBlas, "gemv", staticmethod(counted))
    return calls


def test_one_row_gemm_matches_torch_and_the_mode_restores_threads():
    g = torch.Generator().manual_seed(0)
    weight, bias, x = (torch.randn(384, 256, generator=g), torch.randn(384, generator=g),
                       torch.randn(1, 256, generator=g))
    square = torch.randn(256, 256, generator=g)
    threads = torch.get_num_threads()
    assert ONE_ROW_BLAS.array_for(x, weight) is None  # only while entered
    ONE_ROW_BLAS.enter()
    try:
        assert torch.get_num_threads() == 1
        assert ONE_ROW_BLAS.array_for(torch.randn(2, 256), weight) is None  # one row only
        assert ONE_ROW_BLAS.array_for(x, weight.double()) is None
        # a transposed view has the address (and, square, the shape) of the weight: never its array
        assert ONE_ROW_BLAS.array_for(x, square) is not None
        assert ONE_ROW_BLAS.array_for(x, square.t()) is None
        got = ONE_ROW_BLAS.gemv(x, ONE_ROW_BLAS.array_for(x, weight), bias)
    finally:
        ONE_ROW_BLAS.leave()
    assert torch.get_num_threads() == threads and not ONE_ROW_BLAS.active
    want = F.linear(x.double(), weight.double(), bias.double())
    assert got.shape == (1, 384) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_one_greedy_equals_hf_through_openblas(tiny_dirs, arch, gemv_calls):
    engine = Engine(EngineConfig(model_path=tiny_dirs[arch], kv_cache_tokens=4096))
    hf = hf_model(tiny_dirs[arch])
    prompt = [26, 43, 38, 32, 79, 50, 28]
    threads = torch.get_num_threads()
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert torch.get_num_threads() == threads and not ONE_ROW_BLAS.active
    # every decode step's projections and LM head: 4 per layer (gate/up fused) + 1
    layers = engine.model_config.num_hidden_layers
    assert len(gemv_calls) == 23 * (4 * layers + 1)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)
    ref_tokens = ref.sequences[0, len(prompt):].tolist()
    assert out.token_ids == ref_tokens
    ref_lp = torch.stack([torch.log_softmax(l[0].float(), -1)[t] for l, t in zip(ref.logits, ref_tokens)])
    assert torch.allclose(torch.tensor(out.logprobs), ref_lp, atol=1e-5, rtol=0)


def test_mode_is_off_whenever_the_caller_runs(tiny_dirs, gemv_calls):
    """A short and a long request: the long one decodes alone (batch 1) after the short one is
    yielded; the caller's code between yields and after the call sees torch's threads."""
    engine = Engine(EngineConfig(model_path=tiny_dirs["Qwen2ForCausalLM"], kv_cache_tokens=4096))
    threads = torch.get_num_threads()
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 12)]
    seen = []
    for out in engine.generate_iter([[5, 6, 7], [8, 9]], params):
        seen.append(len(out.token_ids))
        assert torch.get_num_threads() == threads and not ONE_ROW_BLAS.active
    assert seen == [2, 12] and gemv_calls  # the long request's last steps went to OpenBLAS
    alone = engine.generate([[8, 9]], params[1])[0].token_ids
    batched = Engine(EngineConfig(model_path=tiny_dirs["Qwen2ForCausalLM"], kv_cache_tokens=4096,
                                  max_running_requests=4))
    assert batched.generate([[8, 9], [8, 9]], params[1])[0].token_ids == alone


def test_weights_stay_releasable_after_batch_one_steps(tiny_dirs, gemv_calls):
    engine = Engine(EngineConfig(model_path=tiny_dirs["LlamaForCausalLM"], kv_cache_tokens=4096))
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = engine.generate([[3, 1, 4]], sp)[0]
    assert gemv_calls
    weights = [(n, p.detach().clone()) for n, p in hf_model(tiny_dirs["LlamaForCausalLM"]).named_parameters()]
    engine.release_memory()  # resizes every weight storage to 0
    engine.resume_memory()
    engine.update_weights_from_tensor(weights)
    after = engine.generate([[3, 1, 4]], sp)[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


def test_the_mode_belongs_to_the_thread_that_entered():
    import threading
    x, weight = torch.randn(1, 64), torch.randn(32, 64)
    seen = {}

    def other():
        ONE_ROW_BLAS.enter()  # held by the main thread: a no-op here
        seen["takes"] = ONE_ROW_BLAS.array_for(x, weight) is not None
        seen["active"] = ONE_ROW_BLAS.active
        ONE_ROW_BLAS.leave()  # not this thread's to leave
    ONE_ROW_BLAS.enter()
    try:
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert seen == {"takes": False, "active": False}
        assert ONE_ROW_BLAS.active and torch.get_num_threads() == 1
        assert ONE_ROW_BLAS.array_for(x, weight) is not None
    finally:
        ONE_ROW_BLAS.leave()
    assert not ONE_ROW_BLAS.active
