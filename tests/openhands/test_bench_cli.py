"""``mars-openhands openhands bench`` on the top-level CLI: registered under ``openhands`` where the
SDK is, and bad input is one line and exit code 2 before any server starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from eval.cli import main  # noqa: E402

pytestmark = pytest.mark.openhands


def test_bench_is_an_openhands_subcommand(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["openhands", "bench", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--source", "--tasks", "--repos-dir", "--policies", "--rps", "--concurrency",
                 "--backend", "--real-model", "--kv-blocks"):
        assert flag in text


@pytest.mark.parametrize(("make", "extra", "message"), [
    (lambda d: d / "missing.jsonl", ["--repos-dir", "."], "missing.jsonl: no such file"),
    (lambda d: _rows(d, [{"instance_id": "a__b-1", "repo": "a/b"}]), ["--repos-dir", "."],
     "line 1 (instance_id a__b-1): missing field 'base_commit'"),
    (lambda d: _rows(d, []), [], "SWE-bench tasks need --repos-dir"),
    (lambda d: _rows(d, []), ["--repos-dir", "."], "rows.jsonl: no tasks in it"),
    (lambda d: _rows(d, []), ["--repos-dir", ".", "--policies", "fcfs,nope"], "unknown policy 'nope'"),
    (lambda d: _rows(d, []), ["--repos-dir", ".", "--backend", "gpu"], "needs --real-model"),
    (lambda d: _valid_rows(d), ["--repos-dir", "mirror", "--traces", "no-such-dir"],  # under tmp_path (chdir)
     "--traces no-such-dir: not a directory"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, monkeypatch, make, extra,
                                          message) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["openhands", "bench", "--source", "swebench", "--tasks", str(make(tmp_path)),
                 "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and err.count("\n") == 1 and err.startswith("mars-openhands openhands bench: ")
    assert not (tmp_path / "out").exists()


def _valid_rows(directory: Path) -> Path:
    """One valid SWE-bench row and its mirror clone (``directory/mirror/a__b``)."""
    clone = directory / "mirror" / "a__b"
    clone.mkdir(parents=True)
    (clone / "f.py").write_text("x = 1\n")
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(clone)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                         text=True).stdout.strip()
    return _rows(directory, [{"instance_id": "a__b-1", "repo": "a/b", "base_commit": sha,
                              "problem_statement": "fix it"}])


def _rows(directory: Path, rows: list[dict]) -> Path:
    path = directory / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
