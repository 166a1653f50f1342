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


def _not_run(*args: object) -> None:
    raise AssertionError("an edit found applied must not run again")


def _retried(tmp_path: Path, action: Any, inner: Any = _not_run) -> tuple[Any, list[tuple[str, str, str | None]]]:
    """Call ``action`` (id ``call_2_0``) through a durable, evented file editor whose every call is
    a retry after a restart; its observation and the (kind, tool_call_id, status) of the tool
    events it posted."""
    from openhands.tools.file_editor import FileEditorObservation

    conversation = SimpleNamespace(state=SimpleNamespace(events=[
        SimpleNamespace(action=action, tool_call_id="call_2_0", llm_response_id="r2")]))
    sender = EventSender(None, tmp_path / "events.jsonl")
    evented = EventedExecutor(inner, "file_editor", FileEditorObservation, "s", sender, tmp_path, None)
    executor = DurableExecutor(evented, "file_editor", FileEditorObservation, "t-applied")
    _RUNS["t-applied"] = _RetryRun(tmp_path)
    try:
        observation = executor(action, conversation)
    finally:
        _RUNS.pop("t-applied")
    assert isinstance(observation, FileEditorObservation)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return observation, [(e["kind"], e["tool_call_id"], e.get("status")) for e in events]


def _reported(status: str) -> list[tuple[str, str, str | None]]:
    return [("tool_enqueued", "call_2_0", None), ("tool_start", "call_2_0", None),
            ("tool_end", "call_2_0", status)]


def _editor(tmp_path: Path) -> Any:
    """The SDK's file editor, fresh (empty undo history), as a resumed run has it."""
    from openhands.tools.file_editor.impl import FileEditorExecutor

    return FileEditorExecutor(workspace_root=str(tmp_path))


def test_a_retried_edit_found_applied_is_answered_and_reported_without_running(tmp_path: Path) -> None:
    """The first attempt's edit landed, then the runner was killed before its tool_end was posted
    (and before its outcome was recorded): the retry runs nothing, answers ok with the file
    editor's own observation, and posts the call's tool_enqueued / tool_start / tool_end (the
    gateway saw the first attempt start; this closes it)."""
    from openhands.tools.file_editor import FileEditorAction

    (tmp_path / "notes.md").write_text("# notes\nresumed\n")
    action = FileEditorAction(command="str_replace", path=str(tmp_path / "notes.md"),
                              old_str="# notes", new_str="# notes\nresumed")
    observation, events = _retried(tmp_path, action)
    assert not observation.is_error and "already applied" in observation.text
    assert events == _reported("ok")


def test_a_retried_create_whose_file_was_written_is_answered_as_applied(tmp_path: Path) -> None:
    """Killed after its file was written and before its outcome was recorded: the editor refuses
    to create an existing file (it was an error, 'File already exists'); the retry finds the
    file with exactly its file_text (a CRLF and no final newline kept as is), runs nothing, and
    answers ok, reported like any attempt."""
    from openhands.tools.file_editor import FileEditorAction

    file_text = "# notes\r\nline 2 é"
    (tmp_path / "notes.md").write_bytes(file_text.encode())
    action = FileEditorAction(command="create", path=str(tmp_path / "notes.md"), file_text=file_text)
    observation, events = _retried(tmp_path, action, inner=_editor(tmp_path))
    assert not observation.is_error and "already applied" in observation.text, observation.text
    assert observation.command == "create"
    assert events == _reported("ok")
    assert (tmp_path / "notes.md").read_bytes() == file_text.encode()


@pytest.mark.parametrize("found", [b"# other notes\n", b"# notes\n\n", b"# notes\r\n", b"\xff# notes\n"])
def test_a_retried_create_over_a_different_file_is_the_conflict(tmp_path: Path, found: bytes) -> None:
    """The file is there and is not what the create writes (one byte apart, or not UTF-8): the
    agent is told it exists and differs, an error, and the file is left alone."""
    from openhands.tools.file_editor import FileEditorAction

    (tmp_path / "notes.md").write_bytes(found)
    action = FileEditorAction(command="create", path=str(tmp_path / "notes.md"), file_text="# notes\n")
    observation, events = _retried(tmp_path, action, inner=_editor(tmp_path))
    assert observation.is_error
    assert "already exists" in observation.text and "differs" in observation.text, observation.text
    assert events == _reported("error")
    assert (tmp_path / "notes.md").read_bytes() == found


