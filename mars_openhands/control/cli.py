"""``mars-openhands gateway``: flags generated from :class:`GatewayConfig` and its field docstrings.

Every field becomes a flag (``num_tool_workers`` → ``--num-tool-workers``; nested admission and
reorder parameters → ``--admission-window-max``, ``--reorder-starvation-s``); booleans get
``--x/--no-x``; optional values accept ``none``. ``--replica URL[,events=ADDR][,name=N][,source=S]``
is repeatable. ``--api-key`` / ``--admin-key`` default to ``MARS_GATEWAY_API_KEY`` /
``MARS_GATEWAY_ADMIN_KEY`` (the environment keeps keys out of ``ps``). ``--config FILE`` (TOML or
JSON, keys nested like the model:
``{"admission": {"window_min": 10}}``, not ``admission_window_min``) is read first and flags override
it. Unknown keys in the file are an error (``extra="forbid"``) that names the nested spelling.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr, ValidationError

from mars_openhands import env
from mars_openhands.cli_style import cli_error, config_error_lines
from mars_openhands.control.config import (
    ConfigError,
    GatewayConfig,
    ReplicaConfig,
    check_runtime,
    parse_replica,
)

__all__ = [
    "ConfigError",
    "add_gateway_subcommand",
    "check_runtime",
    "config_from_args",
    "gateway_key_hint",
    "in_process_config",
    "run_from_args",
]

_NESTED = ("admission", "reorder")
_PROG = "mars-openhands gateway"


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(base type, accepts None) of a field annotation such as ``float | None``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return inner[0], len(inner) < len(args)
    return annotation, False


def _converter(base: type, optional: bool) -> Any:
    def convert(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        try:
            return base(text)
        except ValueError:  # argparse prefixes the flag: "--port: expected an int, got 'x'"
            raise argparse.ArgumentTypeError(
                f"expected {'an' if base.__name__[0] in 'aeiou' else 'a'} {base.__name__}"
                f"{' or none' if optional else ''}, got {text!r}"
            ) from None

    return convert


def _add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], prefix: str) -> None:
    for name, field in model.model_fields.items():
        if name == "replicas" or (not prefix and name in _NESTED):
            continue
        flag = "--" + (prefix + name).replace("_", "-")
        dest = f"{prefix.replace('-', '__')}{name}"
        base, optional = _scalar_type(field.annotation)
        help_text = _help_text(field, optional and base is not SecretStr).replace("%", "%%")
        if base is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(flag, dest=dest, choices=typing.get_args(base),
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=dest, type=_converter(base, optional),
                                default=argparse.SUPPRESS,
                                metavar="KEY" if base is SecretStr else base.__name__.upper(),
                                help=help_text)


def _help_text(field: Any, takes_none: bool = False) -> str:
    """A field's docstring plus its default, once: ``(default: X)``, unless a factory's default
    is already described; ``takes_none``: how to pass no value (``none``).

    A ``default_factory`` default (e.g. ``num_tool_workers``: the CPU count) is computed on this
    machine; when the docstring already says what the default is, no value is appended.
    """
    description = re.sub(r"``([^`]*)``", r"\1", (field.description or "").strip())  # reST literals
    description = re.sub(r"\bNone\b", "none", description)  # as typed on the command line
    if field.default_factory is None and _states_default(description, field.default):
        text = description + (" (" if takes_none else "")
    elif field.default_factory is None:
        default = "none" if field.default is None else field.default
        text = f"{description} (default: {default}"
    elif "default" in description.lower():
        text = description + (" (" if takes_none else "")
    else:
        text = f"{description} (default here: {field.get_default(call_default_factory=True)}"
    if takes_none:
        text += ("; " if not text.endswith("(") else "") + "pass 'none' for no value"
    return text + (")" if "(" in text[len(description):] else "")


def _states_default(description: str, default: Any) -> bool:
    """Whether ``description`` already says ``(default <default>...``, e.g. ``(default 0.7)``."""
    for value in re.findall(r"\(default:? ([-+0-9.e]+)", description):
        try:
            if float(value.rstrip(".")) == float(default):
                return True
        except (TypeError, ValueError):
            continue
    return False


def add_gateway_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``gateway`` on an argparse sub-parsers object; sets ``func`` (args → exit code)."""
    parser = subparsers.add_parser(
        "gateway", help="OpenAI-compatible gateway running the MARS external control plane",
        description=GatewayConfig.__doc__,
    )
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS, metavar="FILE",
                        help="TOML (.toml) or JSON (.json) file of GatewayConfig keys, nested like "
                             "the config: field names with underscores, admission and reorder "
                             "parameters in their own tables, e.g. {\"num_tool_workers\": 8, "
                             "\"admission\": {\"window_min\": 10}, \"replicas\": [{\"url\": "
                             "\"http://127.0.0.1:8001\"}]}; flags override it")
    parser.add_argument(
        "--replica", dest="replicas", action="append", default=argparse.SUPPRESS,
        metavar="URL[,events=ADDR][,name=N][,source=S][,key_env=VAR]",
        help="a vLLM replica (repeatable): base URL, optional ZeroMQ address its scheduler plugin "
             "binds for CPU-plane events, name, source of its GPU-plane events, and the "
             "environment variable holding the replica's own --api-key (sent in place of the "
             "agent's Authorization)",
    )
    parser.add_argument(
        "--print-in-process-config", action="store_true", default=argparse.SUPPRESS,
        help="print the MARS_GATEWAY_CONFIG value for the same settings and the vLLM flag that "
             "runs this gateway inside vLLM's API server (one replica, no extra hop; "
             "docs/gateway.md), then exit; --replica is optional here (only its events=, name= "
             "and source= are used)",
    )
    _add_model_flags(parser, GatewayConfig, "")
    for nested in _NESTED:
        model = typing.cast(type[BaseModel], GatewayConfig.model_fields[nested].annotation)
        _add_model_flags(parser, model, nested + "-")
    parser.set_defaults(func=run_from_args)
    return parser


