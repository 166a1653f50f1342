"""``mars-openhands serve``: flags generated from :class:`~mars_openhands.serve.config.ServeConfig`.

Every field becomes a flag whose help is the field's docstring (``num_replicas`` → ``--replicas``,
``vllm_args`` → repeatable ``--vllm-arg``); JSON fields (``--additional-config``) take a JSON
object. The gateway in the ingress takes the keys of ``mars-openhands gateway --config`` from
``--gateway-config FILE``; ``--host``, ``--port`` and ``--stream-path`` are its three common keys.
"""

from __future__ import annotations

import argparse
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mars_openhands import env
from mars_openhands.cli_style import cli_error, config_error_lines, port_number
from mars_openhands.serve.config import ServeConfig

__all__ = ["add_serve_subcommand", "config_from_args", "run_from_args"]

_PROG = "mars-openhands serve"
_FLAG_NAMES = {"num_replicas": "replicas", "vllm_args": "vllm-arg", "gateway": None}
"""Field → flag name where it is not the field's name with dashes; ``None``: no flag of its own."""
_ERROR_FLAGS = {**{name: f"--{flag}" for name, flag in _FLAG_NAMES.items() if flag is not None},
                "gateway": "--gateway-config"}
"""Field → the flag an error names (``gateway``: its keys come from ``--gateway-config``)."""
_GATEWAY_KEYS = (("host", str, "gateway's listen address on the ingress's node (default "
                  "127.0.0.1; 0.0.0.0 to serve other machines)"),
                 ("port", port_number, "gateway's TCP port, 1..65535 (default 8000; not 0: "
                  "Ray restarts a failed ingress on this port, where the printed URL points)"),
                 ("stream_path", str, "path of the run's unified stream (JSONL) at this path on the "
                  "ingress's node; it must not exist yet"))


def _flag_type(annotation: Any) -> Any:
    """argparse ``type`` for a field annotation (``none`` accepted where ``None`` is)."""
    args = typing.get_args(annotation)
    is_optional = isinstance(annotation, types.UnionType) and type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if is_optional else annotation
    if typing.get_origin(base) is dict:
        return _json_object
    convert = base if base in (int, float, str) else str

    def parse(text: str) -> Any:
        return None if is_optional and text.lower() == "none" else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names it in errors
    return parse


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


_json_object.__name__ = "JSON object"


