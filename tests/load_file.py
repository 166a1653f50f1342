"""Load a script or benchmark that is not a package module (``benchmarks/*.py``, ``scripts/*.py``)
by its path, for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""


def load_file(path: Path, name: str | None = None, register: bool = True) -> ModuleType:
    """Execute the file at ``path`` as a module named ``name`` (default: the file's stem).

    ``register`` puts it in ``sys.modules`` first: a module whose dataclasses resolve their
    annotations, or whose pickles name it, must be found there. Raises ``FileNotFoundError`` if
    the file is missing, and whatever executing it raises.
    """
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"no module file at {path}")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
