"""The training gateway (serve/gateway.py, serve/transcript.py) and the agent environment
(envs/agent/environment.py): real agent processes with the `openai` client, a real engine, and the check that
matters -- the tokens an episode trains on are exactly the ones the engine sampled: the ids the
agent received equal the rollout's model tokens, and the log-probs the engine recorded equal a
fresh forward pass over the whole trained sequence (a context that differed from what was
sampled would give other log-probs)."""

from __future__ import annotations

import json
import sys
import textwrap
import threading

import pytest
import torch
from openai import BadRequestError, OpenAI

from gapless.config import ConfigError, ModelConfig, load_config
from gapless.envs.agent.environment import AgentEnvironment
from gapless.envs.math.environment import ProceduralMathEnvironment
from gapless.envs.math.problems import generate_math_problems
from gapless.generate.engine import TorchEngine
from gapless.models import build_tiny
from gapless.prompts import PromptEncoder
from gapless.serve.gateway import Exited, Gateway
from gapless.serve.transcript import NotAnExtension, Transcript
from gapless.types import SamplingParams

EXAMPLE = ["examples/openai_agent.py"]
TASKS = generate_math_problems(0, "train", 4, [1])
PROMPTS = {t.uid: t.prompt for t in TASKS}


@pytest.fixture(scope="module")
def policy():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    torch.manual_seed(0)
    return build_tiny(cfg, [t.prompt + t.answer + "That is not a number. Answer: " for t in TASKS], seed=0)


def _env(command, **kw) -> AgentEnvironment:
    math = ProceduralMathEnvironment({"train": TASKS, "eval": TASKS}, teacher_error_frac=0.0)
    return AgentEnvironment(math, [sys.executable, *command], max_new_tokens=kw.pop("max_new_tokens", 8), **kw)


def _agent(tmp_path, body: str) -> list[str]:
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(body))
    return [str(path)]


TWO_CALLS = """
    import json, os
    from openai import OpenAI
    client = OpenAI(max_retries=0)
    messages = [{"role": "user", "content": os.environ["GAPLESS_PROMPT"]}]
    got = []
    for k in range(2):
        reply = client.chat.completions.create(model="m", messages=messages, temperature=0.3, max_tokens=3)
        text = reply.choices[0].message.content
        got.append(reply.model_extra["gapless"]["token_ids"])
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f" again {k}: "}]
    with open(os.environ["RECORD"] + "/" + os.environ["GAPLESS_TASK_UID"] + str(os.getpid()), "w") as f:
        json.dump(got, f)
    print("7")
"""


# ---- transcript -------------------------------------------------------------------------------
def test_raw_transcript_appends_only_the_new_messages(policy):
    encoder = PromptEncoder(policy.tokenizer, "raw")
    t = Transcript(encoder)
    prompt = TASKS[0].prompt
    assert t.first([("user", prompt)]) == encoder(prompt)  # as the warm start encodes the task
    t.answered(" 14", [5, 6, policy.eos_id])
    text, ids = t.extend([("user", prompt), ("assistant", "14 "), ("user", " sure?")])  # ends stripped: still the reply
    assert (text, ids) == (" sure?", encoder.text(" sure?"))
    t.answered("x", [9])
    with pytest.raises(NotAnExtension, match="unchanged"):
        t.extend([("user", "another prompt"), ("assistant", "x"), ("user", "?")])
    with pytest.raises(NotAnExtension, match="reply as returned"):
        t.extend([("user", prompt), ("assistant", "14 "), ("user", " sure?"), ("assistant", "edited"), ("user", "?")])


