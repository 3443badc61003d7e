"""`gapless serve-training --generator.engine vllm` driven by the real `tinker` SDK: sampling runs
on vLLM (one engine, one service process for the module). Sampled log-probs equal the service's
own scoring of the same tokens (the HF module: the trainer's weights) on the base model and on a
snapshot a LoRA client trained and saved; the base's OpenAI routes still get the base's weights
after the engine took the snapshot's; a second base model is a one-line config error."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import tinker
from serve_process import start_server
from tinker import types

from gapless.cli import main

pytestmark = pytest.mark.vllm
KEY = "tml-gapless-vllm-test"


@pytest.fixture(scope="module")
def service(vllm_policy, tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-vllm")
    vllm_policy.save(root / "base")
    argv = [
        "serve-training",
        "--port",
        "0",
        "--api-key",
        KEY,
        "--threads",
        "1",
        "--generator.engine",
        "vllm",
        "--service.base_models",
        f'{{tiny = "{root / "base"}"}}',
        "--service.checkpoint_dir",
        str(root / "ckpt"),
        "--service.max_batch",
        "4",
        "--service.max_seq_len",
        "128",
        "--service.poll_hold_s",
        "5",
    ]
    proc, url, _ = start_server(argv, "Tinker API")
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _sampled_equal_scored(sampler, prompt: list[int]) -> list[int]:
    out = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=10, seed=5, temperature=1.0, stop=[])
    ).result()
    for seq in out.sequences:
        assert len(seq.tokens) == 10
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
        assert np.abs(np.array(scored[len(prompt) :]) - np.array(seq.logprobs)).max() < 1e-4
    return [t for seq in out.sequences for t in seq.tokens]


def test_base_and_trained_snapshot_sample_on_vllm(service, vllm_policy, problems):
    prompt = vllm_policy.encode(problems[0].prompt)
    with tinker.ServiceClient(base_url=service, api_key=KEY) as client:
        base = client.create_sampling_client(base_model="tiny")
        base_tokens = _sampled_equal_scored(base, prompt)
        trainer = client.create_lora_training_client(base_model="tiny", rank=4).result()
        text = vllm_policy.encode(problems[1].prompt + problems[1].solution)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(text[:-1]),
            loss_fn_inputs={
                "target_tokens": np.array(text[1:], dtype=np.int64),
                "weights": np.ones(len(text) - 1, dtype=np.float32),
            },
        )
        for _ in range(3):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        snapshot = trainer.save_weights_and_get_sampling_client(name="step3")
        assert _sampled_equal_scored(snapshot, prompt) != base_tokens  # other weights, same seeds
        assert _sampled_equal_scored(base, prompt) == base_tokens  # the engine took the base's back
        oa = openai.OpenAI(base_url=f"{service}/v1", api_key=KEY, max_retries=3, timeout=120)
        snapshot.sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2, seed=0, stop=[])
        ).result()
        out = oa.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=10,
            seed=5,
            n=2,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert [t for c in out.choices for t in c.model_extra["token_ids"]] == base_tokens


def test_two_base_models_are_one_line_naming_the_field(tmp_path, capsys):
    rc = main(
        [
            "serve-training",
            "--api-key",
            KEY,
            "--port",
            "0",
            "--generator.engine",
            "vllm",
            "--service.base_models",
            '{a = "x", b = "y"}',
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "service.base_models" in err and "generator.engine = 'torch'" in err