def _read_file(path: Path) -> dict[str, Any]:
    """Read a ``--config`` file (TOML or JSON). Raises ConfigError naming the file and the fix."""
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(
            f"--config {path}: unsupported file type {path.suffix or '(none)'!r}; write the "
            "GatewayConfig keys as TOML (.toml) or JSON (.json)"
        )
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"--config {path}: cannot read it ({e.strerror or e}); check the path or drop --config"
        ) from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--config {path}: not valid {path.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must hold an object of GatewayConfig keys, "
                          f"got {type(data).__name__}")
    return data


def _nested_example(path: Path | None, section: str, key: str) -> str:
    """How ``key`` under ``section`` is spelled in a TOML or JSON ``--config`` file."""
    if path is not None and path.suffix == ".toml":
        return f"[{section}] {key} = ..."
    return f'{{"{section}": {{"{key}": ...}}}}'


def _section_fields(section: str) -> tuple[str, ...]:
    """Field names of a nested GatewayConfig section (``admission``, ``reorder``, ``replicas``)."""
    annotation = GatewayConfig.model_fields[section].annotation
    model = typing.get_args(annotation)[0] if section == "replicas" else annotation
    return tuple(getattr(model, "model_fields", {}))


def gateway_key_hint(loc: tuple[int | str, ...], path: Path | None = None) -> str:
    """What to write instead of the unknown GatewayConfig file key at ``loc`` (the nested or
    underscore spelling; the keys of a nested section). Pure.

    Args:
        loc: the unknown key's location, e.g. ``("admission_window_min",)``.
        path: the file (its suffix picks TOML or JSON examples); ``None``: JSON.
    """
    key = str(loc[-1])
    if len(loc) > 1 and loc[0] in (*_NESTED, "replicas"):
        return f"'{loc[0]}' takes: {', '.join(_section_fields(str(loc[0])))}"
    if len(loc) == 1:
        spelled = key.replace("-", "_")
        if spelled != key and spelled in GatewayConfig.model_fields:
            return f"write it as '{spelled}' (file keys use underscores)"
        for section in _NESTED:
            rest = spelled.removeprefix(section + "_")
            if rest != spelled and rest in _section_fields(section):
                return ("file keys are nested like the config: "
                        + _nested_example(path, section, rest))
    return ("file keys are nested like the config, e.g. "
            + _nested_example(path, "admission", "window_min")
            + "; see `mars-openhands gateway --help` for the fields")


_REPLICA_OPTIONS = {"url": "", "events_address": " events", "name": " name",
                    "engine_source": " source", "api_key": " key_env"}
"""ReplicaConfig field → its part of a ``--replica URL,events=...,key_env=...`` spec."""


def _error_lines(error: ValidationError, config_file: Path | None) -> str:
    """The gateway's :func:`~mars_openhands.cli_style.config_error_lines`: one flag per field
    (nested ones dashed), ``--replica[i]`` for a replica, unknown keys of ``--config FILE`` with the
    spelling to use, checks across fields as their own lines. Pure."""
    return "\n".join(config_error_lines(
        error, {"replicas": "--replica"}, dashed_nested=True, model_errors="as_is",
        file_flag=f"--config {config_file}" if config_file is not None else None,
        unknown_key_hint=lambda loc: gateway_key_hint(loc, config_file),
        examples={"replicas": "http://127.0.0.1:8001"}))


def _replicas(specs: list[str]) -> list[ReplicaConfig]:
    """The ``--replica`` specs parsed. Raises ConfigError naming the spec's part (``--replica``,
    ``--replica http://a name``)."""
    replicas = []
    for spec in specs:
        url = spec.split(",")[0]
        try:
            replicas.append(parse_replica(spec))
        except ValidationError as e:
            flags = {field: "--replica" + (f" {url}{part}" if part else "")
                     for field, part in _REPLICA_OPTIONS.items()}
            raise ConfigError("\n".join(config_error_lines(e, flags))) from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return replicas


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """Build the config from ``--config`` and the flags (flags win).

    Raises:
        ConfigError: an unreadable ``--config`` file, a bad ``--replica`` spec or a bad value;
            one line per problem naming the flag, the value and the fix.
    """
    values = vars(args).copy()
    values.pop("func", None)
    values.pop("command", None)
    config_file: Path | None = values.pop("config", None)
    data: dict[str, Any] = _read_file(config_file) if config_file is not None else {}
    if "replicas" in values:
        data["replicas"] = _replicas(values.pop("replicas"))
    for nested in _NESTED:
        prefix = nested + "__"
        sub = {k[len(prefix):]: values.pop(k) for k in list(values) if k.startswith(prefix)}
        if sub:
            data[nested] = {**data.get(nested, {}), **sub}
    data.update(values)
    for field, var in (("api_key", env.GATEWAY_API_KEY), ("admin_key", env.GATEWAY_ADMIN_KEY)):
        if data.get(field) is None:
            try:
                secret = var.get_secret()
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if secret is not None:
                data[field] = secret
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_error_lines(e, config_file)) from None


