"""The judge environment on the serving scheduler: in-process and over HTTP it goes through the same
scheduler, gives the same greedy verdicts, and its requests share engine steps with HTTP clients."""

from __future__ import annotations

import openai
import pytest
import torch
from serve_model import tiny_policy

from gapless.config import load_config
from gapless.envs.judge.client import HttpJudgeClient, SchedulerJudgeClient
from gapless.envs.judge.environment import JudgeEnvironment, embedded_judge_tasks, make_judge_environment
from gapless.serve.openai.server import ServerThread, build_app
from gapless.types import Completion

RUBRIC = "{prompt}\n<response>\n{response}\n</response>\nScore:"
RESPONSES = ["Red, blue.", "banana", "good: oak, elm"]


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(1)
    policy = tiny_policy()
    srv = ServerThread(build_app(policy, "judge", max_batch=32))
    yield srv, policy
    srv.close()


def _groups(tasks):
    return [[Completion([1], [2], [0.0], [0], "stop", r) for r in RESPONSES] for _ in tasks]


def test_http_and_in_process_judges_share_one_engine_batch(served):
    srv, policy = served
    scheduler = srv.app.scheduler
    tasks = embedded_judge_tasks(0, 4, 0)
    in_process = JudgeEnvironment(tasks, SchedulerJudgeClient(scheduler, policy.encode, max_tokens=6), rubric=RUBRIC)
    over_http = JudgeEnvironment(
        tasks, HttpJudgeClient(srv.url, model="judge", max_tokens=6, concurrency=2), rubric=RUBRIC
    )
    chosen = list(in_process.tasks("train"))
    client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="judge", prompt="Question 1: name", max_tokens=200, n=2, stream=True, extra_body={"ignore_eos": True}
    )  # runs for 200 engine steps
    next(iter(stream))  # the HTTP request is in the engine's batch now
    local = in_process.score_groups(chosen, _groups(chosen))
    stream.close()
    mixed = [sources for sources in scheduler.stats.batch_sources if {"http", "judge"} <= sources]
    assert mixed, scheduler.stats.batch_sources  # engine steps that decoded both clients' samples
    remote = over_http.score_groups(chosen, _groups(chosen))
    over_http.close()
    verdicts = lambda groups: [r.info.get("verdict") for g in groups for r in g]  # noqa: E731
    assert verdicts(local) == verdicts(remote) and all(v is not None for v in verdicts(local))  # greedy: the same judge


def test_refused_judge_prompts_are_infra_errors_not_zeros(served):
    srv, policy = served
    client = SchedulerJudgeClient(srv.app.scheduler, policy.encode, max_tokens=6)
    replies = client.judge(["short prompt", "x" * 5000])  # the second is beyond the context of 256
    assert replies[0].text is not None and replies[1].text is None and "context" in replies[1].error


def test_config_with_a_model_path_judges_in_process_on_a_scheduler(served, tmp_path):
    _, policy = served
    policy.save(tmp_path)
    cfg = load_config(overrides={"task.name": '"judge"', "judge.model_path": f'"{tmp_path}"', "judge.max_tokens": "4"})
    env = make_judge_environment(cfg)
    try:
        assert isinstance(env.client, SchedulerJudgeClient)
        task = env.tasks("train")[0]
        rollout = env.score_groups([task], [[Completion([1], [2], [0.0], [0], "stop", "banana")]])[0][0]
        assert rollout.status in {"ok", "scored", "judge_unparsable"} and "verdict" in rollout.info
    finally:
        env.close()
