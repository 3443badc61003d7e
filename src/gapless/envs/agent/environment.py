"""Train any agent program: each episode runs the user's agent, whose model calls go through the
gateway (serve/gateway.py) and are sampled as the episode's turns.

    open_episode   start the agent (a local process) with OPENAI_BASE_URL = its episode's
                   endpoint and GAPLESS_PROMPT = the task; wait for its first call: the context
                   of turn 1 is that call, rendered in the run's prompt format (serve/transcript.py)
    take_turn      answer the waiting call with the sampled turn; wait for the next call (its
                   new messages become loss-masked environment tokens after the sampled ones) or
                   for the agent to exit
    to_rollout     the agent's final answer (the last line of its standard output) graded by
                   the arithmetic task's own checker (envs/math/environment.py, math-verify)

So the trained tokens are exactly the sampled ones, whatever the agent does with the text
between calls. Tasks, teacher and grading are the procedural arithmetic task's (`task.name =
'math'`), so the warm start teaches the format of an agent that sends the task's prompt as its
one user message (examples/openai_agent.py does).

Statuses (reward 1.0 only for 'ok'):
    ok / wrong_answer / no_answer / parse_error   the final answer, as the math task grades it
    agent_error    the agent exited non-zero after at least one call (stderr's tail in info)
    timeout        the episode ran past `agent.timeout_s` (the agent is killed)
    call_limit     a call beyond `agent.max_calls`
    context_limit  a call whose context would pass `agent.max_context_tokens`
    infra_error    the agent could not start or exited before its first call: a broken agent
                   or a missing package, never the policy's doing (an agent runs per episode, and
                   the model's text reaches it only in the answers to its calls, so none has
                   reached it yet); a step where every episode ends so raises (check_infra)
                   instead of training on zeros
A call that rewrites earlier messages is refused (400, `context_not_extended`), one whose
messages the chat template or the tokenizer refuses likewise (400, `unrenderable`); the episode
goes on if the agent makes a valid call or exits. The model's text crosses the gateway as valid
Unicode both ways (serve/gateway.py), so no byte of it makes a call fail with a 500 or the
episode raise.
The agent runs as the run's user, outside the sandbox, in its own process group (killed with it
at the episode's end): it is the user's code, trusted like the config; the model's text reaches
it only as data. An agent that executes that text outside a sandbox, or shares state between
episodes, voids the attribution above (the model's code could then end another episode's agent
before its first call).
Not guaranteed: that an agent is deterministic (the reference loop and the pipeline give the
same episodes only if the agent's calls depend on nothing but the replies).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from gapless.config import Config
from gapless.envs.episode import Episode
from gapless.envs.math.environment import ProceduralMathEnvironment
from gapless.envs.math.problems import MathTask, generate_math_problems
from gapless.envs.turns import run_waves
from gapless.serve.gateway import Call, Channel, Exited, Gateway
from gapless.serve.transcript import NotAnExtension, Transcript, Unrenderable
from gapless.text import unicode_text
from gapless.types import Completion, Rollout, SamplingParams

OUTPUT_TAIL = 4096  # characters of an agent's stdout / stderr kept in a rollout's info


@dataclass
class _Agent:
    """A running agent: its process, its channel, its transcript, the call it is waiting on."""

    process: subprocess.Popen
    channel: Channel
    transcript: Transcript
    deadline: float
    stdout: object
    stderr: object
    pending: Call | None = None
    called: bool = False  # the first call came (its rendering replaced the episode's prompt)


class AgentEnvironment:
    name = "agent"

    def __init__(
        self,
        math: ProceduralMathEnvironment,
        command: Sequence[str],
        timeout_s: float = 60.0,
        max_calls: int = 4,
        max_context_tokens: int = 512,
        max_new_tokens: int = 24,
        sessions: int = 8,
    ):
        if not command or shutil.which(command[0]) is None:
            raise FileNotFoundError(
                f"agent.command: {command[0] if command else '(empty)'!r} is not an executable "
                'on PATH; give the agent program to run, e.g. "python examples/openai_agent.py"'
            )
        self.math, self.command = math, list(command)
        self.timeout_s, self.max_calls = timeout_s, max_calls
        self.max_context, self.max_new_tokens = max_context_tokens, max_new_tokens
        self.sessions = sessions
        self.pool = ThreadPoolExecutor(max_workers=sessions, thread_name_prefix="agent")
        self._gateway: Gateway | None = None
        self._lock = threading.Lock()
        self._live: dict[int, subprocess.Popen] = {}  # agents not yet reaped, by pid

    # ---- tasks and teacher: the arithmetic task's --------------------------------------------
    def tasks(self, split) -> Sequence[MathTask]:
        return self.math.tasks(split)

    def reference(self, task: MathTask) -> str:
        return self.math.reference(task)

    def demonstration(self, task: MathTask, rng) -> str:
        return self.math.demonstration(task, rng)

    def score_groups(self, tasks: Sequence[MathTask], groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        """Single-turn grading of given texts (no agent runs), as the math task grades them."""
        return self.math.score_groups(tasks, groups)

    def max_context_tokens(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return max(self.max_context, prompt_tokens + max_new_tokens)

    # ---- episodes ---------------------------------------------------------------------------
    def rollout_groups(
        self,
        generator,
        tasks: Sequence[MathTask],
        group_size: int,
        params: SamplingParams | Sequence[SamplingParams],
        encode: Callable[[str], list[int]],
    ) -> list[list[Rollout]]:
        """The reference loop: waves of `sessions` agents (envs/turns.py)."""
        return run_waves(self, generator, tasks, group_size, params, encode, self.pool)

    def start_episode(self, task: MathTask, prompt_ids: list[int]) -> Episode:
        """An episode not started yet: its context is the agent's first call (`open_episode`)."""
        return Episode(task, list(prompt_ids))

    def open_episode(self, episode: Episode, encode) -> None:
        """Start the agent and wait for its first call (or its end)."""
        channel, base_url = self.gateway.open()
        env = dict(
            os.environ,
            OPENAI_BASE_URL=base_url,
            OPENAI_API_KEY="gapless",
            GAPLESS_PROMPT=episode.task.prompt,
            GAPLESS_TASK_UID=episode.task.uid,
        )
        stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        try:
            process = subprocess.Popen(
                self.command, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True
            )
        except OSError as exc:
            self.gateway.forget(channel)
            episode.finish("infra_error", error=f"agent.command could not start: {exc}")
            return
        with self._lock:
            self._live[process.pid] = process
        threading.Thread(
            target=lambda: channel.events.put(Exited(process.wait())), daemon=True, name=f"agent-{process.pid}"
        ).start()
        episode.session = _Agent(
            process, channel, Transcript(encode), time.monotonic() + self.timeout_s, stdout, stderr
        )
        self._await_call(episode)

    def take_turn(self, episode: Episode, completion: Completion, encode) -> None:
        """Answer the agent's waiting call with this turn; wait for its next call or its end."""
        agent: _Agent = episode.session
        episode.add_model_turn(completion)
        text = unicode_text(completion.text)  # what the agent receives, so what its next call must echo
        agent.transcript.answered(text, completion.token_ids)
        call, agent.pending = agent.pending, None
        agent.channel.answer(
            call,
            text,
            list(completion.token_ids),
            list(completion.logprobs),
            list(completion.versions),
            completion.finish_reason,
            len(episode.context) - len(completion.token_ids),
        )
        self._await_call(episode)

    def _await_call(self, episode: Episode) -> None:
        agent: _Agent = episode.session
        while True:
            event = agent.channel.next(agent.deadline - time.monotonic())
            if event is None:
                return self._end(
                    episode, "timeout", detail=f"the agent ran past agent.timeout_s ({self.timeout_s:g} s)"
                )
            if isinstance(event, Exited):
                return self._exited(episode, event.returncode)
            messages = event.messages
            if not agent.called:
                try:
                    ids = agent.transcript.first(messages)
                except Unrenderable as exc:  # the agent's own first messages: it may try again or exit
                    agent.channel.refuse(event, str(exc), "unrenderable")
                    continue
                agent.called = True
                if len(ids) + self.max_new_tokens > self.max_context:
                    agent.channel.refuse(
                        event,
                        f"the first call's {len(ids)} tokens leave no room for a reply within "
                        f"agent.max_context_tokens ({self.max_context})",
                        "context_length_exceeded",
                    )
                    return self._end(episode, "context_limit")
                episode.prompt_ids = ids
                agent.pending = event
                return None
            if episode.turns >= self.max_calls:
                agent.channel.refuse(
                    event, f"this episode has made agent.max_calls ({self.max_calls}) calls", "call_limit"
                )
                return self._end(episode, "call_limit")
            try:
                text, ids = agent.transcript.extend(messages)
            except Unrenderable as exc:  # the messages may hold the model's text: a refusal, never a raise
                agent.channel.refuse(event, str(exc), "unrenderable")
                continue
            except NotAnExtension as exc:
                agent.channel.refuse(
                    event, f"{exc}: the gateway trains one token sequence per episode", "context_not_extended"
                )
                continue  # the transcript is unchanged: the next call must still extend the last one
            if len(episode.context) + len(ids) + self.max_new_tokens > self.max_context:
                agent.channel.refuse(
                    event,
                    f"the context would pass agent.max_context_tokens ({self.max_context})",
                    "context_length_exceeded",
                )
                return self._end(episode, "context_limit")
            episode.add_environment_text(text, ids)
            agent.pending = event
            return None

    def _exited(self, episode: Episode, returncode: int) -> None:
        agent: _Agent = episode.session
        out, err = _tail(agent.stdout), _tail(agent.stderr)
        if not agent.called:
            return self._end(
                episode,
                "infra_error",
                error=f"the agent exited ({returncode}) before calling the model: "
                f"{err.strip()[-300:] or out.strip()[-300:] or 'no output'}",
            )
        if returncode != 0:
            return self._end(episode, "agent_error", returncode=returncode, stderr=err[-OUTPUT_TAIL:])
        lines = [line for line in out.splitlines() if line.strip()]
        answer = lines[-1].strip() if lines else ""
        [[graded]] = self.math.score_groups([episode.task], [[Completion([], [], [], [], "stop", answer)]])
        return self._end(episode, graded.status, graded.reward, answer=answer, reference=episode.task.answer)

    def _end(self, episode: Episode, status: str, reward: float = 0.0, **info) -> None:
        episode.finish(status, reward, **info)
        self._stop(episode)

    def _stop(self, episode: Episode) -> None:
        agent: _Agent | None = episode.session
        if agent is None:
            return
        episode.session = None
        self.gateway.forget(agent.channel)  # a waiting call gets a 410
        if agent.process.poll() is None:
            try:
                os.killpg(agent.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.process.wait()
        with self._lock:
            self._live.pop(agent.process.pid, None)
        agent.stdout.close()
        agent.stderr.close()

    def to_rollout(self, episode: Episode) -> Rollout:
        if not episode.is_done:  # the driver ran out of turns: the agent is still waiting on a call
            self._end(episode, "call_limit")
        info = {**episode.info, "calls": episode.turns}
        return Rollout(episode.task.uid, episode.to_completion(), episode.reward, episode.status, info)

    def discard(self, episode: Episode) -> None:
        self._stop(episode)

    @property
    def live_agents(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def gateway(self) -> Gateway:
        with self._lock:
            if self._gateway is None:
                self._gateway = Gateway()
            return self._gateway

    def close(self) -> None:
        """Kill every agent still running (episodes in flight at the run's end, or cut), then stop."""
        with self._lock:
            live = list(self._live.values())
        for process in live:  # an episode thread waiting on one of them wakes on its exit
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.pool.shutdown(wait=True)
        for process in live:
            process.wait()
        with self._lock:
            for process in live:
                self._live.pop(process.pid, None)
        if self._gateway is not None:
            self._gateway.close()


def _tail(handle) -> str:
    handle.seek(0, os.SEEK_END)
    size = handle.tell()
    handle.seek(max(0, size - OUTPUT_TAIL))
    return handle.read().decode("utf-8", "replace")


def make_agent_environment(cfg: Config) -> AgentEnvironment:
    task = cfg.task
    splits = {
        split: generate_math_problems(cfg.seed, split, count, task.levels)
        for split, count in (("train", task.num_train_prompts), ("eval", task.num_eval_prompts))
    }
    math = ProceduralMathEnvironment(splits, teacher_error_frac=cfg.warmstart.overfit_frac, lenient=task.math_lenient)
    a = cfg.agent
    return AgentEnvironment(
        math,
        shlex.split(a.command or ""),
        a.timeout_s,
        a.max_calls,
        a.max_context_tokens,
        cfg.generator.max_new_tokens,
        a.sessions,
    )
