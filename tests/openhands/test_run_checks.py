"""``mars-openhands openhands run`` as a newcomer meets it: checks before any task starts, the
task's own error in its summary line, a reused ``--out``, secrets, lost events, the kept trajectory.

Each test here failed on the code before the fix (see the docstrings).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.openhands.cli import add_openhands_subcommand, run_from_args  # noqa: E402
from mars_openhands.openhands.playback import (  # noqa: E402
    PlaybackConfig,
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from tests.openhands._helpers import EventCollector, free_port, serve_app  # noqa: E402

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(900)]

SECRET = "sk-mars-test-7f3a"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_openhands_subcommand(parser.add_subparsers(dest="command"))
    return run_from_args(parser.parse_args(["openhands", "run", *argv]))


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _repo(path: Path) -> Path:
    path.mkdir()
    (path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t",
                                                 "commit", "-qm", "init"]):
        subprocess.run(["git", *args], cwd=path, check=True)
    return path


def test_endpoint_problems_stop_the_run_before_any_task(tmp_path: Path, capsys) -> None:
    """Unreachable URL (was ~38 s of LLM retries, then exit 1 with wall_s 0), --backend mars at a
    server that is not a gateway (was "finished" while every event post got 404), a wrong key,
    and duplicate task ids (was a traceback): one line, exit 2, nothing started."""
    out = tmp_path / "out"
    task = ["--problem", "p", "--workspace", str(tmp_path), "--out", str(out), "--model", "m"]
    t0 = time.monotonic()
    assert _run(["--url", f"http://127.0.0.1:{free_port()}", *task]) == 2
    assert "cannot reach it" in _one_line_error(capsys) and time.monotonic() - t0 < 15
    with serve_app(build_playback_app([Script(name="s", turns=())],
                                      PlaybackConfig(api_key=SECRET))) as url:
        assert _run(["--url", url, "--api-key", SECRET, "--backend", "mars", *task]) == 2
        err = _one_line_error(capsys)
        assert "is not a MARS gateway" in err and "--backend vllm" in err
        assert _run(["--url", url, "--api-key", "wrong", "--backend", "url", *task]) == 2
        assert "check --api-key" in _one_line_error(capsys)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": "same", "problem_statement": "p",
                                         "workspace": str(tmp_path)}) + "\n" for _ in range(2)))
    assert _run(["--url", "http://x", "--tasks", str(tasks), "--out", str(out), "--model", "m"]) == 2
    assert "repeated: same" in _one_line_error(capsys)
    assert not out.exists()


def test_an_endpoint_urls_password_is_not_printed(tmp_path: Path, capsys) -> None:
    """--url http://user:pass@host (sent as basic auth) that nothing answers: the refusal names it
    with its password hidden; it printed it whole."""
    port = free_port()
    assert _run(["--url", f"http://me:hunter2@127.0.0.1:{port}", "--problem", "p", "--workspace",
                 str(tmp_path), "--out", str(tmp_path / "out"), "--model", "m"]) == 2
    err = _one_line_error(capsys)
    assert f"--url http://me:***@127.0.0.1:{port}: cannot reach it" in err and "hunter2" not in err, err


def test_task_errors_reuse_secrets_lost_events_and_the_kept_conversation(tmp_path: Path,
                                                                        capsys) -> None:
    """One run of three tasks, then the same --out again.

    Before: a bad repo or base_commit said only "task process exited 1; see process.log" (git's
    message dropped); --api-key was written to run_config.json; events the gateway refused were
    only logged; no trajectory was kept; a second run into the same --out failed on git clone and
    left the old result.json saying "finished".
    """
    repo = _repo(tmp_path / "repo")
    script = Script(name="fix", turns=(RecordedTurn(tool_calls=(RecordedToolCall(
        name="terminal", arguments={"command": "sed -i 's/a - b/a + b/' calc.py"}),)),))
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"task_id": "bad-repo", "problem_statement": "p", "repo": str(tmp_path / "nope")},
            {"task_id": "bad-commit", "problem_statement": "p", "repo": str(repo),
             "base_commit": "deadbeef"},
            {"task_id": "good", "problem_statement": "fix add", "repo": str(repo)}]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    with serve_app(build_playback_app([script], PlaybackConfig(api_key=SECRET))) as url, \
            EventCollector(status_code=400) as refusing:
        argv = ["--backend", "url", "--url", url, "--model", "playback", "--api-key", SECRET,
                "--tasks", str(tasks), "--out", str(out), "--rps", "10", "--events-url", refusing.url]
        assert _run(argv) == 1  # two tasks errored
        summary = {s["task_id"]: s for s in map(json.loads, capsys.readouterr().out.splitlines())}
        assert "git clone" in summary["bad-repo"]["error"] and "does not exist" in summary["bad-repo"]["error"]
        assert "git checkout" in summary["bad-commit"]["error"] and "deadbeef" in summary["bad-commit"]["error"]
        good = summary["good"]
        assert good["status"] == "finished" and good["tool_calls"] == 1, good
        assert good["events_lost"] == good["tool_calls"] * 3 + 2  # tool events + session start/end
        assert (out / "good" / "events_lost.jsonl").exists()
        assert "return a + b" in json.loads((out / "good" / "result.json").read_text())["patch"]
        result = json.loads((out / "good" / "result.json").read_text())
        conversation = Path(result["conversation_dir"])
        assert conversation.is_dir() and any(conversation.rglob("*.json"))  # what ran, kept
        written = [p for p in out.rglob("*") if p.is_file() and ".git" not in p.parts]
        assert not [p for p in written if SECRET in p.read_text(errors="replace")]
        assert "**********" in (out / "run_config.json").read_text()

        assert _run(argv) == 2  # the same --out again: refused, nothing touched
        err = _one_line_error(capsys)
        assert "already holds task bad-repo" in err and "--overwrite" in err
        assert json.loads((out / "good" / "result.json").read_text())["status"] == "finished"
        tasks.write_text(json.dumps(rows[0]) + "\n")
        assert _run([*argv, "--overwrite"]) == 1
        capsys.readouterr()
    assert json.loads((out / "bad-repo" / "result.json").read_text())["status"] == "error"
    assert (out / "good").exists()  # only the re-run task's directory was replaced


def test_ctrl_c_is_one_line_with_the_resume_hint_and_exit_130(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the tasks run (run_tasks stops their processes, then re-raises) printed a raw
    KeyboardInterrupt traceback; compare prints one line and exits 130."""
    from mars_openhands.openhands import runner

    seen: list[str] = []

    def interrupted(tasks, config, **kwargs):
        seen.append(tasks[0].task_id)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_tasks", interrupted)
    out = tmp_path / "out"
    try:
        rc = _run(["--url", "http://127.0.0.1:1", "--model", "m", "--problem", "p",
                   "--workspace", str(tmp_path), "--out", str(out)])
    except KeyboardInterrupt:  # the old behaviour (caught here: it would end pytest's session)
        pytest.fail("KeyboardInterrupt escaped `openhands run` (a raw traceback for the user)")
    assert rc == 130 and seen == ["task-0"]
    line = _one_line_error(capsys)
    assert line.startswith("mars-openhands openhands run: interrupted") and "--resume" in line
    assert str(out) in line
