"""The run-level failures the command line maps to exit codes (cli.py).

    exit 2   ConfigError (config/) and data-file errors: the user's input; one line says the fix
    exit 3   InfrastructureError: the host, the sandbox, a judge or an actor process failed; the
             message says what to do, and the last checkpoint is intact for `--resume`
    exit 130 / 143   RunStopped by SIGINT / SIGTERM after checkpointing the steps done

Model output never raises any of these: it is a reward and a status (envs/base.py).
"""

from __future__ import annotations


class InfrastructureError(RuntimeError):
    """Something outside the model's output failed; fix the host (the message says how), then --resume."""


class RunStopped(Exception):
    """SIGTERM or SIGINT asked the run to stop: it checkpointed the steps done and ended."""
