"""Finer tool names from shell commands."""

from __future__ import annotations

import pytest

from eval.workloads.tool_names import FALLBACK_TOOL_NAME, tool_name_from_command


@pytest.mark.parametrize(("command", "expected"), [
    ("cd /testbed && python -m pytest tests/ -x", "pytest"),
    ("python3 -m pip install -e .", "pip"),
    ("pip3 install numpy", "pip"),
    ("timeout 60 python3.9 reproduce.py", "python"),
    ("/usr/bin/python reproduce.py", "python"),
    ("cat setup.py | head -50", "cat"),
    ("FOO=1 BAR=2 pytest -q", "pytest"),
    ("export PYTHONPATH=. ; sudo -E make test", "make"),
    ("# look around\nls -la", "ls"),
    ("cat <<'EOF' > fix.py\nimport os\nEOF", "cat"),
    ("(cd src && grep -rn foo .)", "grep"),
    ("cd /testbed", FALLBACK_TOOL_NAME),
    ("", FALLBACK_TOOL_NAME),
])
def test_tool_name_from_command(command: str, expected: str) -> None:
    assert tool_name_from_command(command) == expected


def test_docstring_examples() -> None:
    import doctest

    from eval.workloads import tool_names

    assert doctest.testmod(tool_names).failed == 0
