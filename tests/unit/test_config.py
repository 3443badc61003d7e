import json

import pytest

from gapless.cli import main
from gapless.config import Config, ConfigError, load_config


def test_precedence_defaults_file_cli(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("seed = 5\n[trainer]\nlr = 0.01\nclip_eps = 0.3\n")
    cfg = load_config(path, {"trainer.lr": "3e-4"})
    assert cfg.seed == 5  # file over default
    assert cfg.trainer.lr == 3e-4  # command line over file
    assert cfg.trainer.clip_eps == 0.3
    assert cfg.trainer.max_grad_norm == Config().trainer.max_grad_norm  # default


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"trainer.lrr": "1"}, "unknown key 'trainer.lrr'; allowed here: lr,"),
        ({"nosuch": "1"}, "unknown key 'nosuch'"),
        ({"trainer.lr": "fast"}, "trainer.lr: Input should be a valid number"),
        ({"loop.steps": "-3"}, "loop.steps: Input should be greater than or equal to 0"),
        ({"generator.group_size": "1"}, "generator.group_size"),
        ({"model.hidden_size": "102"}, "model.hidden_size (102) must be divisible by model.num_heads"),
        ({"model.path": "'/no/such/dir'"}, "model.path: directory '/no/such/dir' does not exist"),
        ({"trainer.loss": "ppo"}, "trainer.loss: Input should be 'grpo', 'dapo', 'drgrpo', 'gspo' or 'cispo'"),
        ({"trainer.advantage": "gae"}, "trainer.advantage"),
        ({"trainer.correction": "tis"}, "it needs trainer.old_logprobs = 'trainer'"),
        (
            {"trainer.overlong": "penalty", "trainer.overlong_buffer": "30"},
            "trainer.overlong_buffer (30) must not exceed generator.max_new_tokens (24)",
        ),
        ({"trainer.tis_cap": "0.5"}, "trainer.tis_cap"),
        (
            {"pipeline.partial_rollout_s": "2", "generator.engine": "reference"},
            "pipeline.partial_rollout_s cuts running sequences",
        ),
        (
            {"generator.kernels": "native", "generator.engine": "reference"},
            "generator.kernels = 'native' applies to generator.engine = 'torch' only",
        ),
        ({"generator.kernels": "cuda"}, "generator.kernels: Input should be 'auto', 'native' or 'torch'"),
    ],
)
def test_bad_values_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert fragment in str(exc.value)
    assert "\n" not in str(exc.value)


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                yield from walk(annotation)
            else:
                yield name, field.description

    missing = [name for name, doc in walk(Config) if not doc]
    assert missing == []


def test_default_algorithm_is_token_level_grpo():
    t = Config().trainer
    assert (t.advantage, t.loss, t.clip_eps, t.clip_high, t.old_logprobs, t.correction) == (
        "grpo",
        "dapo",
        0.2,
        0.2,
        "behaviour",
        "none",
    )
    assert (t.kl_coef, t.entropy_coef, t.overlong, t.drop_zero_variance) == (0.0, 0.0, "keep", False)
    assert load_config(None, {"trainer.clip_eps_high": "0.28"}).trainer.clip_high == 0.28


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["train", "--trainer.lrr", "1"], "unknown key 'trainer.lrr'"),
        (["train", "MALFORMED"], "malformed TOML"),
        (["train", "--model.path", "/no/such/model"], "model.path"),
        (["train", "--loop.steps"], "needs a value"),
    ],
)
def test_cli_errors_exit_2_with_one_line(argv, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "MALFORMED").write_text("seed = [\n")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_shipped_configs_are_valid():
    from pathlib import Path

    for path in sorted((Path(__file__).parents[2] / "configs").glob("*.toml")):
        cfg = load_config(path)
        json.dumps(cfg.model_dump(mode="json"))


def test_configuration_doc_is_in_sync():
    from pathlib import Path

    from gapless.config.doc import render

    doc = Path(__file__).parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == render(), "run: python -m gapless.config.doc > docs/configuration.md"


def test_tool_use_rejects_the_per_completion_overlong_penalty():
    assert load_config(overrides={"task.name": "tool_use"}).tools.max_turns == 3
    with pytest.raises(ConfigError, match="tool_use"):
        load_config(overrides={"task.name": "tool_use", "trainer.overlong": "penalty"})


@pytest.mark.parametrize(
    "placement, transport, fix",
    [
        ("local", "broadcast", "cluster.placement = 'ray'"),
        ("local", "object_store", "cluster.placement = 'ray'"),
        ("ray", "shm", "'broadcast'"),
    ],
)
def test_a_weight_transport_the_placement_cannot_use_names_the_field_and_the_fix(placement, transport, fix):
    with pytest.raises(ConfigError) as err:
        load_config(
            None, {"cluster.placement": json.dumps(placement), "cluster.weight_transport": json.dumps(transport)}
        )
    assert f"cluster.weight_transport = '{transport}'" in str(err.value) and fix in str(err.value), str(err.value)


def test_the_broadcast_transport_is_accepted_on_ray_placement():
    cfg = load_config(None, {"cluster.placement": '"ray"', "cluster.weight_transport": '"broadcast"'})
    assert cfg.cluster.weight_transport == "broadcast"
