"""A durable file edit retried after a restart is not applied twice, and its attempt is reported
(openhands/durable.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")
pytest.importorskip("dbos", reason="needs DBOS Transact (the 'runtime' extra)")

from mars_openhands.openhands.durable import _RUNS, DurableExecutor  # noqa: E402
from mars_openhands.openhands.executor import EventedExecutor, EventSender  # noqa: E402
from mars_openhands.runtime.run import ExecContext  # noqa: E402

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


class _RetryRun:
    """A ``TaskRun`` stand-in whose every tool call is the retry of a call in doubt."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace

    def tool(self, tool: str, arguments: dict[str, Any], execute: Any) -> dict[str, Any]:
        return execute(ExecContext(key="k", timeout_s=10.0, attempt=2, is_retry=True))


def test_a_retried_edit_found_applied_is_answered_and_reported_without_running(tmp_path: Path) -> None:
    """The first attempt's edit landed, then the runner was killed before its tool_end was posted
    (and before its outcome was recorded): the retry runs nothing, answers ok with the file
    editor's own observation, and posts the call's tool_enqueued / tool_start / tool_end (the
    gateway saw the first attempt start; this closes it)."""
    from openhands.tools.file_editor import FileEditorAction, FileEditorObservation

    (tmp_path / "notes.md").write_text("# notes\nresumed\n")
    action = FileEditorAction(command="str_replace", path=str(tmp_path / "notes.md"),
                              old_str="# notes", new_str="# notes\nresumed")
    conversation = SimpleNamespace(state=SimpleNamespace(events=[
        SimpleNamespace(action=action, tool_call_id="call_2_0", llm_response_id="r2")]))

    def not_run(*args: object) -> None:
        raise AssertionError("an edit found applied must not run again")

    sender = EventSender(None, tmp_path / "events.jsonl")
    evented = EventedExecutor(not_run, "file_editor", FileEditorObservation, "s", sender, tmp_path,
                              None)
    executor = DurableExecutor(evented, "file_editor", FileEditorObservation, "t-applied")
    _RUNS["t-applied"] = _RetryRun(tmp_path)
    try:
        observation = executor(action, conversation)
    finally:
        _RUNS.pop("t-applied")
    assert isinstance(observation, FileEditorObservation) and not observation.is_error
    assert "already applied" in observation.text
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["tool_call_id"], e.get("status")) for e in events] == [
        ("tool_enqueued", "call_2_0", None), ("tool_start", "call_2_0", None),
        ("tool_end", "call_2_0", "ok")]
