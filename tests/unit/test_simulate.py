"""The capacity simulator: closed-form pipelines, reuse of the real admission and buffer code,
calibration round trips, and the simulated run directory."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sim_pipelines import G, P, config, constant_costs

from gapless.config import load_config
from gapless.orchestrate.admission import Admission
from gapless.orchestrate.buffer import StalenessBuffer
from gapless.orchestrate.dispatch import Dispatcher
from gapless.orchestrate.ledger import GroupLedger, check_ledger, read_events
from gapless.simulate import simulate
from gapless.simulate.calibrate import calibrate, compare, joint_error, read_run, refine
from gapless.simulate.costs import Costs, EnvCost, GenerationCost, LengthModel, RelayCost, TrainerCost
from gapless.simulate.record import write_run
from gapless.simulate.run import Simulation


@pytest.mark.parametrize("micro_batch_size,positions", [(64, 8 * 40), (4, 4 * 18 + 4 * 40)])
def test_a_training_step_costs_the_padded_positions_of_the_trainers_micro_batches(micro_batch_size, positions):
    # every 2nd group runs to the cap (32 tokens), the others end at L = 10; prompts are 8 tokens:
    # 4 rows of 40 and 4 of 18. One micro-batch pads all 8 rows to 40; micro-batches of 4 rows
    # put the short rows together (4 x 18 + 4 x 40, nothing padded).
    costs = replace(constant_costs(0.01, 0.3), trainer=TrainerCost(1e-3))
    cfg = config(0, steps=3, **{"generator.force_long_every": "2", "trainer.micro_batch_size": str(micro_batch_size)})
    for step in Simulation(cfg, costs).run().steps:
        assert step.train_s == pytest.approx(1e-3 * positions)


def test_sync_constant_costs_closed_form():
    # g = L x 0.01 = 0.1 s to generate a step (all groups decode together), T = 0.3 s to train:
    # a synchronous step is g + T = 0.4 s; the trainer waits g of it, the generator T.
    result = Simulation(config(0), constant_costs(0.01, 0.3)).run()
    s = result.summary()
    assert s["s_per_sample"] == pytest.approx(0.4 / (P * G))
    assert s["trainer_idle_frac"] == pytest.approx(0.1 / 0.4)
    assert s["generator_idle_frac"] == pytest.approx(0.3 / 0.4)
    assert s["staleness_max"] == 0


def test_async_trainer_bound_closed_form():
    # budget 1, g = 0.1 < T = 0.3. The trainer handles the replicas' Loaded messages on arrival,
    # also while it trains (pipeline.py training()): the groups born at the version just
    # published are admitted at once and generated during the step, so from step 2 on a step
    # takes T, the trainer never waits, and the generator idles 1 - g / T.
    result = Simulation(config(1), constant_costs(0.01, 0.3)).run()
    ends = [r.end_s for r in result.steps]
    s = result.summary()
    assert all(b - a == pytest.approx(0.3) for a, b in zip(ends, ends[1:]))
    assert s["s_per_sample"] == pytest.approx(0.3 / (P * G))
    assert s["trainer_idle_frac"] == pytest.approx(0.0, abs=1e-12)
    assert s["generator_idle_frac"] == pytest.approx(1 - 0.1 / 0.3)
    assert s["staleness_max"] == 1


def test_async_generator_bound_two_batches_in_flight():
    # budget 1, g = 0.5 > T = 0.1, and a decode step costs the same for any batch: the real
    # admission bound (v + 2) P keeps two batches in flight, generated together; each published
    # version's groups are admitted when its Loaded arrives. Two steps take g + T in steady state.
    result = Simulation(config(1, steps=12), constant_costs(0.05, 0.1)).run()
    ends = [r.end_s for r in result.steps]
    assert ends[11] - ends[9] == pytest.approx(0.5 + 0.1)
    assert ends[10] - ends[8] == pytest.approx(0.5 + 0.1)


def test_admission_at_take_only_pairs_the_steps():
    # pipeline.admit_while_training = 'off': the trainer handles Loaded only while it waits in
    # take(). Budget 1, g = 0.1 < T = 0.3: at a step's end the next batch (born one version back,
    # generated during that step) is ready, so it trains at once, and nothing born at the new
    # version is admitted until it waits again. Steps come in pairs: T, then g + T (it waits g
    # for the batch admitted at its wait; the two batches in flight are decoded together, a
    # decode step here costing the same for any batch). The summary covers steps 2-8: three
    # waits of g and three generations of g in (ends[7] - ends[0]).
    result = Simulation(config(1, **{"pipeline.admit_while_training": '"off"'}), constant_costs(0.01, 0.3)).run()
    ends = [r.end_s for r in result.steps]
    s = result.summary()
    assert ends[7] - ends[5] == pytest.approx(2 * 0.3 + 0.1)
    assert ends[7] - ends[6] == pytest.approx(0.3)
    window = ends[7] - ends[0]
    assert s["s_per_sample"] == pytest.approx(window / 7 / (P * G))
    assert s["trainer_idle_frac"] == pytest.approx(3 * 0.1 / window)
    assert s["generator_idle_frac"] == pytest.approx(1 - 3 * 0.1 / window)
    assert s["staleness_max"] == 1


def test_admission_at_take_only_generator_bound():
    # 'off', budget 1, g = 0.5 > T = 0.1, a decode step costing the same for any batch: two
    # batches in flight are generated together; the second is ready when the first is trained,
    # so it trains at once and admits nothing born at the new version until it next waits. Two
    # steps take g + 2 T in steady state.
    off = {"pipeline.admit_while_training": '"off"'}
    ends = [r.end_s for r in Simulation(config(1, steps=12, **off), constant_costs(0.05, 0.1)).run().steps]
    assert ends[11] - ends[9] == pytest.approx(0.5 + 2 * 0.1)
    assert ends[10] - ends[8] == pytest.approx(0.5 + 2 * 0.1)
    assert ends[11] - ends[10] == pytest.approx(0.1)  # the second of a pair: ready, trained at once


def test_auto_admission_takes_turns_where_the_trainer_borrows_the_cores():
    # 'auto' resolves as the real trainer does (pipeline.py): 'off' with core lending (shared
    # cores, a budget, lend_idle_cores), 'on' without.
    costs = replace(constant_costs(0.01, 0.3), parallel_efficiency=1.0)
    shared = {"simulate.placement": '"shared"', "simulate.cores": "2"}

    def ends(**extra):
        return [r.end_s for r in Simulation(config(1, **shared, **extra), costs).run().steps]

    assert ends() == ends(**{"pipeline.admit_while_training": '"off"'})
    assert ends() != ends(**{"pipeline.admit_while_training": '"on"'})
    no_lending = {"pipeline.lend_idle_cores": "false"}
    assert ends(**no_lending) == ends(**no_lending, **{"pipeline.admit_while_training": '"on"'})


def test_the_trainer_borrows_the_generators_core_only_while_nothing_is_scored_closed_form():
    # Shared 2 cores, budget 1, admission on Loaded: each step's groups are decoded at once (free
    # here) and scored for w = 0.2 s without CPU while the trainer trains T = 0.3 s of one
    # thread's work; with the generator's core lent it runs twice as fast. Lending through the
    # scoring (the rule before 2026-12-06), the trainer takes T / 2 = 0.15 s and then waits 0.05
    # for the scoring: steps of 0.2 s. Handing the core back while a group is scored
    # (orchestrate/lending.py), the first 0.2 s run on one thread and the rest of the work (0.1)
    # on two: 0.25 s, no wait. (Scoring that uses no CPU, as here, is where lending through it pays.)
    costs = replace(
        constant_costs(1e-6, 0.3), parallel_efficiency=1.0, env=EnvCost(cpu_s=0.0, wait_p50_s=0.2, wait_p99_s=0.2)
    )

    def steps(lend_while_scoring: str):
        cfg = config(
            1,
            **{
                "simulate.placement": '"shared"',
                "simulate.cores": "2",
                "pipeline.admit_while_training": '"on"',
                "pipeline.lend_while_scoring": lend_while_scoring,
            },
        )
        return Simulation(cfg, costs).run().steps[1:]

    through, handed_back = steps("true"), steps("false")
    assert [r.train_s for r in through] == pytest.approx([0.15] * 7, rel=1e-3)  # the decode's 1e-5 s aside
    assert [r.waited_s for r in through] == pytest.approx([0.05] * 7, rel=1e-3)
    assert [r.train_s for r in handed_back] == pytest.approx([0.25] * 7, rel=1e-3)
    assert [r.waited_s for r in handed_back] == pytest.approx([0.0] * 7, abs=1e-4)


@pytest.mark.parametrize("decode_step_s, train_s", [(0.01, 0.3), (0.05, 0.1)])
def test_a_continuous_inbox_changes_nothing_without_drops(decode_step_s, train_s):
    # simulate.trainer_inbox = 'continuous' (a rollout controller that admits on its own, as for
    # the published systems) also handles scored groups on arrival. Loaded is handled on arrival
    # either way and nothing is dropped here, so the two disciplines time every step alike.
    take = Simulation(config(1, steps=12), constant_costs(decode_step_s, train_s)).run()
    continuous = Simulation(
        config(1, steps=12, **{"simulate.trainer_inbox": '"continuous"'}), constant_costs(decode_step_s, train_s)
    ).run()
    assert [r.end_s for r in take.steps] == pytest.approx([r.end_s for r in continuous.steps])


def test_shared_cores_sync_closed_form():
    # shared placement on 2 cores, costs given per core, perfect scaling: each actor uses both
    # cores in its turn, so a synchronous step is (g + T) / 2.
    cfg = config(0, **{"simulate.placement": '"shared"', "simulate.cores": "2"})
    costs = replace(constant_costs(0.01, 0.3), parallel_efficiency=1.0)
    assert Simulation(cfg, costs).run().summary()["s_per_sample"] == pytest.approx(0.2 / (P * G))


def test_shared_cores_contention_slows_both():
    # budget 1 on 1 core, g = 0.1, T = 0.3, the actors share the core. The groups of each new
    # version are admitted on arrival of its Loaded and decoded while the trainer trains: both
    # run at half speed until the batch is generated (0.2 s), then the trainer alone. Every step
    # costs the core g + T, as a synchronous one does: async gains nothing without idle cores.
    costs = replace(constant_costs(0.01, 0.3), parallel_efficiency=1.0)
    shared = {"simulate.placement": '"shared"', "simulate.cores": "1", "pipeline.lend_idle_cores": "false"}
    sync = Simulation(config(0, **shared), costs).run().summary()["s_per_sample"]
    result = Simulation(config(1, steps=12, **shared), costs).run()
    ends = [r.end_s for r in result.steps]
    assert sync == pytest.approx(0.4 / (P * G))
    assert ends[11] - ends[10] == pytest.approx(0.4)
    assert ends[10] - ends[9] == pytest.approx(0.4)
    # 'off': nothing overlaps; the two batches in flight are decoded together (a decode step here
    # costs the same for any batch) and two steps take 2 T + g, the second of a pair ready at once
    off = Simulation(config(1, steps=12, **shared, **{"pipeline.admit_while_training": '"off"'}), costs).run()
    ends = [r.end_s for r in off.steps]
    assert ends[11] - ends[9] == pytest.approx(2 * 0.3 + 0.1)
    assert ends[11] - ends[10] == pytest.approx(0.3)


def test_groups_scored_at_once_share_the_sandboxs_slots():
    # The environment has one sandbox pool: sandbox.concurrency programs at once over every group
    # it scores. P = 4 groups of G = 2 finish together; 2 workers score 2 groups at a time, each
    # with 1 s of CPU, on 2 slots (cores to spare): each group gets 1 slot, so scoring takes
    # 2 rounds x 1 s (2 slots per group, the old model, would take 2 x 0.5 s).
    shared = {
        "simulate.placement": '"shared"',
        "simulate.cores": "16",
        "sandbox.concurrency": "2",
        "pipeline.env_workers": "2",
    }
    costs = replace(constant_costs(1e-4, 1e-4), env=EnvCost(cpu_s=1.0, cpu_sigma=0.0), parallel_efficiency=1.0)
    result = Simulation(config(0, steps=3, **shared), costs).run()
    ends = [r.end_s for r in result.steps]
    assert ends[2] - ends[1] == pytest.approx(2.0, abs=0.01)


@pytest.mark.parametrize("runnable,seconds", [(1.0, 2.0), (0.5, 4.0), (0.25, 8.0)])
def test_sandbox_programs_count_for_the_share_of_them_runnable(runnable, seconds):
    # The test above with the sandbox's programs counted at a share of their threads (costs.py
    # sandbox_runnable): the 2 slots count for 2 x runnable threads, so 1 s of CPU per group
    # takes 1 / runnable s, and the step's 2 rounds of 2 groups 2 / runnable s, even with cores
    # to spare.
    shared = {
        "simulate.placement": '"shared"',
        "simulate.cores": "16",
        "sandbox.concurrency": "2",
        "pipeline.env_workers": "2",
    }
    costs = replace(
        constant_costs(1e-4, 1e-4),
        env=EnvCost(cpu_s=1.0, cpu_sigma=0.0),
        parallel_efficiency=1.0,
        sandbox_runnable=runnable,
    )
    ends = [r.end_s for r in Simulation(config(0, steps=3, **shared), costs).run().steps]
    assert ends[2] - ends[1] == pytest.approx(seconds, abs=0.01)


@pytest.mark.parametrize("barrier_teams,ends", [(False, (1.0, 1.0)), (True, (1.25, 1.0))])
def test_an_openmp_team_runs_at_one_threads_share_on_oversubscribed_cores(barrier_teams, ends):
    # 2 cores, perfect scaling: a 2-thread team (decode) and 2 sandbox programs, 1 s of work each at
    # speed 1. Fair share: each gets 1 core, both end at 1 s. Teams: the team runs at one thread's
    # share (2 / 4 = 0.5) while the programs run at 1: they end at 1 s, the team has 0.5 s of work
    # left and then both cores (speed 2): it ends at 1.25 s.
    from gapless.simulate.clock import EventLoop
    from gapless.simulate.pool import SharedPool, Work

    loop, done = EventLoop(), {}
    pool = SharedPool(2, 1.0, barrier_teams)
    Work(loop, pool, 2, 1.0, lambda: done.setdefault("team", loop.now), team=True)
    Work(loop, pool, 2, 1.0, lambda: done.setdefault("programs", loop.now))
    loop.run(until=lambda: len(done) == 2)
    assert (done["team"], done["programs"]) == pytest.approx(ends)


@pytest.mark.parametrize(
    "barrier,contention,ends",
    [(1.0, 1.0, (1.25, 1.0)), (0.5, 1.0, (1.375, 1.0)), (1.0, 0.8, (1.5, 1.25)), (0.5, 0.8, (1.625, 1.25))],
)
def test_an_oversubscribed_pool_loses_what_its_efficiencies_say(barrier, contention, ends):
    # The team of the test above (a 2-thread decode, 1 s of work) beside 2 sandbox programs (1 s),
    # 2 cores. The team runs at one thread's share (0.5) x barrier, every job x contention while
    # the 4 threads oversubscribe the cores; the team alone after (cap 2 on 2 cores) runs at 2:
    #   none:        team 0.5, programs 1 until 1 s; team 0.5 left at 2: 1.25 s
    #   barrier 0.5: team 0.25, programs 1 until 1 s; team 0.75 left: 1.375 s
    #   contention:  team 0.4, programs 0.8 until 1.25 s; team 0.5 left: 1.5 s
    #   both:        team 0.2, programs 0.8 until 1.25 s; team 0.75 left: 1.625 s
    from gapless.simulate.clock import EventLoop
    from gapless.simulate.pool import SharedPool, Work

    loop, done = EventLoop(), {}
    pool = SharedPool(2, 1.0, barrier_teams=True, barrier_efficiency=barrier, contention_efficiency=contention)
    Work(loop, pool, 2, 1.0, lambda: done.setdefault("team", loop.now), team=True)
    Work(loop, pool, 2, 1.0, lambda: done.setdefault("programs", loop.now))
    loop.run(until=lambda: len(done) == 2)
    assert (done["team"], done["programs"]) == pytest.approx(ends)


@pytest.mark.parametrize(
    "decode_first,cap,ends", [(False, 1, (2.5, 2.5)), (True, 1, (1.0, 2.5)), (True, 2, (3.0, 3.0))]
)
def test_a_one_thread_decode_is_served_first_where_the_pool_says_so(decode_first, cap, ends):
    # 2 cores, perfect scaling: a decode (1 s of work at speed 1) beside the sandbox's programs
    # (cap 4, 4 s of work). Shared by thread count: 2 / 5 of a core each, the decode at 0.4 and the
    # programs at 1.6: both end at 2.5 s. Decode first: the decode runs at 1 and ends at 1 s, the
    # programs get the other core (speed 1) until then and both after (speed 2): 1 + 3 / 2 = 2.5 s.
    # A two-thread decode is never served first: as a team at one thread's share (2 / 6) beside
    # the programs (4 / 3), both end at 3 s.
    from gapless.simulate.clock import EventLoop
    from gapless.simulate.pool import SharedPool, Work

    loop, done = EventLoop(), {}
    pool = SharedPool(2, 1.0, barrier_teams=True, decode_first=decode_first)
    Work(loop, pool, cap, 1.0, lambda: done.setdefault("decode", loop.now), team=True, first=True)
    Work(loop, pool, 4, 4.0, lambda: done.setdefault("programs", loop.now))
    loop.run(until=lambda: len(done) == 2)
    assert (done["decode"], done["programs"]) == pytest.approx(ends)


def test_decodes_served_first_leave_the_others_a_core_or_are_not_served_first():
    # 2 cores, decode first: two one-thread decodes would take both cores and stop the programs
    # (cap 2), so nobody is served first: all at 2 / 4 of a core, the programs (1 s of work) at
    # speed 1 end at 1 s, the decodes (1 s each) have 0.5 s left and a core each: they end at 1.5 s.
    from gapless.simulate.clock import EventLoop
    from gapless.simulate.pool import SharedPool, Work

    loop, done = EventLoop(), {}
    pool = SharedPool(2, 1.0, barrier_teams=True, decode_first=True)
    for name in ("a", "b"):
        Work(loop, pool, 1, 1.0, lambda name=name: done.setdefault(name, loop.now), team=True, first=True)
    Work(loop, pool, 2, 1.0, lambda: done.setdefault("programs", loop.now))
    loop.run(until=lambda: len(done) == 3)
    assert (done["a"], done["b"], done["programs"]) == pytest.approx((1.5, 1.5, 1.0))


@pytest.mark.parametrize("threads,barrier_teams,step_s", [(2, False, 0.3), (2, True, 0.6), (1, True, 0.3)])
def test_the_simulated_decode_and_training_are_teams(threads, barrier_teams, step_s):
    # budget 1, groups admitted on arrival: a batch's decode (10 steps x 0.03 s = 0.3 s of work) and
    # the previous batch's training (0.3 s) overlap on 2 cores. With 2 threads each (4 on 2 cores)
    # fair sharing gives each actor 1 core: 0.3 s per step; as teams each runs at one thread's
    # share, 0.5: 0.6 s. With 1 thread each nothing is oversubscribed: 0.3 s either way.
    costs = replace(constant_costs(0.03, 0.3), parallel_efficiency=1.0, barrier_teams=barrier_teams)
    cfg = config(
        1,
        steps=8,
        **{
            "simulate.placement": '"shared"',
            "simulate.cores": "2",
            "pipeline.lend_idle_cores": "false",
            "pipeline.generator_threads": str(threads),
            "pipeline.trainer_threads": str(threads),
            "simulate.trainer_inbox": '"continuous"',
        },
    )
    ends = [r.end_s for r in Simulation(cfg, costs).run().steps]
    assert ends[5] - ends[4] == pytest.approx(step_s)


def heavy_costs() -> Costs:
    return Costs(
        GenerationCost(1e-3, 1e-4, 1e-5),
        LengthModel(12, sigma=1.2, truncated_frac=0.1),
        TrainerCost(1e-5),
        EnvCost(cpu_s=0.002, wait_p50_s=0.01, wait_p99_s=0.05),
        RelayCost(latency_s=1e-3),
        prompt_tokens=8,
    )


@pytest.mark.parametrize(
    "budget,levers",
    [
        (0, {}),
        (2, {"pipeline.oversample": "0.5"}),
        (1, {"pipeline.dynamic_sampling": "true", "pipeline.curriculum": '"pass_rate"'}),
        (3, {"pipeline.partial_rollout_s": "0.02", "generator.max_batch": "8", "generator.force_long_every": "3"}),
    ],
)
def test_real_buffer_ledger_rules_hold(tmp_path, budget, levers):
    # the simulator drives the real StalenessBuffer and the trainer's Dispatcher: the ledger it writes obeys
    # the same rules as a real run's, and no trained group is staler than the budget
    cfg = config(budget, steps=15, **levers)
    ledger = GroupLedger(tmp_path / "groups.jsonl")
    sim = Simulation(cfg, heavy_costs(), ledger)
    assert type(sim.buffer) is StalenessBuffer and type(sim.dispatcher) is Dispatcher
    assert type(sim.dispatcher.admission) is Admission
    result = sim.run()
    events = read_events(tmp_path / "groups.jsonl")
    check_ledger(events, 15, P)
    trained = [e for e in events if e["event"] == "trained"]
    assert max(e["staleness"] for e in trained) <= budget
    assert all(e["staleness"] == e["step"] - e["oldest_version"] for e in trained)
    admitted = sum(e["event"] == "admitted" for e in events)
    assert admitted == sim.dispatcher.admission.admitted
    dropped = {}
    for e in events:
        if e["event"] == "dropped":
            dropped[e["reason"]] = dropped.get(e["reason"], 0) + 1
    assert dropped == result.drops
    if "pipeline.oversample" in levers:
        assert dropped.get("straggler", 0) + dropped.get("surplus", 0) > 0
    if "pipeline.dynamic_sampling" in levers:
        assert dropped.get("zero_variance", 0) > 0
    if "pipeline.partial_rollout_s" in levers:
        assert result.steps[-1].partial_cuts > 0


def test_curriculum_is_fed_by_simulated_rewards(tmp_path):
    # pass_rate picks depend on the rewards fed back; uniform picks are the reference loop's order
    picks = {}
    for curriculum in ("uniform", "pass_rate"):
        cfg = config(1, steps=10, **{"pipeline.curriculum": f'"{curriculum}"', "task.num_train_prompts": "6"})
        ledger = GroupLedger(tmp_path / f"{curriculum}.jsonl")
        Simulation(cfg, heavy_costs(), ledger).run()
        picks[curriculum] = [
            e["uid"] for e in read_events(tmp_path / f"{curriculum}.jsonl") if e["event"] == "admitted"
        ]
    assert picks["uniform"] != picks["pass_rate"]


def test_deterministic():
    a = Simulation(config(2, steps=10), heavy_costs()).run().summary()
    b = Simulation(config(2, steps=10), heavy_costs()).run().summary()
    assert a == b


def simulated_runs(tmp_path, truth: Costs, budgets) -> list:
    """The default job at each budget on 2 cores, simulated with `truth` and written as run directories."""
    runs = []
    for budget in budgets:
        cfg = load_config(
            None,
            {
                "pipeline.max_staleness": str(budget),
                "loop.steps": "8",
                "simulate.cores": "2",
                "simulate.timeline_steps": "8",
            },
        )
        run_dir = tmp_path / f"b{budget}"
        write_run(Simulation(cfg, truth).run(), run_dir, cfg.model_dump(mode="json"), truth)
        runs.append(run_dir)
    return runs


def test_calibration_round_trip(tmp_path):
    # a run simulated with known costs, written as a run directory, calibrates back to costs
    # that predict it (the fit is by simulation, so it must recover its own model)
    # prompts of 24 tokens, read from the runs' rollout/prompt_len_mean (the config says 64)
    truth = Costs(
        GenerationCost(1.2e-3, 1e-4),
        LengthModel(15, 0.5, 0.3),
        TrainerCost(1.5e-4),
        EnvCost(cpu_s=0.01),
        RelayCost(latency_s=2e-4),
        prompt_tokens=24,
        parallel_efficiency=0.7,
    )
    costs, rows = calibrate(simulated_runs(tmp_path, truth, (0, 1)), cores=2)
    assert costs.prompt_tokens == 24
    for row in rows:
        assert abs(row["error"]) < 0.03
        assert row["predicted_trainer_idle"] == pytest.approx(row["measured_trainer_idle"], abs=0.03)
        assert row["predicted_generator_idle"] == pytest.approx(row["measured_generator_idle"], abs=0.03)
    assert costs.lengths.truncated_frac == pytest.approx(0.3, abs=0.08)


def test_a_runs_generator_idle_counts_the_time_it_was_blocked(tmp_path):
    # a real pipeline reports the generator's time stopped on its full queue to the environment
    # apart from its idle time; the simulator's generator idle is all time not decoding, so a run
    # read for calibration adds the two (as the fit's error does)
    run_dir = simulated_runs(tmp_path, heavy_costs(), (1,))[0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    before = read_run(run_dir, 2).generator_idle_frac
    for m in records:  # the same time, reported the way a real run splits it
        m["perf/generator_blocked_frac"] = m["perf/generator_idle_frac"] / 4
        m["perf/generator_idle_frac"] -= m["perf/generator_blocked_frac"]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in records))
    assert read_run(run_dir, 2).generator_idle_frac == pytest.approx(before)
    assert before > 0.05


def test_a_run_from_before_the_scoring_rule_is_calibrated_under_the_rule_it_ran(tmp_path):
    # the trainer borrowed the generator's threads through the scoring until 2026-12-06: a run
    # whose config.json has no pipeline.lend_while_scoring is simulated that way, not by the default
    run_dir = simulated_runs(tmp_path, heavy_costs(), (1,))[0]
    config = json.loads((run_dir / "config.json").read_text())
    assert read_run(run_dir, 2).cfg.pipeline.lend_while_scoring is False  # written by today's code: the default
    del config["pipeline"]["lend_while_scoring"]
    (run_dir / "config.json").write_text(json.dumps(config))
    assert read_run(run_dir, 2).cfg.pipeline.lend_while_scoring is True


def test_the_joint_fit_lowers_the_error_the_scaling_fit_leaves(tmp_path):
    # runs of a crowded pool (barrier and contention losses, a sandbox counting for half its
    # threads): the scaling fit leaves those at 1.0; the joint fit of all eight parameters,
    # started from it, must predict the runs better by its own objective, and still every run
    truth = Costs(
        GenerationCost(1.2e-3, 1e-4),
        LengthModel(15, 0.5, 0.0),
        TrainerCost(1.5e-4),
        EnvCost(cpu_s=0.04),
        RelayCost(latency_s=2e-4),
        prompt_tokens=64,
        parallel_efficiency=0.8,
        barrier_teams=True,
        barrier_efficiency=0.6,
        contention_efficiency=0.85,
        sandbox_runnable=0.5,
    )
    run_dirs = simulated_runs(tmp_path, truth, (0, 1, 2))
    runs = [read_run(run_dir, 2) for run_dir in run_dirs]
    scaled, _ = calibrate(run_dirs, cores=2)
    assert (scaled.barrier_efficiency, scaled.contention_efficiency, scaled.sandbox_runnable) == (1.0, 1.0, 1.0)
    joint, after, before = refine(runs, scaled, iterations=30)
    assert before == pytest.approx(joint_error(runs, scaled))
    assert after == pytest.approx(joint_error(runs, joint))
    assert after < 0.8 * before
    assert joint_error(runs, truth) < after  # the truth is in the model: the fit approaches it, not past it
    for run in runs:
        predicted = compare(run, joint)
        assert abs(predicted["error"]) < 0.05
        assert predicted["predicted_trainer_idle"] == pytest.approx(run.trainer_idle_frac, abs=0.05)


def test_the_joint_fit_never_returns_worse_than_where_it_started(tmp_path):
    # no iteration: the simplex's first points are all it tries, and a worse one is never returned;
    # `gapless simulate --calibrate` with iterations keeps the better of the two decode rules' fits
    run_dirs = simulated_runs(tmp_path, heavy_costs(), (1,))
    runs = [read_run(run_dir, 2) for run_dir in run_dirs]
    scaled, _ = calibrate(run_dirs, cores=2)
    joint, after, before = refine(runs, scaled, iterations=0)
    assert after <= before == pytest.approx(joint_error(runs, scaled))
    assert joint_error(runs, joint) == pytest.approx(after)
    both, _ = calibrate(run_dirs, cores=2, iterations=3)
    assert "joint fit, 3 iterations from each decode rule" in both.source
    assert joint_error(runs, both) <= joint_error(runs, scaled)


@pytest.mark.parametrize("decode_first", [True, False])
def test_calibration_recovers_how_the_decode_shares_the_cores(tmp_path, decode_first):
    # runs simulated on a machine whose one-thread decode is served first (or shares the cores
    # by threads): calibration fits both rules and keeps the one these runs came from
    truth = Costs(
        GenerationCost(1.2e-3, 1e-4),
        LengthModel(15, 0.5, 0.0),
        TrainerCost(1.5e-4),
        EnvCost(cpu_s=0.04),
        RelayCost(latency_s=2e-4),
        prompt_tokens=64,
        parallel_efficiency=0.8,
        barrier_teams=True,
        decode_first=decode_first,
    )
    costs, rows = calibrate(simulated_runs(tmp_path, truth, (0, 1, 2)), cores=2)
    assert costs.decode_first is decode_first
    for row in rows:
        assert abs(row["error"]) < 0.05


def test_simulate_writes_a_run_the_report_draws(tmp_path):
    cfg = load_config(
        None,
        {
            "run_dir": json.dumps(str(tmp_path / "sim")),
            "loop.steps": "4",
            "simulate.cores": "2",
            "pipeline.max_staleness": "1",
            "simulate.sweep_budgets": "[0, 1]",
        },
    )
    out = simulate(cfg, log=lambda *a: None)
    run_dir = tmp_path / "sim"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(4))
    assert {"perf/trainer_idle_frac", "perf/generator_idle_frac", "staleness/max"} <= set(metrics[0])
    lanes = {p.name for p in (run_dir / "timeline").glob("*.jsonl")}
    assert {"trainer-0.jsonl", "generator-0.jsonl", "env-0.jsonl"} <= lanes
    check_ledger(read_events(run_dir / "groups.jsonl"), 4, cfg.loop.prompts_per_step)
    assert (run_dir / "report" / "report.html").is_file()
    assert [row["max_staleness"] for row in out["sweep"]] == [0, 1]
    assert out["recommended"] is not None


def test_replica_finishes_groups_late_in_a_long_run():
    # after hours of simulated time the decode-step counter is large: rounding must not leave a
    # group a hair short of its end, re-firing its finish event at the same instant forever
    from gapless.simulate.clock import EventLoop
    from gapless.simulate.engine import Replica, SimGroup
    from gapless.simulate.pool import DedicatedPool

    # 14 simulated hours at 10,000 decode steps/s: one clock tick (7e-12 s) is 7e-8 decode steps
    loop = EventLoop()
    loop.now = 5e4
    finished = []
    replica = Replica(
        0, loop, DedicatedPool(), 1.0, GenerationCost(1e-4, 1e-7), 8, 64, finished.append, lambda *a: None
    )
    replica.k, replica.t_last = 5e7 + 0.123456789, loop.now
    for i in range(8):
        replica.add(SimGroup(i, 0, 0, [1000 + 37 * i] * 4))
    events = [0]

    def done() -> bool:
        events[0] += 1
        return len(finished) == 8 or events[0] > 10_000

    loop.run(until=done)
    assert len(finished) == 8 and events[0] < 100


@pytest.mark.parametrize(
    "lengths,order,ends_ms",
    [
        # the first two groups fill the batch; their short sequences end after one step and free the
        # four slots the third group needs: it starts then and ends first, before their long sequences
        ([[20, 1, 1, 1], [20, 1, 1, 1], [2, 2, 2, 2]], [2, 0, 1], [3.0, 20.0, 20.0]),
        # sequences that all run equally long free no slot before their group ends
        ([[5, 5, 5, 5], [5, 5, 5, 5], [5, 5, 5, 5]], [0, 1, 2], [5.0, 5.0, 10.0]),
    ],
)
def test_a_waiting_group_starts_when_enough_sequences_have_ended(lengths, order, ends_ms):
    from gapless.simulate.clock import EventLoop
    from gapless.simulate.engine import Replica, SimGroup
    from gapless.simulate.pool import DedicatedPool

    loop, finished = EventLoop(), []
    # 1 ms per decode step whatever the rows; max_batch 8 sequences = two groups of G = 4 at full occupancy
    replica = Replica(
        0,
        loop,
        DedicatedPool(),
        1.0,
        GenerationCost(1e-3, 0.0),
        8,
        8,
        lambda g: finished.append((g.index, loop.now)),
        lambda *a: None,
    )
    for i, group_lengths in enumerate(lengths):
        replica.add(SimGroup(i, 0, 0, group_lengths))
    loop.run(until=lambda: len(finished) == len(lengths), max_time_s=1.0)
    assert [i for i, _ in finished] == order
    assert [t * 1e3 for _, t in finished] == pytest.approx(ends_ms)


def test_simulate_refuses_a_real_run_dir(tmp_path):
    from gapless.config import ConfigError

    real = tmp_path / "real"
    real.mkdir()
    (real / "metrics.jsonl").write_text('{"step": 0}\n')
    cfg = load_config(None, {"run_dir": json.dumps(str(real)), "loop.steps": "2", "simulate.cores": "2"})
    with pytest.raises(ConfigError, match="holds a real run"):
        simulate(cfg, log=lambda *a: None)


def test_roofline_decode_step_overhead_adds_to_every_step():
    """A decode step costs overhead + weight bytes / bandwidth + rows x per-row cost (closed form)."""
    from gapless.simulate import resolve_costs

    base = {
        "simulate.placement": '"split"',
        "simulate.params": "1e9",
        "simulate.kv_bytes_per_token": "1000",
        "simulate.device_flops": "1e15",
        "simulate.device_memory_bw": "2e12",
    }
    plain = resolve_costs(load_config(None, base)).generation
    slow = resolve_costs(load_config(None, {**base, "simulate.decode_step_overhead_s": "0.004"})).generation
    assert plain.step_s == pytest.approx(1e9 * 2.0 / 2e12)  # bf16 weights read once per step
    assert slow.step_s == pytest.approx(plain.step_s + 0.004) and slow.row_s == plain.row_s
    assert slow.decode_step_s(8) - plain.decode_step_s(8) == pytest.approx(0.004)