def test_chat_transcript_skips_the_sampled_stop_token(policy):
    start, end = "<|im_start|>", "<|im_end|>"
    tokenizer = _chat_tokenizer(policy, start, end)
    encoder = PromptEncoder(tokenizer, "chat")
    t = Transcript(encoder)
    first = t.first([("user", "hi")])
    assert tokenizer.decode(first) == f"{start}user\nhi{end}\n{start}assistant\n"
    stop = tokenizer.convert_tokens_to_ids(end)
    assert encoder.stop_ids == (stop,)
    t.answered("yo", tokenizer.encode("yo", add_special_tokens=False) + [stop])
    text, ids = t.extend([("user", "hi"), ("assistant", "yo"), ("user", "ok")])
    assert text == f"\n{start}user\nok{end}\n{start}assistant\n"  # the template's newline after the stop, then the turn
    full = first + tokenizer.encode("yo", add_special_tokens=False) + [stop] + ids
    assert tokenizer.decode(full) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}],
        tokenize=False,
        add_generation_prompt=True,
    )


def _chat_tokenizer(policy, start: str, end: str):
    import copy

    tokenizer = copy.deepcopy(policy.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [start, end]})
    tokenizer.chat_template = (
        "{% for m in messages %}" + start + "{{ m['role'] }}\n{{ m['content'] }}" + end + "\n"
        "{% endfor %}{% if add_generation_prompt %}" + start + "assistant\n{% endif %}"
    )
    return tokenizer


# ---- the gateway with the real client ---------------------------------------------------------
def test_gateway_serves_one_call_at_a_time_to_the_openai_client():
    gateway = Gateway()
    try:
        channel, base_url = gateway.open()
        client = OpenAI(base_url=base_url, api_key="gapless", max_retries=0, timeout=30)
        out = {}
        thread = threading.Thread(
            target=lambda: out.update(
                r=client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}])
            )
        )
        thread.start()
        call = channel.next(10)
        assert call.messages == [("user", "2+2?")]
        with pytest.raises(Exception, match="another call"):  # a second call while one waits: 409
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
        channel.answer(call, "4", [1, 2], [-0.5, -0.25], [3, 3], "stop", 5)
        thread.join(10)
        reply = out["r"]
        assert reply.choices[0].message.content == "4" and reply.usage.prompt_tokens == 5
        assert reply.model_extra["gapless"] == {"token_ids": [1, 2], "logprobs": [-0.5, -0.25], "versions": [3, 3]}
        with pytest.raises(BadRequestError, match="n = 1"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=2)
        unknown = OpenAI(base_url=base_url.replace(channel.key, "nope"), api_key="x", max_retries=0)
        with pytest.raises(Exception, match="no such episode"):
            unknown.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        channel.close()  # the episode ended: its key answers 410, then, once forgotten, 404
        with pytest.raises(Exception, match="episode is over"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        gateway.forget(channel)
        with pytest.raises(Exception, match="no such episode"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    finally:
        gateway.close()


# ---- episodes: the example agent and a two-call agent, token for token -------------------------
def _trained_logprobs(policy, rollout) -> torch.Tensor:
    c = rollout.completion
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]


@pytest.mark.parametrize("agent", ["example", "two_calls"])
def test_agent_episodes_train_exactly_the_sampled_tokens(policy, tmp_path, monkeypatch, agent):
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("RECORD", str(record))
    command = EXAMPLE if agent == "example" else _agent(tmp_path, TWO_CALLS)
    env = _env(command, sessions=4, max_context_tokens=256)
    engine = TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=8, max_seq_len=256)
    try:
        groups = env.rollout_groups(
            engine, TASKS[:2], 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), policy.encode
        )
    finally:
        env.close()
    assert env.live_agents == 0
    rollouts = [r for g in groups for r in g]
    assert len(rollouts) == 4
    for r in rollouts:
        c = r.completion
        assert r.status in ("ok", "wrong_answer", "no_answer", "parse_error"), r.info
        assert c.prompt_ids == policy.encode(PROMPTS[r.prompt_uid])  # the agent sent the task's prompt as it is
        mask = torch.tensor(c.loss_mask, dtype=torch.bool)
        assert r.info["calls"] == (2 if agent == "two_calls" else r.info["calls"]) and mask.any()
        fresh = _trained_logprobs(policy, r)[mask]
        assert torch.allclose(fresh, torch.tensor(c.logprobs)[mask], atol=1e-5)
    if agent == "two_calls":
        received = [json.loads(p.read_text()) for p in record.iterdir()]
        trained = sorted(json.dumps(_model_turns(r.completion)) for r in rollouts)
        assert sorted(json.dumps(calls) for calls in received) == trained
        assert all(r.reward == 0.0 or r.info["answer"] == "7" for r in rollouts)


