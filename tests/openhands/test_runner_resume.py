"""Issue 33 item 5: running a task again into its own output resumes its persisted conversation.

Before: the task's process loaded the persisted conversation before the stock tool modules were
imported and failed (``ValidationError ... Unexpected kind 'TerminalTool'``); ``openhands run``
into the same ``--out`` could only refuse or ``--overwrite`` (start over).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.openhands.cli import add_openhands_subcommand, run_from_args  # noqa: E402
from mars_openhands.openhands.playback import (  # noqa: E402
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from tests.openhands._helpers import serve_app  # noqa: E402

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(600)]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_openhands_subcommand(parser.add_subparsers(dest="command"))
    return run_from_args(parser.parse_args(["openhands", "run", *argv]))


def _turn(command: str) -> RecordedTurn:
    return RecordedTurn(content=command, tool_calls=(RecordedToolCall(
        name="terminal", arguments={"command": command}),))


def test_a_stopped_task_resumes_its_conversation_in_a_new_process(tmp_path: Path, capsys) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    out = tmp_path / "out"
    script = Script(name="two", turns=(_turn("echo one >> log.txt"), _turn("echo two >> log.txt")))
    with serve_app(build_playback_app([script])) as url:
        argv = ["--backend", "url", "--url", url, "--model", "playback", "--problem", "log twice",
                "--workspace", str(workspace), "--out", str(out)]
        assert _run([*argv, "--max-iterations", "1"]) in (0, 1)  # stopped after one step
        first = json.loads((out / "task-0" / "result.json").read_text())
        assert first["status"] in ("max_iterations", "error") and first["num_tool_calls"] == 1
        capsys.readouterr()

        assert _run(argv) == 2  # the same --out without a flag: one line saying how
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--resume" in err and "--overwrite" in err, err

        assert _run([*argv, "--resume"]) == 0, capsys.readouterr()
        requests = httpx.get(f"{url}/playback/requests").json()["requests"]
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    result = json.loads((out / "task-0" / "result.json").read_text())
    assert summary["status"] == result["status"] == "finished", (summary, result)
    assert result["session_id"] == first["session_id"] and result["resumed"] is True
    # The first step is not run again; the conversation went on from where it stopped.
    assert (workspace / "log.txt").read_text() == "one\ntwo\n"
    assert [r["turn"] for r in requests] == [0, 1, 2]  # one request per step, none repeated
    assert {r["num_user_messages"] for r in requests} == {1}  # the problem was sent once
    kinds = [e["kind"] for e in result["events"]]  # both runs' events, each run a session
    assert kinds.count("session_start") == 2 and kinds.count("tool_end") == 2
