"""Where a result came from: the source commit and the date of a run, for results directories and
the README's result blocks (:mod:`eval.result_blocks`).

A figure in the docs is only as good as the code that made it: each ``compare`` run records the
commit it ran (``+dirty`` when the checkout had uncommitted changes to tracked files) and the UTC
date it started, so a block rendered from it can name both.
"""

from __future__ import annotations

import datetime as dt
import subprocess
from pathlib import Path

__all__ = ["REPO_ROOT", "source_commit", "utc_date"]

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout this package runs from (``eval/`` is at its top level)."""


def source_commit(repo_dir: Path = REPO_ROOT) -> str:
    """The short commit of ``repo_dir``'s checkout, with ``+dirty`` when tracked files changed.

    Returns:
        e.g. ``"7c80c00"`` or ``"7c80c00+dirty"``; ``"unknown (not a git checkout)"`` when git or
        the repository is missing (an installed wheel).
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return sha + ("+dirty" if dirty else "")


def utc_date(now: dt.datetime | None = None) -> str:
    """``YYYY-MM-DD`` of ``now`` (default: the current time) in UTC. Pure given ``now``."""
    return (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).strftime("%Y-%m-%d")
