"""Sandboxed execution of untrusted Python programs for reward environments.

`BwrapSandbox` runs a program in a fresh bubblewrap sandbox under `SandboxLimits` and returns a
`SandboxResult` whose `Status` says whether the program or the infrastructure failed. What is
and is not guaranteed is listed in `gapless.sandbox.bwrap`.
"""

from gapless.sandbox.bwrap import BwrapSandbox
from gapless.sandbox.limits import SandboxLimits
from gapless.sandbox.result import SandboxError, SandboxResult, Status

__all__ = ["BwrapSandbox", "SandboxError", "SandboxLimits", "SandboxResult", "Status"]
