import pytest
import torch

from gapless.config import ModelConfig
from gapless.envs.problems import generate_problems
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