def test_a_retried_create_whose_file_is_missing_creates_it(tmp_path: Path) -> None:
    """Killed before the write: the retry runs the editor, which creates the file."""
    from openhands.tools.file_editor import FileEditorAction

    action = FileEditorAction(command="create", path=str(tmp_path / "notes.md"), file_text="# notes\n")
    observation, events = _retried(tmp_path, action, inner=_editor(tmp_path))
    assert not observation.is_error and "created successfully" in observation.text, observation.text
    assert events == _reported("ok")
    assert (tmp_path / "notes.md").read_text() == "# notes\n"


def test_an_insert_is_applied_only_once_its_lines_are_at_its_line() -> None:
    """The lines the SDK editor's insert writes: each line of new_str ended by a newline, after
    the first insert_line lines."""
    from mars_openhands.openhands.durable import _insert_applied

    assert _insert_applied("a\nx\ny\nb\n", 1, "x\ny")
    assert _insert_applied("a\nb\nx\n", 2, "x")  # at the end
    assert _insert_applied("x\na\n", 0, "x")
    assert not _insert_applied("a\nb\n", 1, "x")
    assert not _insert_applied("a\nb\nx\n", 1, "x")  # elsewhere in the file
    assert not _insert_applied("a\nxy\nb\n", 1, "x")  # a line that only starts with it
    assert not _insert_applied("a\nb\n", 3, "x")  # past the end: the editor answers the error


def test_a_retried_insert_found_applied_is_not_inserted_twice(tmp_path: Path) -> None:
    """Run again, the SDK editor's insert inserts its lines again (they were in the file twice,
    and the retry answered ok). Found at its line, the retry runs nothing and answers ok."""
    from openhands.tools.file_editor import FileEditorAction

    (tmp_path / "notes.md").write_text("# notes\nresumed\nend\n")
    action = FileEditorAction(command="insert", path=str(tmp_path / "notes.md"), insert_line=1,
                              new_str="resumed")
    observation, events = _retried(tmp_path, action, inner=_editor(tmp_path))
    assert not observation.is_error and "already applied" in observation.text, observation.text
    assert events == _reported("ok")
    assert (tmp_path / "notes.md").read_text() == "# notes\nresumed\nend\n"


def test_a_retried_insert_not_yet_applied_is_run(tmp_path: Path) -> None:
    from openhands.tools.file_editor import FileEditorAction

    (tmp_path / "notes.md").write_text("# notes\nend\n")
    action = FileEditorAction(command="insert", path=str(tmp_path / "notes.md"), insert_line=1,
                              new_str="resumed")
    observation, events = _retried(tmp_path, action, inner=_editor(tmp_path))
    assert not observation.is_error and "has been edited" in observation.text, observation.text
    assert events == _reported("ok")
    assert (tmp_path / "notes.md").read_text() == "# notes\nresumed\nend\n"


def test_a_retried_undo_edit_says_its_first_attempt_may_have_undone(tmp_path: Path) -> None:
    """Undo history does not survive a restart, so a retried undo_edit fails whether its first
    attempt undid or not (what it restored is unknown here): the error keeps the editor's
    'No edit history' and says the undo may have been done, and where to look."""
    from openhands.tools.file_editor import FileEditorAction

    (tmp_path / "notes.md").write_text("# notes\n")
    action = FileEditorAction(command="undo_edit", path=str(tmp_path / "notes.md"))
    observation, events = _retried(tmp_path, action, inner=_editor(tmp_path))
    assert observation.is_error and observation.command == "undo_edit"
    assert "No edit history" in observation.text, observation.text
    assert "may have undone" in observation.text and "View the file" in observation.text
    assert events == _reported("error")
    assert (tmp_path / "notes.md").read_text() == "# notes\n"


def test_a_retried_view_is_run_again(tmp_path: Path) -> None:
    """A view changes nothing: its retry reads the file as it is now, the true answer."""
    from openhands.tools.file_editor import FileEditorAction

    (tmp_path / "notes.md").write_text("# notes\nresumed\n")
    action = FileEditorAction(command="view", path=str(tmp_path / "notes.md"))
    observation, events = _retried(tmp_path, action, inner=_editor(tmp_path))
    assert not observation.is_error and "resumed" in observation.text, observation.text
    assert events == _reported("ok")