def _model_turns(c) -> list[list[int]]:
    turns, current = [], []
    for token, m in zip(c.token_ids, c.loss_mask):
        if m:
            current.append(token)
        elif current:
            turns, current = turns + [current], []
    return turns + ([current] if current else [])


BROKEN = {
    "crash_before_calling": ("import sys; sys.exit(3)", "infra_error"),
    "crash_after_calling": (
        """
        import os, sys
        from openai import OpenAI
        OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": os.environ["GAPLESS_PROMPT"]}])
        sys.exit(2)
    """,
        "agent_error",
    ),
    "rewrites_history": (
        """
        import os
        from openai import OpenAI, BadRequestError
        client = OpenAI(max_retries=0)
        first = [{"role": "user", "content": os.environ["GAPLESS_PROMPT"]}]
        text = client.chat.completions.create(model="m", messages=first).choices[0].message.content
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "other"},
                                                                   {"role": "assistant", "content": text},
                                                                   {"role": "user", "content": "?"}])
        except BadRequestError as exc:
            print("refused", exc.code)
    """,
        "no_answer",
    ),
    "never_answers": (
        """
        import os, time
        from openai import OpenAI
        OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": os.environ["GAPLESS_PROMPT"]}])
        time.sleep(600)
    """,
        "timeout",
    ),
    "loops_forever": (
        """
        import os
        from openai import OpenAI
        client = OpenAI(max_retries=0)
        messages = [{"role": "user", "content": os.environ["GAPLESS_PROMPT"]}]
        while True:
            text = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": " more "}]
    """,
        "call_limit",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_or_hostile_agent_is_a_status_and_leaves_no_process(policy, tmp_path, case):
    body, status = BROKEN[case]
    # only the hanging agent may need the timeout; the others end by themselves, also on a loaded
    # box where starting Python and importing openai alone took over 8 s (CI, 2026-12-03)
    timeout_s = 8.0 if status == "timeout" else 120.0
    env = _env(_agent(tmp_path, body), sessions=2, timeout_s=timeout_s, max_calls=3, max_context_tokens=256)
    engine = TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=4, max_seq_len=256)
    try:
        [[rollout]] = env.rollout_groups(
            engine, TASKS[:1], 1, SamplingParams(temperature=1.0, max_new_tokens=4, seed=1), policy.encode
        )
    finally:
        env.close()
    assert rollout.status == status, rollout.info
    assert env.live_agents == 0
    if case == "rewrites_history":
        assert rollout.info["answer"] == "refused context_not_extended"
    if case == "crash_before_calling":
        assert rollout.is_infra_failure and "before calling the model" in rollout.info["error"]


def test_config_names_the_agent_command():
    with pytest.raises(ConfigError, match="agent.command"):
        load_config(None, {"task.name": "agent"})
    with pytest.raises(ConfigError, match="turn_schedule"):
        load_config(None, {"task.name": "agent", "agent.command": "python x.py", "pipeline.turn_schedule": "waves"})
    with pytest.raises(FileNotFoundError, match="not an executable"):
        AgentEnvironment(None, ["no-such-agent-binary"])
    assert Exited(0).returncode == 0


def test_close_kills_the_agents_of_episodes_in_flight(policy, tmp_path):
    """At a run's end episodes may still be waiting on their next turn: close() leaves no agent."""
    env = _env(EXAMPLE, sessions=2, timeout_s=60.0)
    episode = env.start_episode(TASKS[0], policy.encode(TASKS[0].prompt))
    env.open_episode(episode, policy.encode)  # its agent now waits for the answer to its first call
    assert not episode.is_done and env.live_agents == 1
    process = episode.session.process
    env.close()
    assert process.poll() is not None and env.live_agents == 0
