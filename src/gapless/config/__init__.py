"""Typed run configuration: defaults < TOML file < dotted command-line overrides.

Every field carries a docstring (what it is, its unit, when to change it); the defaults are the
embedded CPU job. `load_config` is the only entry point: it merges the three layers and
validates the result. Any bad input -- unknown key, wrong type, out-of-range value, malformed
TOML -- raises `ConfigError` with a one-line message naming the key and what is allowed; the CLI
turns it into exit code 2. The resolved config is plain JSON (`Config.model_dump(mode="json")`)
and is written into the run directory by the loop.
"""

from gapless.config.checks import MULTI_TURN_TASKS
from gapless.config.errors import ConfigError
from gapless.config.host import usable_cores
from gapless.config.loader import load_config
from gapless.config.sections import (
    AgentConfig,
    ClusterConfig,
    Config,
    EvalConfig,
    GeneratorConfig,
    JudgeConfig,
    LoopConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    PipelineConfig,
    RepoConfig,
    SandboxConfig,
    ServiceConfig,
    SimulateConfig,
    SweConfig,
    TaskConfig,
    ToolsConfig,
    TrainerConfig,
    WarmStartConfig,
)

__all__ = [
    "AgentConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "GeneratorConfig",
    "JudgeConfig",
    "LoopConfig",
    "LoraConfig",
    "MULTI_TURN_TASKS",
    "MetricsConfig",
    "ModelConfig",
    "PipelineConfig",
    "RepoConfig",
    "SweConfig",
    "SandboxConfig",
    "ServiceConfig",
    "SimulateConfig",
    "TaskConfig",
    "ToolsConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "load_config",
    "usable_cores",
]
