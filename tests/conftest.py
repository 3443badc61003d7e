"""Session fixtures shared by the unit and integration tests.

Every test starts with one torch intra-op thread in the test process: these models are tiny, and on
a busy 2-core machine a second OpenMP thread spends its time in barriers waiting for a preempted
peer (a toy learning test ran 7x slower with 2 threads than with 1 beside other jobs). A run built
by a test (RunLoop, the actors) still sets the threads its config asks for; this fixture puts the
test process back to one thread before the next test.
"""

import importlib.util
import os

import pytest
import torch

from gapless.config import ModelConfig
from gapless.envs.code.problems import generate_problems
from gapless.models import build_tiny


@pytest.fixture(scope="session")
def problems():
    return generate_problems(0, "train", 64, [1, 2, 3])


@pytest.fixture(scope="session")
def tiny_policy(problems):
    """A random-init 2-layer model with a tokenizer trained on the task's text."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    return build_tiny(cfg, [p.prompt + p.solution for p in problems], seed=0)


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """One warm-start cache for the whole session: each smoke warm start is built once."""
    return tmp_path_factory.mktemp("warmstart-cache")


@pytest.fixture(autouse=True)
def one_torch_thread():
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def engine_wait_policy_stays_in_its_test():
    """A command run in the test process (`main(["eval", ...])`) sets OpenMP's wait policy for its
    process (cli._engine_threads_wait); later tests' child processes must not inherit it."""
    before = os.environ.get("OMP_WAIT_POLICY")
    yield
    if before is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = before


def pytest_collection_modifyitems(config, items):
    """`-m vllm` tests run where vLLM is installed (its own venv: `bash scripts/setup.sh --vllm`)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(
        reason="vLLM is not installed here: bash scripts/setup.sh --vllm, then .venv-vllm/bin/python -m pytest -m vllm"
    )
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_policy(problems):
    """The tiny fixture at head dim 32, which vLLM's CPU attention runs (it refuses 8 and 16)."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=300)
    return build_tiny(cfg, [p.prompt + p.solution for p in problems], seed=0)


@pytest.fixture(scope="session")
def vllm_engine(vllm_policy, tmp_path_factory):
    """One vLLM engine for the whole session (start-up takes tens of seconds; one per process), in
    fp32 with the prefix cache on and LoRA enabled (rank up to 8). A test that pushes other weights
    pushes `vllm_policy`'s back before it ends."""
    from gapless.generate.vllm.engine import VLLMEngine

    path = tmp_path_factory.mktemp("vllm") / "policy"
    vllm_policy.save(path)
    return VLLMEngine(
        str(path),
        vllm_policy.eos_id,
        vllm_policy.decode,
        max_batch=4,
        max_seq_len=256,
        dtype="float32",
        prefix_caching=True,
        enforce_eager=True,
        lora_rank=8,
        lora_alpha=16.0,
        max_num_batched_tokens=256,
    )  # the prefills of 4 prompts share one step (no chunked prefill on CPU)
