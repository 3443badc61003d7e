"""`generator.engine = 'vllm-server'` and `generator.vllm_url`: the combinations a run refuses at
load, each in one error naming the field and the fix. Runs in either venv (nothing is started)."""

import pytest

from gapless.config import ConfigError, load_config


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"generator.vllm_url": '"http://127.0.0.1:8000"'}, ["generator.vllm_url", "generator.engine = 'vllm-server'"]),
        ({"generator.engine": "vllm-server", "lora.rank": "4"}, ["lora.rank = 0", "generator.engine = 'vllm'"]),
        (
            {"generator.engine": "vllm-server", "generator.vllm_url": '"http://h:1"', "cluster.replicas": "2"},
            ["cluster.replicas = 2", "unset generator.vllm_url"],
        ),
        (
            {"generator.engine": "vllm-server", "generator.vllm_url": '"http://h:1"', "pipeline.max_staleness": "1"},
            ["pipeline.max_staleness = 1", "pipeline.max_staleness = 0"],
        ),
    ],
)
def test_a_server_combination_that_cannot_hold_is_one_error_naming_the_field_and_the_fix(overrides, names):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert all(name in str(err.value) for name in names), str(err.value)


def test_a_server_per_engine_and_an_attached_sync_run_load():
    assert (
        load_config(None, {"generator.engine": "vllm-server", "pipeline.max_staleness": "1"}).generator.vllm_url is None
    )
    cfg = load_config(None, {"generator.engine": "vllm-server", "generator.vllm_url": '"http://h:1"'})
    assert cfg.generator.vllm_url == "http://h:1"


def test_attaching_where_no_server_answers_names_the_field():
    import socket

    from gapless.generate.vllm.engine import VLLMUnavailable
    from gapless.generate.vllm.server import VLLMServer

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(VLLMUnavailable, match=r"generator.vllm_url = 'http://127.0.0.1:\d+': no vLLM server answers"):
        VLLMServer.attach(f"http://127.0.0.1:{port}")
