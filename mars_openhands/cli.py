"""`mars-openhands <subcommand>`: the command-line entry point.

Each subcommand lives with its component and registers itself through an ``add_*_subcommand``
function that adds an argparse sub-parser and sets ``func`` (``args -> exit code``). Components are
imported lazily so that ``mars-openhands --help`` is fast and works in every environment.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mars_openhands import __version__

# (module, function) pairs; a subcommand is listed here only once it works end to end.
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("mars_openhands.control.cli", "add_gateway_subcommand"),
    ("eval.workloads.cli", "add_workload_subcommand"),
    ("eval.replay", "add_replay_subcommand"),
    ("eval.compare", "add_compare_subcommand"),
    ("mars_openhands.openhands.cli", "add_openhands_subcommand"),
)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="mars-openhands",
        description="MARS co-scheduling for agentic LLM workloads on stock vLLM and OpenHands.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for module, func in SUBCOMMANDS:
        try:
            adder = getattr(importlib.import_module(module), func)
        except ImportError as e:  # a component whose extra is not installed in this environment
            sub.add_parser(module.rsplit(".", 2)[-2], help=f"(unavailable here: {e.name} missing)")
            continue
        adder(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2 if args.command is None else 1
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
