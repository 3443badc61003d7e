"""RL through the Tinker API against `gapless serve-training` (real server thread, real `tinker` SDK):

1. a loop written the way tinker-cookbook's `recipes/rl_loop.py` is (the same SDK calls:
   save_weights_and_get_sampling_client, sample with num_samples, group-centred advantages,
   forward_backward, optim_step) raises the reward of gapless's math task, with the recipe's
   `importance_sampling` and with its `gspo` (a `sequence_ratio_mask` over the sampled tokens, as
   the recipe builds it); its default, `stable_reinforce`, is not served (docs/service.md says why);
2. the cookbook's own RL trainer (`tinker_cookbook.rl.train.main`) runs unchanged for a few steps
   with a locally defined environment and its default loss config (a synchronous run:
   `importance_sampling`, no loss_fn_config), saving and finishing as it does against Tinker.

The base model is the embedded gapless-tiny, warm-started on the math task as `gapless train` does
(the smoke model; task as in test_math_learning.py: level-3 prompts the warm start answers both
ways). Local data and the model's local tokenizer replace the hub.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from gapless.config import load_config
from gapless.envs.registry import make_environment
from gapless.service.server import ServiceThread, build_service
from gapless.types import Completion

chz = pytest.importorskip("chz", reason="tinker-cookbook's dependencies come with the test extra (scripts/setup.sh)")
CONFIGS = Path(__file__).parents[2] / "configs"
KEY = "tml-gapless-test"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def math_service(tmp_path_factory, warm_cache):
    torch.set_num_threads(1)
    overrides = {
        "warmstart.cache_dir": json.dumps(str(warm_cache)),
        "task.name": '"math"',
        "task.levels": "[3]",
        "task.num_train_prompts": "4",
        "service.checkpoint_dir": json.dumps(str(tmp_path_factory.mktemp("service"))),
        "service.max_batch": "32",
        "service.max_seq_len": "128",
        "service.poll_hold_s": "5",
        "service.export_tokenizers": "false",  # the user's Hugging Face cache is not the test's
    }
    cfg = load_config(CONFIGS / "smoke.toml", overrides)
    server = ServiceThread(build_service(cfg, KEY, log=lambda *a, **k: None))
    env = make_environment(cfg)
    yield server, env
    server.close()
    env.close()


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "gspo"])
def test_rl_loop_recipe_raises_math_reward(math_service, loss_fn):
    server, env = math_service
    service_client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    training_client = service_client.create_lora_training_client(base_model="gapless-tiny", rank=8).result()
    tokenizer = training_client.get_tokenizer()  # the base model's own, loaded offline from get_info's tokenizer_id
    tasks = list(env.tasks("train"))[:4]
    adam_params = types.AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-8)
    group_size, rewards_by_step = 8, []
    for step in range(30):
        sampling_client = training_client.save_weights_and_get_sampling_client().result()
        sampling_params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=step)  # reproducible
        prompts = [types.ModelInput.from_ints(tokenizer.encode(t.prompt, add_special_tokens=False)) for t in tasks]
        futures = [
            sampling_client.sample(prompt=p, num_samples=group_size, sampling_params=sampling_params) for p in prompts
        ]
        datums, rewards = [], []
        for task, prompt, future in zip(tasks, prompts, futures):
            sequences = future.result().sequences
            completions = [
                Completion(
                    prompt.to_ints(),
                    list(s.tokens),
                    list(s.logprobs),
                    [0] * len(s.tokens),
                    s.stop_reason,
                    tokenizer.decode(s.tokens, skip_special_tokens=True),
                    "",
                    j,
                    0,
                )
                for j, s in enumerate(sequences)
            ]
            rewards_g = [r.reward for r in env.score_groups([task], [completions])[0]]
            mean = sum(rewards_g) / len(rewards_g)
            rewards.append(mean)
            if all(r == mean for r in rewards_g):
                continue  # no signal in this group
            for seq, reward in zip(sequences, rewards_g):
                ob_len = prompt.length - 1
                model_input = prompt.append(types.EncodedTextChunk(tokens=list(seq.tokens[:-1])))
                target_tokens = [0] * ob_len + list(seq.tokens)
                padded_logprobs = [0.0] * ob_len + list(seq.logprobs)
                padded_advantages = [0.0] * ob_len + [reward - mean] * (model_input.length - ob_len)
                loss_fn_inputs = {
                    "target_tokens": types.TensorData.from_torch(torch.tensor(target_tokens)),
                    "logprobs": types.TensorData.from_torch(torch.tensor(padded_logprobs)),
                    "advantages": types.TensorData.from_torch(torch.tensor(padded_advantages)),
                }
                if loss_fn == "gspo":  # the sequence ratio over the sampled tokens
                    ratio_mask = [0.0] * ob_len + [1.0] * len(seq.tokens)
                    loss_fn_inputs["sequence_ratio_mask"] = types.TensorData.from_torch(torch.tensor(ratio_mask))
                datums.append(types.Datum(model_input=model_input, loss_fn_inputs=loss_fn_inputs))
        if datums:
            fwd_bwd_future = training_client.forward_backward(datums, loss_fn=loss_fn)
            optim_future = training_client.optim_step(adam_params)
            fwd_bwd_future.result(), optim_future.result()
        rewards_by_step.append(float(np.mean(rewards)))
    service_client.close("success").result()
    first, last = np.mean(rewards_by_step[:5]), np.mean(rewards_by_step[-5:])
    print(f"tinker rl_loop ({loss_fn}) reward by step:", [round(r, 2) for r in rewards_by_step])
    assert last > first + 0.1, rewards_by_step


def test_cookbook_rl_train_runs_unchanged(math_service, tmp_path, monkeypatch):
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.rl import train
    from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
    from tinker_cookbook.utils import cost_estimation

    server, env = math_service
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(cost_estimation, "_pricing_fetched", True, raising=False)  # its one outside request
    with tinker.ServiceClient(base_url=server.base_url, api_key=KEY) as probe:
        trainer = probe.create_lora_training_client(base_model="gapless-tiny", rank=2).result()
        tokenizer = trainer.get_tokenizer()
    tokenizer_utils.register_tokenizer("gapless-tiny", lambda: tokenizer)
    tasks = list(env.tasks("train"))[:2]

    class MathEnv(Env):
        def __init__(self, task):
            self.task = task

        async def initial_observation(self):
            return types.ModelInput.from_ints(tokenizer.encode(self.task.prompt, add_special_tokens=False)), [
                tokenizer.eos_token_id
            ]

        async def step(self, action, *, extra=None):
            text = tokenizer.decode(action, skip_special_tokens=True)
            completion = Completion([], list(action), [], [], "stop", text, "", 0, 0)
            reward = env.score_groups([self.task], [[completion]])[0][0].reward
            return StepResult(
                reward=reward,
                episode_done=True,
                next_observation=types.ModelInput.from_ints([]),
                next_stop_condition=[],
            )

    class Builder(EnvGroupBuilder):
        def __init__(self, task):
            self.task = task

        async def make_envs(self):
            return [MathEnv(self.task) for _ in range(4)]

        def logging_tags(self):
            return ["math"]

    class Dataset(RLDataset):
        def get_batch(self, index):
            return [Builder(t) for t in tasks]

        def __len__(self):
            return 3

    @chz.chz
    class DatasetBuilder(RLDatasetBuilder):
        async def __call__(self):
            return Dataset(), None

    cfg = train.Config(
        learning_rate=1e-3,
        dataset_builder=DatasetBuilder(),
        model_name="gapless-tiny",
        recipe_name="gapless-test",
        max_tokens=4,
        log_path=str(tmp_path / "log"),
        base_url=server.base_url,
        lora_rank=4,
        eval_every=0,
        save_every=2,
    )
    asyncio.run(train.main(cfg))
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) >= 3 and all("env/all/reward/total" in m for m in metrics[:3])
    assert metrics[-1]["tokens/cumulative/trained"] > 0
    checkpoints = (tmp_path / "log" / "checkpoints.jsonl").read_text()
    assert "final" in checkpoints
