"""Sandboxed execution of untrusted Python programs for reward environments.

`open_sandbox` returns a checked `BwrapSandbox` (a pool of bubblewrap slots; warm by default:
each job forked from a pre-started server) or, where bubblewrap cannot work and only with a loud
warning, a `ReducedSandbox`. `run_python` returns a `SandboxResult` whose `Status` says whether
the program or the infrastructure failed; `open_session` gives a stateful sandbox for multi-turn
tool use. What is and is not guaranteed is listed in `gapless.sandbox.bwrap`.
"""

from gapless.sandbox.bwrap import BwrapSandbox
from gapless.sandbox.cow import SessionBase, prepare_tree
from gapless.sandbox.job import Judged
from gapless.sandbox.limits import SandboxLimits
from gapless.sandbox.reduced import ReducedSandbox, open_sandbox
from gapless.sandbox.result import SandboxError, SandboxResult, Status
from gapless.sandbox.session import SandboxSession, SessionResult, SnapshotFailed

__all__ = [
    "BwrapSandbox",
    "Judged",
    "ReducedSandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSession",
    "SessionBase",
    "SessionResult",
    "SnapshotFailed",
    "Status",
    "open_sandbox",
    "prepare_tree",
]
