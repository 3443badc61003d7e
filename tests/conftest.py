"""Session fixtures shared by the unit and integration tests.

Every test starts with one torch intra-op thread in the test process: these models are tiny, and on
a busy 2-core machine a second OpenMP thread spends its time in barriers waiting for a preempted
peer (a toy learning test ran 7x slower with 2 threads than with 1 beside other jobs). A run built
by a test (RunLoop, the actors) still sets the threads its config asks for; this fixture puts the
test process back to one thread before the next test.
"""

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