def in_process_config(args: argparse.Namespace) -> str:
    """The shell lines that run ``args``'s gateway in-process: ``MARS_GATEWAY_CONFIG='<json>'`` and
    the ``--middleware`` flag for vLLM (:mod:`mars_openhands.control.inprocess`). Only settings
    that differ from the defaults are written.

    Raises:
        ConfigError: a bad value, more than one ``--replica``, or ``--host``/``--port`` given.
    """
    from mars_openhands.control.inprocess import CONFIG_ENV, IN_PROCESS_URL, config_from_env

    values = vars(args)
    if "host" in values or "port" in values:
        raise ConfigError("--print-in-process-config: --host/--port do not apply in-process (the gateway "
                          "serves on vLLM's own address)")
    specs = values.get("replicas")
    if specs is not None:
        if len(specs) > 1:
            raise ConfigError("--print-in-process-config: the in-process gateway serves one replica (its "
                              "own vLLM server); give at most one --replica")
        first, sep, rest = specs[0].partition(",")
        options = specs[0] if "=" in first else rest  # "events=..." alone: no URL given
        values["replicas"] = [f"{IN_PROCESS_URL},{options}" if options else IN_PROCESS_URL]
    config = config_from_args(args) if specs is not None or _file_has_replicas(args) else \
        _config_with_local_replica(args)
    if len(config.replicas) > 1:
        raise ConfigError("--print-in-process-config: the in-process gateway serves one replica (its own "
                          f"vLLM server); the config has {len(config.replicas)}")
    defaults = GatewayConfig.model_fields
    if config.host != defaults["host"].default or config.port != defaults["port"].default:
        raise ConfigError("--print-in-process-config: host/port (from --config) do not apply in-process "
                          "(the gateway serves on vLLM's own address)")
    if config.api_key is not None or config.replicas[0].api_key is not None:
        raise ConfigError("--print-in-process-config: --api-key (or MARS_GATEWAY_API_KEY) and a "
                          "replica key do not apply in-process: give the key to vLLM (--api-key or "
                          "VLLM_API_KEY), which checks it for the gateway")
    data = config.model_dump(mode="json", exclude_defaults=True,
                             exclude={"replicas", "host", "port", "api_key", "admin_key"})
    replica = config.replicas[0].model_dump(mode="json", exclude_none=True, exclude={"url"})
    if replica:
        data["replica"] = replica
    text = json.dumps(data, separators=(",", ":"))
    config_from_env({CONFIG_ENV: text})  # the value round-trips (raises on a bug, not on input)
    admin = ("# and in vLLM's environment the admin key: export "
             f"{env.GATEWAY_ADMIN_KEY.name}=<key> (never printed)\n" if config.admin_key else "")
    return (f"{CONFIG_ENV}={shlex.quote(text)}\n{admin}"
            "# add to the vLLM server's command line (python -m vllm.entrypoints.openai.api_server ...):\n"
            "--middleware mars_openhands.control.inprocess.MarsGatewayMiddleware")


def _file_has_replicas(args: argparse.Namespace) -> bool:
    path = vars(args).get("config")
    return path is not None and "replicas" in _read_file(path)


def _config_with_local_replica(args: argparse.Namespace) -> GatewayConfig:
    """The config of ``args`` with the in-process placeholder replica (none was given)."""
    from mars_openhands.control.inprocess import IN_PROCESS_URL

    vars(args)["replicas"] = [IN_PROCESS_URL]
    return config_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the gateway until interrupted; returns the exit code.

    Returns:
        2 for a bad configuration (one line per problem on stderr); 0 when the gateway stops,
        including on Ctrl-C (SIGINT), which shuts it down gracefully (stream flushed and closed)
        and prints one line, as uvicorn does.
    """
    in_process = vars(args).pop("print_in_process_config", False)
    try:
        if in_process:
            print(in_process_config(args))
            return 0
        config = config_from_args(args)
        check_runtime(config)
    except ConfigError as e:
        return max(cli_error(_PROG, line) for line in str(e).splitlines())
    from mars_openhands.control.server import run_gateway

    try:
        run_gateway(config)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully (stream closed), then
        # re-raised the signal; exit 0 quietly as uvicorn's own CLI does
        stream = f"; stream: {config.stream_path}" if config.stream_path is not None else ""
        print(f"mars-openhands gateway: gateway stopped{stream}", file=sys.stderr)
    return 0
