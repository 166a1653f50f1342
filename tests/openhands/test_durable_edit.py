"""A durable file edit retried after a restart is not applied twice (openhands/durable.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.openhands.durable import DurableExecutor  # noqa: E402

pytestmark = pytest.mark.openhands


def _applied(tmp_path: Path, text: str, old: str, new: str) -> bool:
    (tmp_path / "f.md").write_text(text)
    executor = DurableExecutor.__new__(DurableExecutor)
    executor.tool_name = "file_editor"
    return executor._edit_already_applied(
        {"command": "str_replace", "path": "f.md", "old_str": old, "new_str": new}, tmp_path)


def test_an_edit_whose_new_text_contains_the_old_is_seen_as_applied(tmp_path: Path) -> None:
    # An appended line keeps old_str inside new_str: once applied, old_str is still in the file.
    assert _applied(tmp_path, "# notes\nresumed\n", "# notes", "# notes\nresumed")
    assert not _applied(tmp_path, "# notes\n", "# notes", "# notes\nresumed")


def test_a_plain_replacement_is_applied_only_once_its_old_text_is_gone(tmp_path: Path) -> None:
    assert _applied(tmp_path, "a = 2\n", "a = 1", "a = 2")
    assert not _applied(tmp_path, "a = 1\n", "a = 1", "a = 2")
    assert not _applied(tmp_path, "a = 2\na = 1\n", "a = 1", "a = 2")  # old text still elsewhere
