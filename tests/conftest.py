import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads it once, when a kernel is decorated: set here, before any test module imports
    # our kernels, so they run under the interpreter on CPU. Only without a GPU: on a GPU machine
    # it would interpret every Triton kernel in the process.
    os.environ["TRITON_INTERPRET"] = "1"

from rollout.tiny_model import TinyModelSpec, make_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny random model directory per architecture (Llama with llama3 rope scaling)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: str(make_tiny_model(root / arch, TinyModelSpec(
            architecture=arch, llama3_rope_scaling=arch == "LlamaForCausalLM", seed=i)))
        for i, arch in enumerate(ARCHS)
    }


@pytest.fixture(autouse=True)
def _cpu_threads_back():
    """A test that drives a ModelRunner by hand may leave the batch-1 CPU thread mode on
    (`one_row_blas`); the next test starts with torch's threads either way."""
    yield
    from rollout.layers.one_row_blas import ONE_ROW_BLAS
    ONE_ROW_BLAS.leave()


def cuda_available() -> bool:
    return torch.cuda.is_available()
