"""``python -m mars_openhands.control [gateway flags]``: the gateway without the top-level CLI."""

from __future__ import annotations

import argparse
import sys

from mars_openhands.control.cli import add_gateway_subcommand


def main(argv: list[str] | None = None) -> int:
    """Parse the ``gateway`` flags and serve until interrupted; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m mars_openhands.control")
    sub = parser.add_subparsers(dest="command", required=True)
    add_gateway_subcommand(sub)
    args = parser.parse_args(["gateway", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
