"""Reduced mode, for hosts where bubblewrap or user namespaces are unavailable; and the factory
that picks a mode.

`ReducedSandbox` runs the same boot.py without any namespace: rlimits (CPU, AS, FSIZE, NOFILE,
NPROC, CORE), its own session and process group, a child subreaper that kills the program's
leftover descendants, the slot uid and cgroup when root. It is a safety net against accidents,
not a sandbox against hostile code, and says so loudly (a WARNING log and a line on stderr) when
it is created: `open_sandbox(mode="auto")` falls back to it only with that warning, never
silently.

NOT guaranteed in reduced mode (all of these hold in bwrap mode): the program sees the whole host
filesystem with the rights of its uid (root's, if the service runs as root without slot uids:
never the case here, each slot has its own uid when root); it has the host's network; its files
are host directories, capped by RLIMIT_FSIZE per file but neither in total nor in count; job
files are not read-only to it; without root, a daemon that leaves the session and re-parents
outside the subreaper (impossible on Linux, where orphans go to the nearest subreaper) is not
killed; there are no warm servers (a job forked from a shared server could tamper with it).
"""

from __future__ import annotations

import logging
import sys

from gapless.sandbox.bwrap import BwrapSandbox
from gapless.sandbox.limits import SandboxLimits
from gapless.sandbox.result import SandboxError

logger = logging.getLogger(__name__)

REDUCED_WARNING = (
    "SANDBOX IN REDUCED MODE: bubblewrap or user namespaces are unavailable ({reason}). Programs "
    "run with rlimits and process-group isolation only: they can read the host's files and use "
    "its network. Do not run untrusted code like this; install bubblewrap and enable user "
    "namespaces (see `gapless sandbox check`)."
)


class ReducedSandbox(BwrapSandbox):
    """rlimits + process-group isolation, always cold (see module docstring)."""

    mode = "reduced"

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = "/usr/bin/python3",
                 slot_uid_base: int = 200000, *, max_concurrency: int | None = None,
                 reason: str = "reduced mode requested") -> None:  # fmt: skip
        self.reason = reason
        message = REDUCED_WARNING.format(reason=reason)
        logger.warning(message)
        print(f"gapless: WARNING: {message}", file=sys.stderr)
        super().__init__(limits, python, slot_uid_base, warm=False, max_concurrency=max_concurrency)


def open_sandbox(limits: SandboxLimits = SandboxLimits(), python: str = "/usr/bin/python3", *,
                 mode: str = "auto", warm: bool = True, max_concurrency: int | None = None,
                 slot_uid_base: int = 200000) -> BwrapSandbox:  # fmt: skip
    """A checked sandbox. mode: "bwrap" (fail with SandboxError if it does not work here),
    "reduced" (always, with the warning) or "auto" (bwrap, else reduced with the warning)."""
    if mode not in ("auto", "bwrap", "reduced"):
        raise ValueError(f"sandbox mode must be auto, bwrap or reduced, got {mode!r}")
    if mode != "reduced":
        sandbox = BwrapSandbox(limits, python, slot_uid_base, warm=warm,
                               max_concurrency=max_concurrency)  # fmt: skip
        try:
            sandbox.check()
            return sandbox
        except SandboxError as error:
            sandbox.close()
            if mode == "bwrap":
                raise
            reason = str(error)
    else:
        reason = "reduced mode requested"
    sandbox = ReducedSandbox(limits, python, slot_uid_base, max_concurrency=max_concurrency,
                             reason=reason)  # fmt: skip
    sandbox.check()
    return sandbox
