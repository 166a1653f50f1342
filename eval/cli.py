"""`mars-openhands <subcommand>`: the command-line entry point (``[project.scripts]``).

Each subcommand lives with its component and registers itself through an ``add_*_subcommand``
function that adds an argparse sub-parser and sets ``func`` (``args -> exit code``). This module
composes every layer's subcommands (the gateway's, the OpenHands adapter's, the runtime's and
eval's own), so it lives in ``eval``, the one layer that may import all the others: nothing in
``mars_openhands`` imports ``eval``, by name or by string (tests/unit/test_layering.py).

Components are imported by name (:data:`SUBCOMMANDS`), one by one, so that a component that cannot
be imported in this environment (e.g. ``openhands`` without the OpenHands SDK) is still listed;
running it, with any arguments, prints one line saying where it works and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import MappingProxyType

from mars_openhands import __version__
from mars_openhands.cli_signals import sigterm_exits
from mars_openhands.cli_style import EXIT_USAGE, CliParser, cli_error
from mars_openhands.openhands.quiet import quiet_environment

# (module, function) pairs; a subcommand is listed here only once it works end to end.
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("mars_openhands.control.cli", "add_gateway_subcommand"),
    ("mars_openhands.serve.cli", "add_serve_subcommand"),
    ("eval.workloads.cli", "add_workload_subcommand"),
    ("eval.replay", "add_replay_subcommand"),
    ("eval.compare", "add_compare_subcommand"),
    ("eval.plan", "add_plan_subcommand"),
    ("mars_openhands.openhands.cli", "add_openhands_subcommand"),
    ("mars_openhands.runtime.cli", "add_tasks_subcommand"),
)

# (parent subcommand, module, function): sub-subcommands that live outside the parent's package.
# ``openhands bench`` drives engines, the gateway and the playback engine, which the ``openhands``
# layer may not import (tests/unit/test_layering.py), so it lives in ``eval``.
NESTED_SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("openhands", "eval.ohbench_cli", "add_bench_subcommand"),
)

# What to do when a subcommand's module cannot be imported in this environment.
UNAVAILABLE_HINTS = MappingProxyType({
    "mars_openhands.openhands.cli": (
        "the OpenHands SDK needs Python >= 3.12 and is not installed in this environment "
        f"(Python {sys.version_info.major}.{sys.version_info.minor}); use "
        ".venv-openhands/bin/mars-openhands (created by scripts/setup.sh)"
    ),
    "mars_openhands.runtime.cli": (
        "durable tasks need DBOS Transact (the 'runtime' extra), installed in .venv and "
        ".venv-openhands by scripts/setup.sh; OpenHands tasks need .venv-openhands"
    ),
})

EXIT_UNAVAILABLE = EXIT_USAGE


def _unavailable_message(module: str, error: ImportError) -> str:
    """The one line printed for a subcommand whose ``module`` failed to import with ``error``."""
    return UNAVAILABLE_HINTS.get(module) or (
        f"unavailable in this environment: {error.name or error} is not installed "
        "(see scripts/setup.sh for the environments)"
    )


def _add_unavailable(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                     message: str) -> None:
    """Register ``name`` as a sub-parser that accepts any arguments and only prints ``message``."""
    parser = sub.add_parser(name, add_help=False, help=f"(unavailable here: {message})")
    parser.add_argument("ignored_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def run(_args: argparse.Namespace) -> int:
        return cli_error(f"mars-openhands {name}", message)

    parser.set_defaults(func=run, accepts_any_args=True)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available subcommand registered.

    A subcommand whose module raises ImportError here is registered by :func:`_add_unavailable`
    under its name (``add_<name>_subcommand``).
    """
    parser = CliParser(
        prog="mars-openhands",
        description="MARS co-scheduling for agentic LLM workloads on stock vLLM and OpenHands.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for module, func in SUBCOMMANDS:
        try:
            adder = getattr(importlib.import_module(module), func)
        except ImportError as e:  # a component whose extra is not installed in this environment
            name = func.removeprefix("add_").removesuffix("_subcommand")
            _add_unavailable(sub, name, _unavailable_message(module, e))
            continue
        adder(sub)
    _add_nested(sub)
    return parser


def _add_nested(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register :data:`NESTED_SUBCOMMANDS` under their parents (skipped where a parent is
    unavailable here, or where the nested module cannot be imported)."""
    for parent, module, func in NESTED_SUBCOMMANDS:
        parser = sub.choices.get(parent)
        actions = [a for a in getattr(parser, "_actions", [])
                   if isinstance(a, argparse._SubParsersAction)]
        if not actions:  # the parent is the "unavailable here" placeholder
            continue
        try:
            adder = getattr(importlib.import_module(module), func)
        except ImportError:
            continue
        adder(actions[0])


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The sub-parser of ``command`` (so that its errors name it), or ``parser`` itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; return its exit code.

    The subcommand runs inside :func:`~mars_openhands.cli_signals.sigterm_exits`: SIGTERM ends it
    like an exception (its ``finally`` blocks and atexit stop the servers it started), status 143;
    except where it sets ``sigterm_is_crash`` (``tasks``: SIGTERM ends it at once, as before).

    Raises:
        SystemExit: bad arguments (status 2, argparse's message), ``--help``, ``--version``;
            :class:`~mars_openhands.cli_signals.Terminated` (status 143) on SIGTERM.
    """
    quiet_environment()  # before any subcommand imports the OpenHands SDK or LiteLLM
    parser = build_parser()
    # parse_known_args so that an unavailable subcommand sees all its arguments (even --help)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_any_args", False):
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "argv"):  # a subcommand that records its own arguments as typed (compare,
        # in run.json) declares the attribute; the others' namespaces stay as parsed
        args.argv = list(sys.argv[2:] if argv is None else argv[1:])
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2 if args.command is None else 1
    if getattr(args, "sigterm_is_crash", False):  # `tasks`: a SIGTERMed runner resumes later
        return int(args.func(args) or 0)
    with sigterm_exits():  # SIGTERM (e.g. `timeout`) unwinds: servers a subcommand started stop
        return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
