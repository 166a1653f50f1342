"""``mars-openhands gateway``: flags generated from :class:`GatewayConfig` and its field docstrings.

Every field becomes a flag (``num_tool_workers`` → ``--num-tool-workers``; nested admission and
reorder parameters → ``--admission-window-max``, ``--reorder-starvation-s``); booleans get
``--x/--no-x``; optional values accept ``none``. ``--replica URL[,events=ADDR][,name=N][,source=S]``
is repeatable. ``--config FILE`` (TOML or JSON, same keys as the model) is read first and flags
override it. Unknown keys in the file are an error (``extra="forbid"``).
"""

from __future__ import annotations

import argparse
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from mars_openhands.control.config import GatewayConfig, parse_replica

__all__ = ["add_gateway_subcommand", "config_from_args", "run_from_args"]

_NESTED = ("admission", "reorder")


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(base type, accepts None) of a field annotation such as ``float | None``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return inner[0], len(inner) < len(args)
    return annotation, False


def _converter(base: type, optional: bool, flag: str) -> Any:
    def convert(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} expects {base.__name__}{' or none' if optional else ''}, got {text!r}"
            ) from None

    return convert


def _add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], prefix: str) -> None:
    for name, field in model.model_fields.items():
        if name == "replicas" or (not prefix and name in _NESTED):
            continue
        flag = "--" + (prefix + name).replace("_", "-")
        dest = f"{prefix.replace('-', '__')}{name}"
        default = None if field.default_factory is not None else field.default
        help_text = f"{(field.description or '').strip()} (default: {default})".replace("%", "%%")
        base, optional = _scalar_type(field.annotation)
        if base is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=dest, type=_converter(base, optional, flag),
                                default=argparse.SUPPRESS, metavar=base.__name__.upper(),
                                help=help_text)


def add_gateway_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``gateway`` on an argparse sub-parsers object; sets ``func`` (args → exit code)."""
    parser = subparsers.add_parser(
        "gateway", help="OpenAI-compatible gateway running the MARS external control plane",
        description=GatewayConfig.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                        help="TOML or JSON file with GatewayConfig keys; flags override it")
    parser.add_argument(
        "--replica", dest="replicas", action="append", default=argparse.SUPPRESS,
        metavar="URL[,events=ADDR][,name=N][,source=S]",
        help="a vLLM replica (repeatable): base URL, optional ZeroMQ address its scheduler plugin "
             "binds for CPU-plane events, name, and source of its GPU-plane events",
    )
    _add_model_flags(parser, GatewayConfig, "")
    for nested in _NESTED:
        model = GatewayConfig.model_fields[nested].annotation
        _add_model_flags(parser, model, nested + "-")
    parser.set_defaults(func=run_from_args)
    return parser


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """Build the config from ``--config`` and the flags (flags win).

    Raises:
        pydantic.ValidationError: a bad value (the message names the field).
        ValueError: a bad ``--replica`` spec.
    """
    values = vars(args).copy()
    values.pop("func", None)
    values.pop("command", None)
    data: dict[str, Any] = _read_file(values.pop("config")) if "config" in values else {}
    if "replicas" in values:
        data["replicas"] = [parse_replica(spec) for spec in values.pop("replicas")]
    for nested in _NESTED:
        prefix = nested + "__"
        sub = {k[len(prefix):]: values.pop(k) for k in list(values) if k.startswith(prefix)}
        if sub:
            data[nested] = {**data.get(nested, {}), **sub}
    data.update(values)
    return GatewayConfig.model_validate(data)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the gateway until interrupted; returns the exit code (2 for a bad configuration)."""
    try:
        config = config_from_args(args)
    except (ValidationError, ValueError) as e:
        print(f"mars-openhands gateway: bad configuration:\n{e}")
        return 2
    from mars_openhands.control.server import run_gateway

    run_gateway(config)
    return 0
