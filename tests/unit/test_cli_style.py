"""The one error style of every command line (mars_openhands/cli_style.py), and a walk over every
subcommand's parser: each flag has help, and a bad choice or value is one line naming the flag."""

from __future__ import annotations

import argparse
import socket

import pytest

from eval.cli import build_parser, main
from mars_openhands.cli_style import CliParser, check_port_free, cli_error, one_line


def test_one_line_keeps_the_long_flag_and_drops_line_breaks() -> None:
    assert one_line("argument -o/--output: expected a file") == "--output: expected a file"
    assert one_line("argument --rps: invalid float value: 'x'") == "--rps: invalid float value: 'x'"
    assert one_line("first\n  second\n") == "first; second"


def test_parser_error_is_one_line_with_the_command_and_exit_2(capsys) -> None:
    parser = CliParser(prog="mars-openhands demo")
    parser.add_argument("--mode", choices=("a", "b"), help="a mode")
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--mode", "c"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("mars-openhands demo: error: --mode: invalid choice: 'c' "
                                       "(choose from 'a', 'b')\n")


def test_cli_error_returns_2_and_prints_one_line(capsys) -> None:
    assert cli_error("mars-openhands x", "--out y: is a file\ngive a directory") == 2
    assert capsys.readouterr().err == "mars-openhands x: error: --out y: is a file; give a directory\n"


def test_a_listening_port_is_named_with_its_flag() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        message = check_port_free("127.0.0.1", port)
    assert message is not None and message.startswith(f"--port {port}: 127.0.0.1:{port} is in use")
    assert check_port_free("127.0.0.1", port) is None  # closed: free again (SO_REUSEADDR)
    assert check_port_free("127.0.0.1", 0) is None


# -- every subcommand of this environment ------------------------------------------------------------

def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every parser under ``parser``, itself included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, (*path, name))


def _flags():
    for path, parser in _leaves(build_parser()):
        if parser.get_default("accepts_any_args"):  # "unavailable here" placeholder
            continue
        for action in parser._actions:
            if action.option_strings and action.dest not in ("help", "version"):
                yield path, action


FLAGS = list(_flags())


def test_the_walk_sees_every_subcommand_of_this_environment() -> None:
    commands = {path[0] for path, _ in FLAGS if path}
    assert {"gateway", "workload", "replay", "compare"} <= commands


@pytest.mark.parametrize(("path", "action"), FLAGS, ids=[" ".join(p) + " " + a.option_strings[-1]
                                                        for p, a in FLAGS])
def test_every_flag_has_help(path, action) -> None:
    assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), (
        f"mars-openhands {' '.join(path)} {action.option_strings[-1]} has no help text")
    assert action.help.count("(default") <= 1, f"{action.option_strings[-1]}: the default is shown twice"


def _bad_value(action: argparse.Action) -> str | None:
    """A value ``action`` rejects at parse time, or None when it takes any string."""
    if action.choices is not None:
        return "no-such-choice"
    if action.type is None or action.nargs == 0:
        return None
    try:
        action.type("@@not-valid@@")
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return "@@not-valid@@"
    return None


BAD = [(p, a, _bad_value(a)) for p, a in FLAGS if _bad_value(a) is not None and not isinstance(
    a, argparse._SubParsersAction)]


@pytest.mark.parametrize(("path", "action", "value"), BAD,
                         ids=[" ".join(p) + " " + a.option_strings[-1] for p, a, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_flag_and_exit_2(path, action, value, capsys) -> None:
    flag = next(o for o in reversed(action.option_strings) if o.startswith("--"))
    with pytest.raises(SystemExit) as info:
        main([*path, flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"mars-openhands {' '.join(path)}: error: {flag}: "), err
    assert "\nusage:" not in "\n" + err


def test_an_unknown_flag_names_the_subcommand(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["compare", "--no-such-flag"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "mars-openhands compare: error: unrecognized arguments: --no-such-flag\n"


def test_only_compare_gets_its_typed_arguments(monkeypatch) -> None:
    """compare records its command line (run.json); the gateway turns every attribute of its
    namespace into config, so it must get none it did not declare."""
    seen = {}
    parser = build_parser()
    monkeypatch.setattr("eval.cli.build_parser", lambda: parser)
    for name in ("compare", "gateway"):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        sub.set_defaults(func=lambda args, n=name: seen.setdefault(n, vars(args).copy()) and 0)
    main(["compare", "--quick"])
    main(["gateway", "--port", "1"])
    assert seen["compare"]["argv"] == ["--quick"] and "argv" not in seen["gateway"]