def add_serve_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on an argparse sub-parsers object; sets ``func`` (args → exit code)."""
    parser = subparsers.add_parser(
        "serve", help="N vLLM replicas with a MARS scheduler on Ray Serve, behind the MARS gateway",
        description=ServeConfig.__doc__ + " Stops on Ctrl-C / SIGTERM, leaving no process behind.",
    )
    for name, field in ServeConfig.model_fields.items():
        flag = _FLAG_NAMES.get(name, name.replace("_", "-"))
        if flag is None:
            continue
        default = field.get_default(call_default_factory=True)
        shown = "" if "default" in (field.description or "") else (
            f" (default: {json.dumps(default) if isinstance(default, dict) else default})")
        if name == "vllm_args":
            parser.add_argument(f"--{flag}", dest=name, action="append", default=argparse.SUPPRESS,
                                metavar="ARG", help=f"{field.description} Repeatable; write "
                                "--vllm-arg=--flag for an argument that starts with a dash.")
            continue
        parser.add_argument(f"--{flag}", dest=name, type=_flag_type(field.annotation),
                            default=argparse.SUPPRESS, metavar=flag.upper().replace("-", "_"),
                            help=(field.description or "") + shown)
    parser.add_argument("--gateway-config", type=Path, default=argparse.SUPPRESS, metavar="FILE",
                        help="TOML or JSON file of the gateway's keys (those of `mars-openhands "
                             "gateway --config`, without replicas: they are the engines), e.g. "
                             "{\"admission\": {\"window_max\": 30}, \"num_tool_workers\": 16}")
    for key, kind, text in _GATEWAY_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", dest=f"gateway__{key}", type=kind,
                            default=argparse.SUPPRESS, metavar=key.upper(), help=f"the {text}")
    parser.set_defaults(func=run_from_args)
    return parser


def _read_gateway_file(path: Path) -> dict[str, Any]:
    """A ``--gateway-config`` file. Raises ValueError naming the file and the fix."""
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"--gateway-config {path}: cannot read it as "
                         f"{'TOML' if path.suffix == '.toml' else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--gateway-config {path}: expected a table/object of gateway keys")
    return data


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The :class:`ServeConfig` of the parsed flags, checked as far as it can be before Ray starts:
    the model's fields, ``--model`` for a private Ray (a model directory here, or a Hugging Face
    id), a dotted ``--scheduler`` imported (a vLLM scheduler class), each engine's
    vLLM options (``--block-size`` for its device, ``--vllm-arg``) and the ``"mars"`` section of
    ``--additional-config`` (:func:`~mars_openhands.serve.engine.check_engine_options`), the
    gateway's keys, and, when the gateway runs on this machine, its ``--stream-path`` (must not
    exist) and ``--port`` (must be free).

    Raises:
        ValueError: a bad flag value or file (one line per problem, naming the flag).
    """
    values = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    gateway_file: Path | None = values.pop("gateway_config", None)
    gateway = _read_gateway_file(gateway_file) if gateway_file is not None else {}
    flagged: dict[str, str] = {}  # gateway key → its flag, for the keys given as flags
    for key, _, _ in _GATEWAY_KEYS:
        if f"gateway__{key}" in values:
            gateway[key] = values.pop(f"gateway__{key}")
            flagged[key] = f"--{key.replace('_', '-')}"
    for field, var in (("api_key", env.GATEWAY_API_KEY), ("admin_key", env.GATEWAY_ADMIN_KEY)):
        secret = var.get_secret()
        if gateway.get(field) is None and secret is not None:
            gateway[field] = secret
    if "vllm_args" in values:
        values["vllm_args"] = tuple(values["vllm_args"])
    try:  # a check across fields is check_engine_options's, whose lines name their flags
        config = ServeConfig.model_validate({**values, "gateway": gateway})
    except ValidationError as e:
        raise ValueError("\n".join(config_error_lines(e, _ERROR_FLAGS, model_errors="as_is"))) from None
    config = _with_checked_model(config)
    from mars_openhands.control.cli import gateway_key_hint
    from mars_openhands.control.config import check_runtime
    from mars_openhands.serve.ingress import gateway_config

    try:  # the gateway's keys, checked now rather than in the ingress minutes later
        gateway = gateway_config(
            config, [f"http://127.0.0.1:{i + 1}" for i in range(config.num_replicas)], None)
    except ValidationError as e:
        raise ValueError("\n".join(config_error_lines(
            e, flagged, file_flag="--gateway-config",
            unknown_key_hint=lambda loc: gateway_key_hint(loc, gateway_file)))) from None
    if not config.is_ray_client:  # the ingress runs on this machine (app.start pins it here)
        # The gateway's checks of its node (a --stream-path that exists, a --port in use), as
        # `mars-openhands gateway` runs them before it starts; GatewayConfig is pure, so they are
        # not part of its validation, and the ingress met them only when it opened the stream.
        check_runtime(gateway)  # ConfigError (a ValueError): one line naming the flag
    return config


def _with_checked_model(config: ServeConfig) -> ServeConfig:
    """``config`` with ``--model`` checked here, for a private Ray only: its engines all run on
    this machine, so a path missing here is missing for them (was ~100 s of engine retries, the
    reason left in a deleted log), and a relative directory is made absolute (the engines' vLLM
    runs in the repository's directory), keeping the name clients send. On a cluster
    (``--ray-address``) the model is each engine node's, which this machine may lack (a head
    node without the model disk, a Ray Client): there an engine's failed start says why.

    Raises:
        ValueError: one line naming ``--model`` (:func:`~.engine.checked_model`).
    """
    if config.ray_address is not None:
        return config
    from mars_openhands.serve.engine import checked_model

    model = checked_model(config.model)
    if model == config.model:
        return config
    return config.model_copy(update={"model": model,
                                     "served_model_name": config.served_model_name or config.model})


def run_from_args(args: argparse.Namespace) -> int:
    """Run the application until Ctrl-C / SIGTERM; returns the exit code (2: a bad flag)."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        return max(cli_error(_PROG, line) for line in str(e).splitlines())
    from mars_openhands.serve.app import serve_forever

    return serve_forever(config)
