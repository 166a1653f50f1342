"""The ``openhands`` subcommands' help and errors (run, playback, app-env, bench): every flag has
help, a bad choice or value is one line naming the flag (exit 2), a busy port names ``--port``;
tests/unit/test_cli_style.py walks the engine env's subcommands the same way."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from eval.cli import build_parser, main  # noqa: E402

pytestmark = pytest.mark.openhands


def _flags():
    top = build_parser()
    openhands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices["openhands"]
    sub = next(a for a in openhands._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                yield ("openhands", name), action


FLAGS = list(_flags())
IDS = [" ".join(p) + " " + a.option_strings[-1] for p, a in FLAGS]


def test_the_walk_sees_run_playback_app_env_and_bench() -> None:
    assert {p[1] for p, _ in FLAGS} >= {"run", "playback", "app-env", "bench"}


@pytest.mark.parametrize(("path", "action"), FLAGS, ids=IDS)
def test_every_flag_has_help_and_one_default(path, action) -> None:
    assert action.help and action.help.strip() and action.help != argparse.SUPPRESS, (
        f"mars-openhands {' '.join(path)} {action.option_strings[-1]} has no help text")
    assert action.help.count("(default") <= 1


def test_run_has_a_description_and_shows_its_defaults() -> None:
    top = build_parser()
    parser = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices["openhands"]
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    assert run.description and "OpenHands agents" in run.description
    helps = {a.option_strings[-1]: a.help for a in run._actions if a.option_strings}
    assert "(default 1)" in helps["--rps"] and "(default 100)" in helps["--max-iterations"]


def _bad(action: argparse.Action) -> str | None:
    if action.choices is not None:
        return "no-such-choice"
    if action.type is None or action.nargs == 0:
        return None
    try:
        action.type("@@not-valid@@")
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return "@@not-valid@@"
    return None


BAD = [(p, a, _bad(a)) for p, a in FLAGS if _bad(a) is not None]


@pytest.mark.parametrize(("path", "action", "value"), BAD,
                         ids=[" ".join(p) + " " + a.option_strings[-1] for p, a, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_flag(path, action, value, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([*path, action.option_strings[-1], value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"mars-openhands {' '.join(path)}: error: {action.option_strings[-1]}: "), err


@pytest.mark.parametrize(("argv", "expected"), [
    # each was a pydantic dump of several lines (RunConfig / LLMSettings), or --rps's own check
    (["--max-iterations", "0"], "--max-iterations: expected an integer >= 1, got '0'"),
    (["--top-p", "1.5"], "--top-p: expected a number in (0, 1], got '1.5'"),
    (["--temperature", "-0.1"], "--temperature: expected a number >= 0, got '-0.1'"),
    (["--tool-timeout-s", "0"], "--tool-timeout-s: expected a number > 0, got '0'"),
    (["--rps", "-1"], "--rps: expected a number > 0, got '-1'"),
])
def test_run_out_of_range_values_are_one_argparse_line(argv, expected, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as info:  # at parsing: before any task, or the SDK import
        main(["openhands", "run", "--url", "http://127.0.0.1:9", "--model", "m", "--problem", "p",
              "--workspace", str(tmp_path), "--out", str(tmp_path / "o"), *argv])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"mars-openhands openhands run: error: {expected}\n"
    assert not (tmp_path / "o").exists()


def test_playback_on_a_busy_port_names_the_flag(tmp_path, capsys) -> None:
    script = tmp_path / "x__y-1.traj.json"
    script.write_text(json.dumps({"instance_id": "x__y-1", "messages": [
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "look", "tool_calls": [{"id": "c0", "type": "function", "function": {
            "name": "bash", "arguments": json.dumps({"command": "ls"})}}]}]}))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = main(["openhands", "playback", "--port", str(port), "--script", str(script)])
    assert code == 2
    err = capsys.readouterr().err
    assert err == (f"mars-openhands openhands playback: error: --port {port}: 127.0.0.1:{port} is in use "
                   "(another server listens there); stop it or pass a free --port\n")


@pytest.mark.parametrize(("argv", "expected"), [
    # --check: before the fix these would serve (--port 0, on a port nobody is told) or raise an
    # OverflowError traceback (--port 99999); the check must come at parsing, before --check
    (["--port", "99999", "--check"], "--port: expected a port in 1..65535, got '99999'"),
    (["--port", "0", "--check"], "--port: expected a port in 1..65535, got '0'"),
    (["--max-turns", "0", "--check"], "--max-turns: expected an integer >= 1, got '0'"),  # played 1 turn
    (["--max-prompt-chars", "0", "--check"],  # was "1 validation error for PlaybackConfig"
     "--max-prompt-chars: Input should be greater than or equal to 1 (got 0)"),
    (["--upstream-prompt", "bogus", "--check"], "--upstream-prompt: invalid choice: 'bogus'"),
])
def test_playback_out_of_range_values_are_one_line_naming_the_flag(argv, expected, tmp_path, capsys) -> None:
    script = tmp_path / "x__y-1.traj.json"
    script.write_text(json.dumps({"instance_id": "x__y-1", "messages": [
        {"role": "assistant", "content": "look", "tool_calls": [{"id": "c0", "type": "function", "function": {
            "name": "bash", "arguments": json.dumps({"command": "ls"})}}]}]}))
    try:
        code = main(["openhands", "playback", "--script", str(script), *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mars-openhands openhands playback: error: {expected}"), err


def test_playback_help_shows_no_none_for_flags_that_cannot_be_none(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["openhands", "playback", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "None" not in text and "(default: none)" not in text
    assert "not given: answer at once with no engine" in text and "1..65535 (default 8100)" in text
