"""Agent frameworks driving tool calling and structured outputs, each used as its users use it:
openai-agents with a function tool against `gapless serve` (started here as the CLI) and against the
training gateway (the test plays the environment: it answers each call with scripted sampled tokens
and checks that the transcript holds exactly those tokens), langchain-openai `bind_tools` and
`with_structured_output`, litellm `tools`. A tiny random model rarely writes a call by itself, so
the served cases force it with a named / required tool_choice (constrained decoding)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Annotated

import pytest
import torch
from pydantic import BaseModel, Field
from serve_model import tiny_policy

from gapless.prompts import PromptEncoder
from gapless.serve.gateway import Call, Gateway
from gapless.serve.transcript import Transcript

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`gapless serve` over a saved tiny checkpoint, as a user starts it."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("ckpt")
    tiny_policy(max_positions=1024).save(path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gapless.cli",
            "serve",
            "--model.path",
            str(path),
            "--port",
            "0",
            "--model-name",
            "tiny",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    assert " at http://" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    yield line.rsplit(" at ", 1)[1].strip()
    proc.terminate()
    proc.wait(timeout=30)


class Sum(BaseModel):
    total: int = Field(ge=0, le=999)
    sure: bool


Small = Annotated[int, Field(ge=0, le=99)]  # bounded: a random model writes digits for as long as it may


class add(BaseModel):  # noqa: N801 -- langchain names the tool after the class
    """Add two numbers."""

    a: Small
    b: Small


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_call_a_function_tool_and_give_an_output_type(served, api):
    """openai-agents on either of its OpenAI models: chat completions, and its default, the Responses
    API (the call goes out as a function_call item, the tool's output comes back as a
    function_call_output item)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def add_numbers(a: Small, b: Small) -> str:
        """Add two numbers."""
        seen.append((a, b))
        return str(a + b)

    kind = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    model = kind("tiny", AsyncOpenAI(base_url=served, api_key="unused", max_retries=0))
    agent = Agent(
        name="adder",
        instructions="Use the tool.",
        tools=[add_numbers],
        model=model,
        model_settings=ModelSettings(tool_choice="add_numbers", max_tokens=200),
        tool_use_behavior="stop_on_first_tool",
    )
    structured = Agent(
        name="summer",
        instructions="Answer in JSON.",
        model=model,
        output_type=Sum,
        model_settings=ModelSettings(max_tokens=200),
    )

    async def both():  # one event loop: the client's connections belong to it
        return await Runner.run(agent, "What is 2 + 3?", max_turns=3), await Runner.run(
            structured, "2 + 3?", max_turns=1
        )

    called, answered = asyncio.run(both())
    assert len(seen) == 1 and all(isinstance(v, int) for v in seen[0])
    assert called.final_output == str(sum(seen[0]))
    assert isinstance(answered.final_output, Sum)


def test_langchain_bind_tools_and_structured_output(served):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=served, api_key="unused", max_tokens=200, max_retries=0, seed=1)
    message = llm.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")
    assert [c["name"] for c in message.tool_calls] == ["add"]
    assert set(message.tool_calls[0]["args"]) == {"a", "b"} and all(
        isinstance(v, int) for v in message.tool_calls[0]["args"].values()
    )
    parsed = llm.with_structured_output(Sum, method="json_schema", strict=True).invoke("What is 2 + 3?")
    assert isinstance(parsed, Sum)


