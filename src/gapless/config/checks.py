"""Cross-field checks: values that are valid alone but not together (or not on this machine).

Each raises `ConfigError` naming the fields and the fix; a combination that works but runs badly
(more ranks than cores) is a warning, not an error.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from gapless.config.errors import ConfigError
from gapless.config.host import usable_cores
from gapless.config.sections import Config

MULTI_TURN_TASKS = ("tool_use", "repo", "agent", "swe")  # tasks whose episodes the pipeline runs turn by turn


def check_cross_field(cfg: Config) -> None:
    m = cfg.model
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads})")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads ({m.num_heads}) must be divisible by model.num_kv_heads ({m.num_kv_heads})")
    if m.path is not None and not Path(m.path).is_dir():
        raise ConfigError(
            f"model.path: directory {m.path!r} does not exist; give a local Hugging Face checkpoint directory or leave it unset for the embedded tiny model"
        )
    _check_trainer(cfg)
    _check_lora(cfg)
    _check_cluster(cfg)
    _check_vllm_server(cfg)
    bad_levels = [lv for lv in cfg.task.levels if lv not in (1, 2, 3)]
    if bad_levels or not cfg.task.levels:
        raise ConfigError(f"task.levels: {cfg.task.levels} must be a non-empty list drawn from 1, 2, 3")
    _check_task(cfg)
    pl = cfg.pipeline
    if cfg.generator.kernels != "auto" and cfg.generator.engine != "torch":
        raise ConfigError(
            f"generator.kernels = {cfg.generator.kernels!r} applies to generator.engine = 'torch' only "
            f"(not {cfg.generator.engine!r}); leave it at 'auto'"
        )
    if (pl.partial_rollout_tokens or pl.partial_rollout_s) and cfg.generator.engine == "reference":
        field = "partial_rollout_tokens" if pl.partial_rollout_tokens else "partial_rollout_s"
        raise ConfigError(
            f"pipeline.{field} cuts running sequences, which only the stepped engines ('torch', 'vllm', "
            "'vllm-server') expose "
            f"(not {cfg.generator.engine!r}); set it to 0 or use the torch engine"
        )
    if pl.suspend_between_turns and cfg.task.name != "tool_use":
        raise ConfigError(
            f"pipeline.suspend_between_turns snapshots tool sessions, which only task.name = 'tool_use' "
            f"supports (not {cfg.task.name!r}); set it to false"
        )
    if pl.resume_after_s > 0 and not pl.suspend_between_turns:
        raise ConfigError(
            "pipeline.resume_after_s delays suspended episodes, and none is suspended: "
            "set pipeline.suspend_between_turns = true or resume_after_s = 0"
        )
    if pl.max_env_state_staleness >= 0 and not pl.suspend_between_turns:
        raise ConfigError(
            "pipeline.max_env_state_staleness bounds resumed episodes, and none is suspended: "
            "set pipeline.suspend_between_turns = true or max_env_state_staleness = -1"
        )
    if (pl.partial_rollout_tokens or pl.partial_rollout_s) and cfg.task.name in MULTI_TURN_TASKS:
        field = "partial_rollout_tokens" if pl.partial_rollout_tokens else "partial_rollout_s"
        raise ConfigError(
            f"pipeline.{field} cuts single-turn sequences; the multi-turn task {cfg.task.name!r} "
            "schedules whole turns instead (each ends at its tool call): set it to 0"
        )


def _check_task(cfg: Config) -> None:
    t = cfg.task
    if t.name == "agent" and not (cfg.agent.command or "").strip():
        raise ConfigError(
            "agent.command: task.name = 'agent' needs the agent program to run per episode, "
            'e.g. --agent.command "python examples/openai_agent.py" (docs/agentic.md)'
        )
    if t.name == "agent" and cfg.pipeline.turn_schedule == "waves":
        raise ConfigError(
            "pipeline.turn_schedule = 'waves' replays the reference loop's batches, which an agent "
            "program's own timing cannot follow: use 'turns' with task.name = 'agent'"
        )
    if t.name == "code_dataset" and t.path is None:
        raise ConfigError(
            "task.path: task.name = 'code_dataset' needs a .jsonl or .parquet file of problems (docs/environments.md)"
        )
    if t.path is not None:
        if t.name not in ("code_dataset", "math", "swe"):
            raise ConfigError(
                f"task.path is read only by task.name 'code_dataset', 'math' or 'swe', not {t.name!r}; remove it"
            )
        if not Path(t.path).is_file():
            raise ConfigError(f"task.path: file {t.path!r} does not exist")
        if not t.path.endswith((".jsonl", ".parquet")):
            raise ConfigError(f"task.path: {t.path!r} must end in .jsonl or .parquet")


def _check_trainer(cfg: Config) -> None:
    t = cfg.trainer
    if t.dual_clip_c is not None and t.loss not in ("dapo", "grpo", "drgrpo"):
        raise ConfigError(
            f"trainer.dual_clip_c bounds the token-level PPO-clip losses ('dapo', 'grpo', 'drgrpo'), "
            f"not trainer.loss = {t.loss!r}; unset it"
        )
    if t.correction != "none" and t.old_logprobs != "trainer":
        raise ConfigError(
            f"trainer.correction = '{t.correction}' reweights behaviour against trainer log-probs; "
            "it needs trainer.old_logprobs = 'trainer' (with 'behaviour' the PPO ratio already divides by them)"
        )
    if cfg.task.name in MULTI_TURN_TASKS and t.overlong == "penalty":
        raise ConfigError(
            "trainer.overlong = 'penalty' counts a completion's length against generator.max_new_tokens, "
            f"which bounds one turn of task {cfg.task.name!r}, not the episode; use 'keep' or 'mask'"
        )
    if t.overlong == "penalty" and t.overlong_buffer > cfg.generator.max_new_tokens:
        raise ConfigError(
            f"trainer.overlong_buffer ({t.overlong_buffer}) must not exceed generator.max_new_tokens "
            f"({cfg.generator.max_new_tokens})"
        )


def _check_lora(cfg: Config) -> None:
    lora = cfg.lora
    if lora.rank == 0:
        return
    if not lora.target_modules:
        raise ConfigError(
            "lora.target_modules is empty: name the linear layers to adapt (e.g. ['q_proj', 'v_proj']) "
            "or set lora.rank = 0 for full fine-tuning"
        )
    if cfg.cluster.trainer_world_size > 1:
        raise ConfigError(
            f"lora.rank = {lora.rank} trains in one process; set cluster.trainer_world_size = 1 "
            "(data-parallel LoRA is not built) or lora.rank = 0"
        )


def _check_vllm_server(cfg: Config) -> None:
    """A server at `generator.vllm_url` is shared by every engine of the run (the trainer's eval
    engine, each replica): their pushes must all carry the weights the generator samples with."""
    g = cfg.generator
    if g.vllm_url is not None and g.engine != "vllm-server":
        raise ConfigError(
            f"generator.vllm_url attaches to a vLLM server, which generator.engine = {g.engine!r} does not use: "
            "set generator.engine = 'vllm-server', or unset generator.vllm_url"
        )
    if g.engine == "vllm-server" and cfg.lora.rank:
        raise ConfigError(
            "generator.engine = 'vllm-server' pushes full weights only: set lora.rank = 0, or use "
            "generator.engine = 'vllm' (adapters as LoRA requests)"
        )
    if g.vllm_url is None:
        return
    if cfg.cluster.replicas > 1:
        raise ConfigError(
            f"cluster.replicas = {cfg.cluster.replicas} would attach every replica to the one server at "
            "generator.vllm_url, each pushing its own weights: set cluster.replicas = 1, or unset "
            "generator.vllm_url (each replica then starts its own server)"
        )
    if cfg.pipeline.max_staleness > 0:
        raise ConfigError(
            f"pipeline.max_staleness = {cfg.pipeline.max_staleness} with generator.vllm_url: the evaluation "
            "engine attaches to the same server and would push a newer version under the generator's "
            "requests; set pipeline.max_staleness = 0, or unset generator.vllm_url (one server per engine)"
        )


def _check_cluster(cfg: Config) -> None:
    c = cfg.cluster
    if c.placement == "local" and c.weight_transport in ("object_store", "broadcast"):
        raise ConfigError(
            f"cluster.weight_transport = '{c.weight_transport}' needs cluster.placement = 'ray'; "
            "local placement uses 'shm' (or 'auto')"
        )
    if c.placement == "ray" and c.weight_transport == "shm":
        raise ConfigError(
            "cluster.weight_transport = 'shm' cannot reach Ray actors on other nodes; "
            "use 'object_store', 'broadcast' (or 'auto') with cluster.placement = 'ray'"
        )
    if c.placement == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError(
                "cluster.placement = 'ray' needs Ray: pip install 'gapless[cluster]' (scripts/setup.sh installs it)"
            )
    if c.trainer_world_size == 1:
        return
    if c.data_parallel == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"cluster.data_parallel = 'fsdp2' needs torch's fully_shard (torch >= 2.6), which this torch "
                f"lacks ({exc}); use 'ddp' or upgrade torch"
            ) from None
    if c.op_timeout_s > c.rendezvous_timeout_s:
        raise ConfigError(
            f"cluster.op_timeout_s ({c.op_timeout_s}) must not exceed cluster.rendezvous_timeout_s "
            f"({c.rendezvous_timeout_s}): start-up is the longer wait; raise the latter"
        )
    cores = usable_cores()
    if c.trainer_world_size > cores:
        warnings.warn(
            f"cluster.trainer_world_size = {c.trainer_world_size} exceeds the {cores} cores of this machine: "
            "the ranks share cores, so a step is no faster than at world 1 (results are the same)",
            stacklevel=2,
        )
