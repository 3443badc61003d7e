"""Load a script of bench/ as a module, so that a test and its benchmark share one protocol or
workload definition (bench/ is not a package)."""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
