"""The pipeline's pure parts: admission bound, the staleness buffer's rule and ledger, the
curriculum, and shared-memory weights across a real process boundary."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import time

import pytest
import torch

from gapless.cluster.watchdog import ACTORS, Heartbeats, PipelineStalled, StallWatch, process_state
from gapless.cluster.weights import SharedWeights
from gapless.orchestrate.admission import Admission, PromptSource, sample_step_tasks
from gapless.orchestrate.buffer import StalenessBuffer
from gapless.orchestrate.curriculum import PassRateCurriculum
from gapless.orchestrate.ledger import GroupLedger
from gapless.types import Admitted, Completion, Group, Rollout


def _group(index: int, born: int, rewards: list[float], versions: list[int] | None = None) -> Group:
    rollouts = [
        Rollout(
            "t",
            Completion([1], [2, 3], [-0.1, -0.2], versions or [born, born], "stop", ""),
            r,
            "ok" if r == 1 else "wrong_answer",
        )
        for r in rewards
    ]
    return Group(index=index, task_index=0, born=born, rollouts=tuple(rollouts))


def _ledger_events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("staleness,oversample", [(0, 0.0), (1, 0.0), (3, 0.0), (2, 0.5)])
def test_admission_bound(staleness, oversample):
    P = 4
    adm = Admission(P, staleness, oversample)
    for version in range(5):
        while adm.may_admit(version):
            adm.admit()
        assert adm.admitted == (version + staleness + 1) * P + adm.extra
    adm.freed(3)  # each drop frees one place for a backfill
    assert adm.may_admit(4) and adm.limit(4) - adm.admitted == 3


def test_budget_zero_admits_exactly_one_step():
    adm = Admission(3, 0, 0.0, start_step=5)
    admitted = []
    while adm.may_admit(5):
        admitted.append(adm.admit())
    assert admitted == [15, 16, 17]  # resumed at step 5: the indices of step 5's groups


def test_uniform_prompt_source_matches_sync_order():
    source = PromptSource(7, [f"u{i}" for i in range(50)], 4)
    assert [source.task_for(k) for k in range(8)] == sample_step_tasks(7, 0, 50, 4) + sample_step_tasks(7, 1, 50, 4)


def test_buffer_waits_for_due_groups_and_trains_them_first(tmp_path):
    ledger = GroupLedger(tmp_path / "g.jsonl")
    buf = StalenessBuffer(2, 1, cut_stragglers=False, ledger=ledger)
    for index in range(4):  # budget 1: version 0 may start the groups of steps 0 and 1
        buf.admitted(index, 0)
    buf.arrived(_group(2, 0, [0, 1]))
    assert not buf.is_batch_ready(0)
    buf.arrived(_group(3, 0, [0, 1]))
    assert buf.is_batch_ready(0)  # two ready; nothing is due at step 0 with budget 1
    taken, cut = buf.take(0)
    assert [g.index for g in taken] == [2, 3] and cut == []
    buf.arrived(_group(1, 0, [1, 0]))
    buf.admitted(4, 1)
    buf.arrived(_group(4, 1, [1, 0]))
    assert not buf.is_batch_ready(1)  # group 0 (born 0) is due at step 1 and still generating
    buf.arrived(_group(0, 0, [1, 1, 0]))
    assert buf.is_batch_ready(1)
    taken, cut = buf.take(1)
    assert sorted(g.index for g in taken) == [0, 1]  # the due ones, not the younger group 4
    buf.close(2)
    ledger.close()
    events = _ledger_events(tmp_path / "g.jsonl")
    ends = [e["group"] for e in events if e["event"] != "admitted"]
    assert sorted(ends) == [0, 1, 2, 3, 4] and len(ends) == len(set(ends))  # exactly once
    assert {e["group"]: e["reason"] for e in events if e["event"] == "dropped"} == {4: "run_ended"}


def test_take_never_trains_past_the_budget_of_the_oldest_token(tmp_path):
    ledger = GroupLedger(tmp_path / "g.jsonl")
    buf = StalenessBuffer(1, 1, cut_stragglers=False, ledger=ledger, uids=["t0"])
    buf.arrived(_group(0, 3, [0, 1], versions=[1, 3]))  # a resumed partial: its first token is from version 1
    buf.arrived(_group(1, 3, [0, 1]))
    taken, _ = buf.take(3)  # staleness of group 0 would be 3 - 1 = 2 > 1: dropped, not trained, no crash
    assert [g.index for g in taken] == [1] and buf.drops == {"over_budget": 1}
    ledger.close()
    events = _ledger_events(tmp_path / "g.jsonl")
    dropped = next(e for e in events if e["event"] == "dropped")
    assert dropped == {
        "group": 0,
        "event": "dropped",
        "segment": 0,
        "uid": "t0",
        "born": 3,
        "step": 3,
        "oldest_version": 1,
        "reason": "over_budget",
        "rewards": [0, 1],
        "statuses": ["wrong_answer", "ok"],
    }
    trained = next(e for e in events if e["event"] == "trained")
    assert (trained["born"], trained["oldest_version"], trained["staleness"], trained["step"]) == (3, 3, 0, 3)


def test_oversampling_cuts_due_stragglers_exactly_once(tmp_path):
    ledger = GroupLedger(tmp_path / "g.jsonl")
    buf = StalenessBuffer(2, 0, cut_stragglers=True, ledger=ledger)
    for index in range(4):
        buf.admitted(index, 0)
    buf.arrived(_group(1, 0, [0, 1]))
    assert not buf.is_batch_ready(0)
    buf.arrived(_group(3, 0, [1, 0]))
    assert buf.is_batch_ready(0)
    taken, cut = buf.take(0)
    assert [g.index for g in taken] == [1, 3] and sorted(cut) == [0, 2]
    assert buf.arrived(_group(0, 0, [1, 0])) is None and not buf.ready  # a cut group arriving late is ignored
    ledger.close()
    events = _ledger_events(tmp_path / "g.jsonl")
    assert sorted((e["group"], e.get("reason")) for e in events if e["event"] == "dropped") == [
        (0, "straggler"),
        (2, "straggler"),
    ]


def test_dynamic_sampling_drops_zero_variance_and_infra_groups(tmp_path):
    buf = StalenessBuffer(2, 0, cut_stragglers=False, ledger=GroupLedger(tmp_path / "g.jsonl"), dynamic_sampling=True)
    assert buf.arrived(_group(0, 0, [1, 1])) == "zero_variance"
    assert buf.arrived(_group(1, 0, [0, 0])) == "zero_variance"
    infra = _group(2, 0, [0, 0])
    for r in infra.rollouts:
        r.status = "infra_error"
    assert buf.arrived(infra) == "infra_error"
    assert buf.arrived(_group(3, 0, [0, 1])) is None
    assert buf.drops == {"zero_variance": 2, "infra_error": 1} and list(buf.ready) == [3]


def test_curriculum_prefers_prompts_with_signal():
    cur = PassRateCurriculum(["solved", "hopeless", "mixed"], seed=0)
    for _ in range(5):
        cur.update("solved", [1.0] * 8)
        cur.update("hopeless", [0.0] * 8)
        cur.update("mixed", [1.0] * 4 + [0.0] * 4)
    picks = [cur.uids[cur.pick()] for _ in range(2000)]
    assert picks.count("mixed") > 0.8 * len(picks)
    assert picks.count("solved") > 0 and picks.count("hopeless") > 0  # never excluded for good


def _read_weights(weights: SharedWeights, out) -> None:
    got = {}
    version = weights.fetch_into(lambda state, v: got.update({k: t.clone() for k, t in state.items()}), -1)
    out.put((version, {k: t.tolist() for k, t in got.items()}))


def test_shared_weights_cross_a_process_boundary():
    ctx = mp.get_context("spawn")
    weights = SharedWeights({"w": torch.zeros(3), "b": torch.zeros(2)}, version=0, ctx=ctx)
    weights.publish({"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0, 5.0])}, 1)
    weights.publish({"w": torch.tensor([7.0, 8.0, 9.0]), "b": torch.tensor([6.0, 6.0])}, 2)
    out = ctx.Queue()
    reader = ctx.Process(target=_read_weights, args=(weights, out))
    reader.start()
    version, state = out.get(timeout=60)
    reader.join(timeout=30)
    assert version == 2 and state == {"w": [7.0, 8.0, 9.0], "b": [6.0, 6.0]}
    assert weights.fetch_into(lambda s, v: None, have_version=2) is None  # nothing newer
    with pytest.raises(ValueError, match="not newer"):
        weights.publish({"w": torch.zeros(3), "b": torch.zeros(2)}, 2)


def test_eval_leaves_infra_errors_out_of_pass_at_1():
    from gapless.orchestrate.evaluate import EvalScore

    def rollout(status: str) -> Rollout:
        return Rollout("t", Completion([1], [2], [-0.1], [0], "stop", ""), 1.0 if status == "ok" else 0.0, status)

    # 2 ok, 1 wrong, 3 infra: pass@1 = 2 / 3 over what could be scored, 3 counted beside
    score = EvalScore.of(
        [rollout(s) for s in ("ok", "ok", "wrong_answer", "infra_error", "infra_error", "infra_error")]
    )
    assert (score.pass_at_1, score.infra_errors, score.scored) == (pytest.approx(2 / 3), 3, 3)
    nothing = EvalScore.of([rollout("infra_error")] * 4)  # a total outage is no verdict: NaN, never 0
    assert nothing.pass_at_1 != nothing.pass_at_1 and nothing.infra_errors == 4


def test_stall_watch_allows_set_up_its_own_time(tmp_path):
    """A set-up whose imports starve the beating thread is no stall while the actors start; the
    same silence after start-up is one, named in the diagnosis."""
    beats = Heartbeats(mp.get_context("spawn"))
    actor = subprocess.Popen(["sleep", "60"])  # stands in for the actor process (its state and stack dump)
    try:
        beats._pids[ACTORS.index("generator")] = actor.pid
        beats._beats[ACTORS.index("generator")] = time.monotonic() - 3.0  # silent for 3 s
        watch = StallWatch(beats, 1.0, tmp_path, ("generator",))
        watch.check("the actors to start", starting=True)
        with pytest.raises(PipelineStalled, match="waiting on generator"):
            watch.check("step 1's rollouts")
        assert "generator: pid" in (tmp_path / "stall.txt").read_text()
    finally:
        actor.kill()
        actor.wait()


def test_a_stopped_actor_gets_no_start_up_allowance(tmp_path):
    """SIGSTOP during an actor's set-up is found at stall_timeout_s, not at the 120 s allowance that
    covers slow imports: a stopped process is not slow, it does nothing."""
    beats = Heartbeats(mp.get_context("spawn"))
    actor = subprocess.Popen(["sleep", "60"])
    try:
        beats._pids[ACTORS.index("generator")] = actor.pid
        beats._beats[ACTORS.index("generator")] = time.monotonic() - 3.0  # silent for 3 s
        watch = StallWatch(beats, 1.0, tmp_path, ("generator",))
        watch.check("the actors to start", starting=True)  # running (sleeping): within its allowance
        os.kill(actor.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while not process_state(actor.pid).startswith("T") and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(PipelineStalled, match="waiting on generator"):
            watch.check("the actors to start", starting=True)
        assert "state T (stopped)" in (tmp_path / "stall.txt").read_text()
    finally:
        actor.kill()
        actor.wait()


class _BrokenSource:
    """A channel whose second read fails, as a message this process cannot unpickle does."""

    def __init__(self):
        self.reads = 0

    def get(self, *args, **kwargs):
        self.reads += 1
        if self.reads == 2:
            raise RuntimeError("cannot unpickle this message here")
        return f"item {self.reads}"


def test_a_failed_read_reaches_the_reader_as_an_error_not_a_silent_wait():
    import queue

    from gapless.orchestrate.actors import _read_into, _take
    from gapless.orchestrate.messages import ActorError
    from gapless.orchestrate.pipeline import _forward

    inbox: queue.Queue = queue.Queue()
    _forward("generator", _BrokenSource(), inbox)  # returns after the failed read
    assert inbox.get_nowait() == "item 1"
    failure = inbox.get_nowait()
    assert isinstance(failure, ActorError) and failure.actor == "generator"
    assert "could not read a message from generator" in failure.traceback and "cannot unpickle" in failure.traceback

    groups: queue.Queue = queue.Queue()
    _read_into(_BrokenSource(), groups)  # the environment's reader thread
    assert _take(groups, timeout=1) == "item 1"
    with pytest.raises(RuntimeError, match="cannot unpickle"):
        _take(groups, timeout=1)


def test_the_group_that_empties_a_replica_carries_its_report(tmp_path, tiny_policy, problems, monkeypatch):
    """A step shorter than the periodic report (STATS_EVERY_S) still gets the generator's figures:
    the group after which the replica has nothing to decode carries the report to the environment,
    which passes it on with the scored group (the CI flake where a 0.04 s smoke step had none)."""
    import queue
    import threading

    from gapless.cluster.watchdog import StopFlag
    from gapless.config import load_config
    from gapless.orchestrate import actors
    from gapless.orchestrate.messages import Assign, GenStats, ToScore

    monkeypatch.setattr(actors, "STATS_EVERY_S", 1e9)  # no periodic report during the test
    ctx = mp.get_context("spawn")
    cfg = load_config(
        None, {"run_dir": json.dumps(str(tmp_path)), "generator.group_size": "2", "generator.max_new_tokens": "4"}
    )
    tiny_policy.save(tmp_path / "policy")
    state = {k: v.detach().clone() for k, v in tiny_policy.model.state_dict().items()}
    to_env, inbox, outbox = queue.Queue(), queue.Queue(), queue.Queue()
    spec = actors.ActorSpec(
        cfg,
        "generator",
        [(p.uid, p.prompt) for p in problems[:3]],
        tmp_path / "policy",
        0,
        Heartbeats(ctx, ("generator",)),
        StopFlag(ctx),
        inbox,
        outbox,
        weights=SharedWeights(state, 0, ctx),
        to_env=(to_env,),
        max_seq_len=max(len(tiny_policy.encode(p.prompt)) for p in problems[:3]) + 4,
    )
    actor = actors._GeneratorActor(spec)
    inbox.put(Assign((Admitted(0, 0, 0), Admitted(1, 1, 0), Admitted(2, 2, 0))))
    runner = threading.Thread(target=actor.run)
    runner.start()
    try:
        scored = [to_env.get(timeout=60) for _ in range(3)]
    finally:
        spec.stop.set()
        runner.join(timeout=30)
    assert all(isinstance(item, ToScore) for item in scored)
    reports = [item.gen_stats for item in scored if item.gen_stats is not None]
    assert len(reports) == 1 and reports[0] is scored[-1].gen_stats  # the last group out, once
    stats = reports[0].stats
    assert isinstance(reports[0], GenStats) and stats["groups"] == 3 and stats["busy_s"] > 0
    assert stats["tokens"] >= 3 * 2  # at least one token per sequence, all decoded before the report
    assert outbox.empty()  # nothing went the periodic way
