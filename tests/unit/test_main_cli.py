"""The top-level ``mars-openhands`` entry point: subcommands unavailable in this environment."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from eval import cli

NEEDS_PY312 = ("the OpenHands SDK needs Python >= 3.12", ".venv-openhands/bin/mars-openhands",
               "scripts/setup.sh")


def _has_openhands_sdk() -> bool:
    try:
        return importlib.util.find_spec("openhands.sdk") is not None
    except ModuleNotFoundError:  # no top-level ``openhands`` at all
        return False


@pytest.fixture
def missing_component(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register a subcommand whose module is not installed (a two-part module name, too)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", (
        *cli.SUBCOMMANDS, ("mars_missing_component_xyz", "add_widget_subcommand")))


@pytest.mark.parametrize("argv", [["widget"], ["widget", "run", "--url", "x"], ["widget", "--help"],
                                  ["widget", "-h", "--bogus"]])
def test_unavailable_subcommand_takes_any_arguments_and_prints_one_line(
        missing_component: None, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("mars-openhands widget: error: unavailable in this environment: "
                               "mars_missing_component_xyz is not installed")


def test_unavailable_subcommand_is_listed_by_its_name(missing_component: None) -> None:
    assert "widget" in cli.build_parser().format_help()


def test_unknown_arguments_of_available_subcommands_are_still_errors(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["workload", "stats", "w.json", "--bogus", "1"])
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus 1" in capsys.readouterr().err


@pytest.mark.skipif(_has_openhands_sdk(),
                    reason="the OpenHands SDK is installed here (.venv-openhands)")
@pytest.mark.parametrize("argv", [["openhands", "run", "--url", "x"], ["openhands", "--help"]])
def test_openhands_without_the_sdk_says_which_environment_to_use(
        tmp_path: Path, argv: list[str]) -> None:
    # a fresh process outside the repo: under pytest, tests/openhands/ is on sys.path and would
    # pass for the SDK's top-level ``openhands`` package
    proc = subprocess.run([sys.executable, "-m", "eval.cli", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("mars-openhands openhands: ")
    assert all(needle in line for needle in NEEDS_PY312), line
