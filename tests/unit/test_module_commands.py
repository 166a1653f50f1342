"""Every ``python -m <our module>`` that the package, the benchmarks and the scripts start names a
module that exists (a module moved by a refactor left benchmarks/bench_tracesets.py starting
``mars_openhands.cli``, gone since the string-import cleanup)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_M_FLAG = re.compile(r'"-m",\s*"((?:mars_openhands|eval)(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"')


def _module_commands() -> list[tuple[str, str]]:
    found = []
    for folder in ("mars_openhands", "eval", "benchmarks", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in _M_FLAG.findall(path.read_text(encoding="utf-8")):
                found.append((str(path.relative_to(ROOT)), name))
    return found


def test_every_python_dash_m_of_ours_names_a_runnable_module() -> None:
    commands = _module_commands()
    assert len(commands) >= 10, commands  # the scan sees the launches it guards
    missing = [(where, name) for where, name in commands if importlib.util.find_spec(name) is None]
    assert not missing, f"python -m of a module that does not exist: {missing}"
