"""Central admission over generator replicas (orchestrate/dispatch.py): closed-form cases."""

from __future__ import annotations

from gapless.orchestrate.admission import Admission, PromptSource
from gapless.orchestrate.dispatch import Dispatcher

P = 4


def _dispatcher(budget: int, replicas: int, oversample: float = 0.0) -> Dispatcher:
    d = Dispatcher(Admission(P, budget, oversample), PromptSource(0, [f"t{i}" for i in range(50)], P))
    for r in range(replicas):
        d.loaded(r, 0)
    return d


def test_one_replica_gets_what_generator_side_admission_gave():
    d = _dispatcher(budget=1, replicas=1)
    out = d.assign()
    prompts = PromptSource(0, [f"t{i}" for i in range(50)], P)
    assert out == {0: [(i, prompts.task_for(i), 0) for i in range(2 * P)]}  # (v + s + 1) * P at version 0
    assert d.assign() == {}  # nothing more until a newer version or a drop
    d.loaded(0, 1)
    assert [i for i, _, born in d.assign()[0]] == list(range(2 * P, 3 * P))


def test_groups_spread_over_replicas_and_lost_ones_are_returned():
    d = _dispatcher(budget=0, replicas=2)
    out = d.assign()
    assert sorted(len(v) for v in out.values()) == [P // 2, P // 2]  # least loaded first
    held_by_1 = sorted(i for i, _, _ in out[1])
    d.scored(held_by_1[0])
    assert d.lost(1) == held_by_1[1:]  # exactly the unscored ones
    assert d.assign() == {}  # no place freed yet: the trainer frees them as replica_lost drops
    d.admission.freed(len(held_by_1) - 1)
    again = d.assign()
    assert list(again) == [0] and len(again[0]) == len(held_by_1) - 1  # backfilled on the surviving replica


def test_a_lagging_replica_gets_no_group_born_stale():
    d = _dispatcher(budget=1, replicas=2)
    d.assign()
    d.loaded(0, 3)  # replica 1 still holds version 0
    d.admission.assembling(3)  # the trainer fills step 3: groups born before version 2 would already be due
    d.admission.freed(5)
    out = d.assign()
    assert list(out) == [0] and all(born == 3 for _, _, born in out[0])


def test_a_new_version_is_shared_with_a_replica_one_version_behind():
    """The replica whose Loaded is read first does not take a whole version's groups: one still a
    version behind gets its share, born at the new version (it starts them once it loads it)."""
    d = _dispatcher(budget=0, replicas=2)
    first = d.assign()
    for held in first.values():
        for index, _, _ in held:
            d.scored(index)
    d.loaded(0, 1)  # replica 1 has not reported version 1 yet
    d.admission.assembling(1)
    out = d.assign()
    assert sorted(out) == [0, 1] and [len(out[0]), len(out[1])] == [P // 2, P // 2]
    assert all(born == 1 for held in out.values() for _, _, born in held)
    d.loaded(0, 3)  # replica 1 now lags by more than one version: it gets nothing new
    d.admission.assembling(3)
    d.admission.freed(2)
    assert list(d.assign()) == [0]


def test_environment_actors_get_the_fewest_held_and_a_lost_one_returns_exactly_its_groups():
    from gapless.orchestrate.env_actors import EnvActors

    one = EnvActors(1, restarts=2)
    assert one.names == ["environment"] and not one.evictable and one.slots == 1  # today's pipeline
    one.start("spec")
    assert [one.route(i) for i in range(3)] == [0, 0, 0]

    envs = EnvActors(2, restarts=1)
    assert envs.names == ["environment-0", "environment-1", "environment-2"] and envs.evictable
    envs.start("a"), envs.start("b")
    assert [envs.route(i) for i in range(4)] == [0, 1, 0, 1]  # none ready yet: every live actor, fewest first
    envs.mark_ready("environment-1")
    assert [envs.route(i) for i in range(4, 6)] == [1, 1]  # only the ready one while another starts
    envs.mark_ready("environment-0")
    assert [envs.route(i) for i in range(6, 10)] == [0, 0, 0, 1]  # fewest held (2 vs 4), ties to the lower slot
    envs.scored(1)
    assert envs.lost(1) == [3, 4, 5, 9]  # exactly what slot 1 held and did not score
    assert list(envs.live) == [0] and envs.has_spare()
    assert envs.start("c") == 2 and not envs.has_spare()
    assert envs.route(10) == 0  # the replacement gets groups once it is ready
    envs.mark_ready("environment-2")
    assert envs.route(11) == 2
