"""`--generator.engine vllm` stops at start with one line (exit 2) where it cannot run: vLLM absent
(the line names the setup command) or, on CPU, a head dim vLLM's attention refuses (it names the
torch engine). Runs in either venv; nothing is built before the check."""

import pytest
from serve_model import tiny_policy

from gapless.cli import main
from gapless.generate.vllm.engine import on_cpu, vllm_installed


def _stderr_of(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_vllm_engine_without_vllm_names_the_setup_command(capsys):
    if vllm_installed():
        pytest.skip("vLLM is installed in this venv")
    err = _stderr_of(["train", "--generator.engine", "vllm", "--loop.steps", "0"], capsys)
    assert "bash scripts/setup.sh --vllm" in err


@pytest.mark.vllm
def test_a_head_dim_the_cpu_attention_refuses_names_the_limit_and_the_torch_engine(capsys):
    if not vllm_installed() or not on_cpu():
        pytest.skip("the head-dim limit is vLLM-CPU's")
    err = _stderr_of(["train", "--generator.engine", "vllm", "--model.hidden_size", "32", "--loop.steps", "0"], capsys)
    assert "head dims" in err and "is 8" in err and "generator.engine = 'torch'" in err


@pytest.mark.vllm
def test_serve_and_serve_training_refuse_that_head_dim_the_same_way(tmp_path, capsys):
    if not vllm_installed() or not on_cpu():
        pytest.skip("the head-dim limit is vLLM-CPU's")
    tiny_policy().save(tmp_path)  # hidden 32, 4 heads: head dim 8
    for argv in (
        ["serve", "--model.path", str(tmp_path), "--port", "0", "--generator.engine", "vllm"],
        ["serve-training", "--api-key", "tml-x", "--port", "0", "--generator.engine", "vllm"]
        + ["--service.base_models", f'{{tiny = "{tmp_path}"}}'],
    ):
        err = _stderr_of(argv, capsys)
        assert "head dims" in err and "is 8" in err and "generator.engine = 'torch'" in err


def test_vllms_copy_of_the_config_covers_a_multi_turn_context(tmp_path):
    """Plain RoPE: vLLM's copy gets the run's context as max_position_embeddings (vLLM refuses
    more); a scaled RoPE, whose rotations depend on that field, is a one-line error instead."""
    import json

    from gapless.config import ConfigError
    from gapless.generate import _fit_positions

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"max_position_embeddings": 532, "rope_parameters": {"rope_type": "default"}}))
    _fit_positions(tmp_path, 750)
    assert json.loads(config.read_text())["max_position_embeddings"] == 750
    _fit_positions(tmp_path, 600)  # shorter: left as it is
    assert json.loads(config.read_text())["max_position_embeddings"] == 750
    config.write_text(json.dumps({"max_position_embeddings": 532, "rope_parameters": {"rope_type": "yarn"}}))
    with pytest.raises(ConfigError, match="generator.engine = 'torch'"):
        _fit_positions(tmp_path, 750)
