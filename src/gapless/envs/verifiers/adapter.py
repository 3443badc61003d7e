"""Prime Intellect `verifiers` (v1 API, 0.4) tasks as a gapless environment: single-turn only.

A verifiers `Task` carries its data (`TaskData.prompt`, `system_prompt`) and its scoring
(`@vf.reward` and `@vf.metric` methods, config-plugged functions and judges, all async). This
adapter shows the model `prompt_text` (system prompt first, when there is one) and scores a
completion the way a verifiers rollout would at its scoring stage: a `Trace` whose message graph
is built by verifiers' own graph code (the system and user messages, then the completion as the
sampled assistant message, with its model call and finish reason), the task's `State` type, stop
condition `agent_completed`, then `await task.score(trace)`; the reward is `trace.reward` (the
weighted sum). So rewards may read `trace.last_reply`, `trace.messages`, `trace.transcript`,
`trace.assistant_messages`, `trace.is_truncated`, `trace.state` and the task data, return keyed
scores, and be slow coroutines. Scoring runs on the adapter's own event-loop thread, so it works
when called from inside a running event loop too (a notebook, an async server); the distinct
completions of a call are scored concurrently there.
Refused when the environment is built (`VerifiersUnsupported`, one line naming task and reward):
a reward, metric or judge that needs a `runtime` (a box to run in; verifiers would silently skip
it offline, so a fully correct answer would score only the other rewards), one that is not async
(verifiers awaits every reward), one that asks for an argument verifiers does not pass (only
`task`, `trace`, `runtime`), tasks with tools (multi-turn: verifiers runs those through its
own harness and model client), and two tasks with the same key (a uid must name one task).
Status: ok (reward >= 1), partial (0 < r < 1), wrong_answer (r <= 0), timeout (the task's own
`timeout.scoring`, else `SCORING_TIMEOUT_S`, expired: reward 0, as verifiers leaves the rewards
unscored), score_error (a reward raised: reward 0, counted, not raised), infra_error (the
endpoint of a plugged LLM judge unreachable or failing, a provider, sandbox or connection error
behind a reward, AND the same failure for a probe: the task scoring `PROBE_REPLY`; no reward, out
of the group statistics). Why the probe: the completion is the model's, and a reward may hand it
to a judge (which can fail on a text too long for its context) or open what it names; a failure
the probe does not share is the completion's doing, `score_error`, reward 0, so no text
buys a rollout out of its group. A file error (`OSError` other than a connection's) is never
infrastructure: a reward that reads a path the model named fails so.
Not guaranteed: stability across verifiers releases (the Trace is built with verifiers' internal
graph code) or token ids on the trace (the adapter has only text).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from gapless.config import ConfigError
from gapless.envs.base import Split
from gapless.envs.records import split_by_hash
from gapless.text import unicode_text
from gapless.types import Completion, Rollout

PROBE_REPLY = "I do not know."  # short and plain: reaches a judge (verifiers' judges skip an empty reply)
SCORING_TIMEOUT_S = (
    300.0  # when the task sets no timeout.scoring (verifiers: none): a hung reward must not hang the run
)
_PASSED_TO_REWARDS = {"task", "trace", "runtime"}


class VerifiersUnsupported(ConfigError):
    """A verifiers task whose scoring the single-turn offline adapter cannot reproduce."""


@dataclass(frozen=True)
class VerifiersTask:
    uid: str
    prompt: str
    task: Any  # the verifiers Task


class VerifiersEnvironment:
    """`train`/`eval`: verifiers tasks; with `eval=None`, 1 in 8 train tasks is held out by hash."""

    def __init__(self, train: Iterable[Any], eval: Iterable[Any] | None = None, name: str = "verifiers"):
        self.name = name
        wrapped = [self._wrap(t) for t in train]
        if eval is None:
            self.splits = {s: [t for t in wrapped if split_by_hash(t.uid) == s] for s in ("train", "eval")}
        else:
            self.splits = {"train": wrapped, "eval": [self._wrap(t) for t in eval]}
        checked: set[tuple[type, int]] = set()
        first: dict[str, Any] = {}
        for t in self.splits["train"] + self.splits["eval"]:
            if first.setdefault(t.uid, t.task) is not t.task:
                raise VerifiersUnsupported(
                    f"verifiers tasks {type(first[t.uid]).__name__} and {type(t.task).__name__} share the "
                    f"key {t.uid[:16]}... (verifiers wants keys unique in a task set): give them distinct "
                    "data or override Task.key"
                )
            if (type(t.task), id(t.task.config)) not in checked:
                check_supported(t.task)
                checked.add((type(t.task), id(t.task.config)))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _wrap(task: Any) -> VerifiersTask:
        data = task.data
        prompt = data.prompt_text if data.system_prompt is None else f"{data.system_prompt}\n\n{data.prompt_text}"
        return VerifiersTask(task.key, prompt, task)

    def tasks(self, split: Split) -> Sequence[VerifiersTask]:
        return self.splits.get(split, [])

    def score(self, task: VerifiersTask, text: str, finish_reason: str = "stop") -> tuple[float, str, dict]:
        [[rollout]] = self.score_groups([task], [[Completion([], [], [], [], finish_reason, text)]])
        return rollout.reward, rollout.status, rollout.info

    def score_groups(
        self, tasks: Sequence[VerifiersTask], groups: Sequence[Sequence[Completion]]
    ) -> list[list[Rollout]]:
        futures: dict[tuple[int, str, str], Future] = {}  # keyed on the task object: a uid is a hash of data only
        for task, completions in zip(tasks, groups):
            for c in completions:
                key = (id(task.task), c.text, c.finish_reason)
                if key not in futures:
                    futures[key] = self._submit(task, c.text, c.finish_reason)
        results = {key: future.result() for key, future in futures.items()}
        task_of = {id(t.task): t for t in tasks}
        suspects = {key[0] for key, (_, status, _) in results.items() if status == "infra_error"}
        probes = {key: self._submit(task_of[key], PROBE_REPLY, "stop") for key in suspects}  # module docstring: why
        is_down = {key: probe.result()[1] == "infra_error" for key, probe in probes.items()}
        for key, (reward, status, info) in results.items():
            if status == "infra_error" and not is_down[key[0]]:
                results[key] = (
                    0.0,
                    "score_error",
                    {
                        **info,
                        "error": f"{info.get('error', '')} (scoring failed for this "
                        "completion only: a plain reply was scored)",
                    },
                )
        return [
            [Rollout(t.uid, c, *results[(id(t.task), c.text, c.finish_reason)]) for c in cs]
            for t, cs in zip(tasks, groups)
        ]

    def _submit(self, task: VerifiersTask, text: str, finish_reason: str) -> Future:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="verifiers-scoring", daemon=True)
                self._thread.start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(score_trace(task.task, text, finish_reason), loop)

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()


def check_supported(task: Any) -> None:
    """Raise `VerifiersUnsupported` naming the first reward, metric or judge the adapter cannot run."""
    where = f"verifiers task {type(task).__name__}"
    if type(task).toolsets(task.config):
        raise VerifiersUnsupported(
            f"{where} has tools (multi-turn); the gapless adapter scores single-turn tasks only: "
            "run it with verifiers' own harness"
        )
    hooks = [("reward", fn, fn.__name__) for fn in task.hooks("reward")] + [
        ("metric", fn, fn.__name__) for fn in task.hooks("metric")
    ]
    hooks += [("judge", judge.score, judge.reward_name) for judge in task.plugged_judges()]
    for kind, fn, name in hooks:
        params = inspect.signature(fn).parameters
        runtime = params.get("runtime")
        if runtime is not None and runtime.default is inspect.Parameter.empty:
            raise VerifiersUnsupported(
                f"{where}: {kind} {name!r} needs a runtime (a box to run in), which the gapless "
                "adapter does not provide; give `runtime` a default of None or score this task "
                "set with verifiers itself"
            )
        unknown = [
            p.name
            for p in params.values()
            if p.name not in _PASSED_TO_REWARDS
            and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if unknown:
            raise VerifiersUnsupported(
                f"{where}: {kind} {name!r} asks for {unknown[0]!r}, which verifiers does not pass "
                "(a reward gets task, trace and runtime; state is trace.state)"
            )
        if not inspect.iscoroutinefunction(inspect.unwrap(fn)):
            raise VerifiersUnsupported(
                f"{where}: {kind} {name!r} is not async; verifiers awaits every {kind}: declare it `async def`"
            )


def build_trace(task: Any, text: str, finish_reason: str = "stop") -> Any:
    """The trace of a single-turn rollout whose reply is `text`, as verifiers' graph code records it."""
    from verifiers.v1 import graph
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, ModelCall, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, Response, SystemMessage, UserMessage

    data = task.data
    messages = [UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
    if data.system_prompt is not None:
        messages.insert(0, SystemMessage(content=data.system_prompt))
    trace = Trace(
        task=TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=AgentInfo(config=AgentConfig()),
    )
    reason = finish_reason if finish_reason in ("stop", "length") else None
    response = Response(
        id="gapless", created=0, model="gapless", message=AssistantMessage(content=text), finish_reason=reason
    )
    node = graph.prepare_turn(trace, messages).commit(response)
    trace.calls.append(ModelCall(node=node, model="gapless", finish_reason=reason))
    trace.stop("agent_completed")
    return trace


async def score_trace(task: Any, text: str, finish_reason: str = "stop") -> tuple[float, str, dict]:
    """(reward, status, info) of `text` under the task's own scoring; never raises for model output.
    A lone surrogate in `text` is replaced first: verifiers hashes messages as UTF-8, and no
    client could have sent it one."""
    text = unicode_text(text)
    timeout_s = task.data.timeout.scoring or SCORING_TIMEOUT_S
    try:
        trace = build_trace(task, text, finish_reason)
        async with asyncio.timeout(timeout_s):
            await task.score(trace)
        reward = float(trace.reward)
    except TimeoutError:
        return 0.0, "timeout", {"error": f"scoring took longer than {timeout_s:g} s"}
    except GeneratorExit:  # the loop is closing this coroutine: let it
        raise
    except BaseException as exc:  # noqa: BLE001 -- a scorer failing on model output is a status; on this
        # thread a SystemExit or a CancelledError from a reward would stop the loop or the future instead
        status = "infra_error" if is_infra_failure(exc) else "score_error"
        return 0.0, status, {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if not math.isfinite(reward):
        return 0.0, "score_error", {"error": "non-finite reward"}
    info: dict = {name: r.score for name, r in trace.rewards.items() if r is not None}
    info.update({f"metric/{name}": value for name, value in trace.metrics.items() if value is not None})
    status = "ok" if reward >= 1.0 else "partial" if reward > 0 else "wrong_answer"
    return reward, status, info


def is_infra_failure(exc: BaseException) -> bool:
    """Whether scoring may have failed outside the completion: a judge's endpoint unreachable,
    timing out or failing (HTTP 5xx), a provider, sandbox or interception error, a connection
    error. Only a hint: `score_groups` confirms it with a probe. verifiers wraps a reward's
    exception in `TaskError`, so the whole cause chain is read."""
    from openai import APIConnectionError, APIStatusError
    from verifiers.v1.errors import InterceptionError, ProviderError, SandboxError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ProviderError, SandboxError, InterceptionError, APIConnectionError, ConnectionError)):
            return True
        if isinstance(seen, APIStatusError) and seen.status_code >= 500:
            return True
        seen = seen.__cause__ or seen.__context__
    return False
