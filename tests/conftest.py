import atexit
import logging
import os
import sys

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
MOE_ARCH = "Qwen3MoeForCausalLM"
# three layers, the middle one dense (mlp_only_layers), 8 experts, top 2
MOE_SPEC = TinyModelSpec(architecture=MOE_ARCH, num_hidden_layers=3, mlp_only_layers=(1,), seed=7)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny random model directory per architecture (Llama with llama3 rope scaling), and
    the MoE one (MOE_SPEC)."""
    root = tmp_path_factory.mktemp("tiny")
    dirs = {
        arch: str(make_tiny_model(root / arch, TinyModelSpec(
            architecture=arch, llama3_rope_scaling=arch == "LlamaForCausalLM", seed=i)))
        for i, arch in enumerate(ARCHS)
    }
    dirs[MOE_ARCH] = str(make_tiny_model(root / MOE_ARCH, MOE_SPEC))
    return dirs


@pytest.fixture(autouse=True)
def _cpu_threads_back():
    """A test that drives a ModelRunner by hand may leave the batch-1 CPU thread mode on
    (`one_row_blas`); the next test starts with torch's threads either way."""
    yield
    from rollout.layers.one_row_blas import ONE_ROW_BLAS
    ONE_ROW_BLAS.leave()


def cuda_available() -> bool:
    return torch.cuda.is_available()


_SESSION = pytest.StashKey[pytest.Session]()


def pytest_sessionstart(session):
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Once pytest has reported, the process ends with pytest's exit status, skipping the
    interpreter's native teardown. `ray.shutdown()` leaves Ray's gRPC and GCS-client threads
    running in this process (twelve after the whole suite); a static destructor freeing what one of
    them still uses is the likely cause of the CI run that died with SIGSEGV after "954 passed",
    in that teardown (not reproduced on this machine). Ray ends its own worker processes with
    `os._exit` for the same reason. Set ROLLOUT_TESTS_NATIVE_TEARDOWN=1 to keep the teardown."""
    session = config.stash.get(_SESSION, None)
    if session is not None and os.environ.get("ROLLOUT_TESTS_NATIVE_TEARDOWN") != "1":
        # registered last, so it runs first of the atexit callbacks: after the non-daemon threads
        # are joined, before the rest of the teardown
        atexit.register(_exit_without_native_teardown, int(session.exitstatus))


def _exit_without_native_teardown(status: int) -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a test left its cluster up: end it first
        ray.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
