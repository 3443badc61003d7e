"""The default SWE task set: which packages, which seed, and where it lives.

`scripts/setup.sh` builds it (`gapless swe build --default`, network needed once) into
`default_set_dir()`, so that `task.name = "swe"` without a `task.path` works offline afterwards:
the environment loads `default_instances_path()`. The folder is the repository's `.cache/swe-default`
(ignored by git) for a source checkout, or `$GAPLESS_SWE_SET` (a folder) where that is set.

Guaranteed: the packages are pinned releases and the seed is fixed, so every build of this set
holds the same instances (build.py). NOT guaranteed: that the folder exists (a machine that never
ran setup.sh, or ran it offline, has none); the loader's error names the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PACKAGES = ("inflection==0.5.1", "parse==1.22.4", "toolz==1.2.0")
DEFAULT_SEED = 0
DEFAULT_MAX_PER_PACKAGE = 10
DEFAULT_MAX_TRIES = 40
ENV_VARIABLE = "GAPLESS_SWE_SET"


def default_set_dir() -> Path:
    """Where the default set is built and looked for (module docstring)."""
    if os.environ.get(ENV_VARIABLE):
        return Path(os.environ[ENV_VARIABLE])
    return Path(__file__).resolve().parents[4] / ".cache" / "swe-default"  # src/gapless/envs/swe -> checkout


def default_instances_path() -> Path:
    return default_set_dir() / "instances.jsonl"