def test_litellm_tools(served, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price table: no fetch at import
    import litellm

    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
                "required": ["a", "b"],
            },
        },
    }
    out = litellm.completion(
        model="openai/tiny",
        api_base=served,
        api_key="unused",
        max_tokens=200,
        seed=2,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "add"
    assert set(json.loads(calls[0].function.arguments)) == {"a", "b"}


def test_openai_agents_through_the_gateway_trains_the_sampled_tokens():
    """The scripted environment answers the agent's first call with a sampled tool call, the agent runs
    the tool and calls again; the second call's context is the first's + the sampled ids + the tool result."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    policy = tiny_policy()
    tok = policy.tokenizer
    encoder = PromptEncoder(tok, "raw")
    gateway = Gateway()
    channel, base_url = gateway.open()
    seen, result = [], {}

    @function_tool
    def add_numbers(a: int, b: int) -> str:
        """Add two numbers."""
        seen.append((a, b))
        return str(a + b)

    def agent_process() -> None:
        model = OpenAIChatCompletionsModel(
            "gapless-policy", AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        )
        agent = Agent(
            name="adder", instructions="Add.", tools=[add_numbers], model=model, model_settings=ModelSettings()
        )
        result["out"] = asyncio.run(Runner.run(agent, "What is 2 + 3?", max_turns=4)).final_output

    thread = threading.Thread(target=agent_process, daemon=True)
    thread.start()
    try:
        transcript = Transcript(encoder)
        first = channel.next(60)
        assert isinstance(first, Call) and [t["function"]["name"] for t in first.tools] == ["add_numbers"]
        context = transcript.first(first.messages)
        reply = ' <tool_call>\n{"name": "add_numbers", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        reply_ids = tok.encode(reply, add_special_tokens=False) + [policy.eos_id]  # as sampled, EOS included
        transcript.answered(reply, reply_ids)
        channel.answer(first, reply, reply_ids, [-0.5] * len(reply_ids), [0] * len(reply_ids), "stop", len(context))
        second = channel.next(60)
        assert isinstance(second, Call) and seen == [(2, 3)]
        tail_text, tail_ids = transcript.extend(second.messages)  # raises if the reply is not kept as sampled
        assert "<tool_response>\n5\n</tool_response>" in tail_text
        final = "The sum is 5."
        final_ids = tok.encode(final, add_special_tokens=False) + [policy.eos_id]
        channel.answer(
            second,
            final,
            final_ids,
            [-0.5] * len(final_ids),
            [0] * len(final_ids),
            "stop",
            len(context) + len(reply_ids) + len(tail_ids),
        )
        thread.join(60)
        assert result["out"] == final
        assert first.messages[0][1].count("<tools>") == 1 and second.messages[: len(first.messages)] == first.messages
        assert second.messages[len(first.messages)] == ("assistant", reply)  # the sampled text, not a re-rendering
    finally:
        gateway.close()


@pytest.mark.parametrize("venv", [".venv", ".venv-openai3"])
def test_openai_client_majors(served, venv):
    """The same probe of the surface (openai_probe.py) under the `openai` 2.x client (the suite's
    venv) and the 3.x one (scripts/setup.sh puts it in a venv of its own)."""
    python = Path(sys.executable) if venv == ".venv" else SRC.parent / venv / "bin" / "python"
    assert python.exists(), f"{python} is missing: run `bash scripts/setup.sh`"
    probe = Path(__file__).with_name("openai_probe.py")
    done = subprocess.run([str(python), str(probe), served], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("openai 3." if venv == ".venv-openai3" else "openai 2."), done.stdout


def test_inspect_ai_use_tools(served, tmp_path):
    """inspect-ai's own CLI (`inspect eval`, its OpenAI-compatible provider) with `use_tools`: the
    forced call is parsed into a tool call, inspect runs the tool and records its output."""
    bin_dir = SRC.parent / ".venv-openai3" / "bin"
    assert (bin_dir / "inspect").exists(), f"{bin_dir / 'inspect'} is missing: run `bash scripts/setup.sh`"
    env = {**os.environ, "GAPLESS_BASE_URL": served, "GAPLESS_API_KEY": "unused", "INSPECT_LOG_DIR": str(tmp_path)}
    task = Path(__file__).with_name("inspect_task.py")
    args = ["--model", "openai-api/gapless/tiny", "--max-tokens", "200", "--temperature", "0", "--display", "none"]
    ran = subprocess.run(  # inspect takes a task file relative to its working directory
        [str(bin_dir / "inspect"), "eval", task.name, *args],
        cwd=task.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    [log] = tmp_path.glob("*.eval")
    dump = subprocess.run(
        [str(bin_dir / "inspect"), "log", "dump", str(log)], capture_output=True, text=True, timeout=300
    )
    [sample] = json.loads(dump.stdout)["samples"]
    calls = [c for m in sample["messages"] for c in m.get("tool_calls") or []]
    outputs = [m["content"] for m in sample["messages"] if m["role"] == "tool"]
    # tool_choice "any" is `required`, which allows parallel calls: one or more, each run by inspect
    assert calls and all(c["function"] == "paint" and c["arguments"]["colour"] in ("red", "blue") for c in calls)
    assert outputs == [f"painted {c['arguments']['colour']}" for c in calls]
