"""A finer tool name from a shell command: ``"cd /testbed && python -m pytest -x"`` → ``"pytest"``.

Coding agents call one ``bash`` tool, but its duration depends on the program run (design.md §8: a
pip/pytest-like heavy tail over a fast cat/grep/sed body), and the retention policies keep duration
statistics per tool name (design.md §4–5). So the workload names a tool by the first *informative*
program of its command: shell separators (``&&``, ``||``, ``;``, ``|``, newlines) split the command,
and a segment is skipped while it only changes directory or environment (``cd``, ``export``,
``source``, comments, ``VAR=value`` prefixes) or is a wrapper (``timeout 60``, ``sudo``, ``env``,
``time``, ``nohup``). ``python3.11``/``python3`` become ``python``, ``python -m X`` becomes ``X``
and ``pip3`` becomes ``pip``.
"""

from __future__ import annotations

import re

__all__ = ["FALLBACK_TOOL_NAME", "tool_name_from_command"]

FALLBACK_TOOL_NAME = "bash"
"""Name used when a command has no informative program (empty, or only ``cd``/``export``)."""

_SEPARATORS = re.compile(r"&&|\|\||;|\n|\|")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_NO_OP_PROGRAMS = frozenset({"cd", "export", "source", ".", "set", "pushd", "popd", "true", ":",
                             "unset", "ulimit"})
_WRAPPERS = frozenset({"timeout", "sudo", "env", "time", "nohup", "nice", "stdbuf"})
_PYTHON = re.compile(r"^python[0-9.]*$")


def _program(words: list[str]) -> str | None:
    """First informative program of one segment's words, or ``None``. Pure."""
    i = 0
    while i < len(words):
        word = words[i]
        if _ASSIGNMENT.match(word) or word.startswith("-") or word.replace(".", "").isdigit():
            i += 1  # env prefix, or an option/duration argument of a wrapper
            continue
        name = word.rsplit("/", 1)[-1].strip("\"'()")
        if name in _WRAPPERS:
            i += 1
            continue
        if not name or name.startswith("#") or name in _NO_OP_PROGRAMS:
            return None
        if _PYTHON.match(name):
            rest = words[i + 1 : i + 3]
            if len(rest) == 2 and rest[0] == "-m":
                return _normalize(rest[1])
            return "python"
        return _normalize(name)
    return None


def _normalize(name: str) -> str:
    if name in ("pip3", "pip2") or re.match(r"^pip[0-9.]+$", name):
        return "pip"
    return name


def tool_name_from_command(command: str) -> str:
    """Return the first informative program of a shell ``command`` (see the module docstring). Pure.

    Examples:
        >>> tool_name_from_command("cd /testbed && python -m pytest tests/ -x")
        'pytest'
        >>> tool_name_from_command("cat setup.py | head -50")
        'cat'
        >>> tool_name_from_command("timeout 60 python3.9 reproduce.py")
        'python'
        >>> tool_name_from_command("cd /testbed")
        'bash'
    """
    for segment in _SEPARATORS.split(command):
        name = _program(segment.split())
        if name is not None:
            return name
    return FALLBACK_TOOL_NAME
