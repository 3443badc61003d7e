"""The per-step metrics every rollout source shares: rollouts, staleness, the trainer's step.

Names are those of docs/observability.md (`rollout/*`, `staleness/*`, `train/*`); each function
is pure (records in, a flat dict of floats out), so any source and the simulator compute them
the same way.
"""

from __future__ import annotations

from gapless.types import Rollout


def env_metrics(env) -> dict[str, float]:
    """An environment's own counters (the sandbox's: cumulative counts and recent latency
    percentiles), for those that keep any."""
    metrics = getattr(env, "metrics", None)
    return metrics() if callable(metrics) else {}


def rollout_metrics(rollouts: list[Rollout], zero_variance_groups: int, num_groups: int) -> dict[str, float]:
    rewards = [r.reward for r in rollouts if not r.is_infra_failure]
    lengths = [len(r.completion.token_ids) for r in rollouts]
    metrics = {
        "rollout/reward_mean": sum(rewards) / max(len(rewards), 1),
        "rollout/solved_frac": sum(r.status == "ok" for r in rollouts) / len(rollouts),
        "rollout/completion_len_mean": sum(lengths) / len(lengths),
        "rollout/prompt_len_mean": sum(len(r.completion.prompt_ids) for r in rollouts) / len(rollouts),
        "rollout/truncated_frac": sum(r.completion.finish_reason == "length" for r in rollouts) / len(rollouts),
        "rollout/zero_variance_frac": zero_variance_groups / num_groups,
        # distinct (task, text) pairs per group: a code environment runs each once, so this is
        # also the sandbox programs a group costs (all G when every completion differs)
        "rollout/distinct_per_group": len({(r.prompt_uid, r.completion.text) for r in rollouts}) / num_groups,
        "sandbox/infra_errors": float(sum(r.is_infra_failure for r in rollouts)),
    }
    run_s = [r.info["wall_s"] for r in rollouts if "wall_s" in r.info]
    if run_s:  # wall time of each rollout's sandbox run, as the environment recorded it
        metrics["sandbox/run_s_mean"] = sum(run_s) / len(run_s)
        metrics["sandbox/run_s_max"] = max(run_s)
    if any("turns" in r.info for r in rollouts):  # multi-turn episodes
        metrics["rollout/turns_mean"] = sum(r.info.get("turns", 0) for r in rollouts) / len(rollouts)
        metrics["rollout/tool_calls_mean"] = sum(r.info.get("tool_calls", 0) for r in rollouts) / len(rollouts)
    resumed = [r.info for r in rollouts if "resumes" in r.info]
    if resumed:  # environment-state staleness of suspended episodes (pipeline.suspend_between_turns)
        metrics["env_state/resumes_mean"] = sum(i["resumes"] for i in resumed) / len(rollouts)
        metrics["env_state/gap_max"] = float(max(i["env_state_gap_max"] for i in resumed))
        metrics["env_state/gap_mean"] = sum(i["env_state_gap_max"] for i in resumed) / len(resumed)
    restarts = sum(r.info.get("env_state_restarts", 0) for r in rollouts)
    if restarts:
        metrics["env_state/restarts"] = float(restarts)
    for status in sorted({r.status for r in rollouts}):
        metrics[f"rollout/status_{status}"] = float(sum(r.status == status for r in rollouts))
    return metrics


def staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """`staleness/mean`, `staleness/max` and `staleness/count_<k>` (rollouts consumed at staleness k)."""
    metrics = {"staleness/mean": sum(staleness) / len(staleness), "staleness/max": float(max(staleness))}
    for k in sorted(set(staleness)):
        metrics[f"staleness/count_{k}"] = float(staleness.count(k))
    return metrics


def train_metrics(stats) -> dict[str, float]:
    """A trainer.StepStats as `train/*` metrics."""
    return {
        "train/loss": stats.loss,
        "train/grad_norm": stats.grad_norm,
        "train/clip_frac": stats.clip_frac,
        "train/ratio_mean": stats.ratio_mean,
        "train/kl_ref": stats.kl_mean,
        "train/entropy": stats.entropy_mean,
        **stats.offpolicy,
        "train/tokens": float(stats.num_tokens),
    }
