"""Loads a script of benchmarks/ (not a package) as a module, for the tests of its pure parts."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """The module of ``benchmarks/<name>.py``, executed (its ``if __name__ == "__main__"`` part not)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
