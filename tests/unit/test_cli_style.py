"""The one error style of every command line (mars_openhands/cli_style.py), and a walk over every
subcommand's parser: each flag has help, and a bad choice or value is one line naming the flag."""

from __future__ import annotations

import argparse
import socket

import pytest
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from eval.cli import build_parser, main
from mars_openhands.cli_style import (
    CliParser,
    check_port_free,
    cli_error,
    config_error_lines,
    keys_hint,
    one_line,
    redact_url,
)


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


# -- config_error_lines: the one formatter of pydantic errors (eval, serve, serve's engines) ------------

class _Admission(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window_min: int = Field(1, ge=1)
    window_max: int = Field(8, ge=1)


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    num_tool_workers: int = Field(4, ge=1)
    admission: _Admission = _Admission()
    api_key: str | None = None
    schedulers: list[str] = ["mars"]

    @model_validator(mode="after")
    def _check(self) -> _Config:
        if self.admission.window_min > self.admission.window_max:
            raise ValueError(f"window_min > window_max in num_tool_workers={self.num_tool_workers}")
        if self.api_key == "same":
            raise ValueError("--api-key: the API key equals the admin key; give each its own")
        if not self.schedulers:
            raise ValueError("at least one scheduler is needed")
        return self


def _error(**values) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        _Config.model_validate(values)
    return info.value


def test_config_error_lines_field_and_missing_errors_name_the_flag() -> None:
    flags = {"num_tool_workers": "--tool-workers"}
    assert config_error_lines(_error(num_tool_workers=0), flags) == [
        "--model: required; pass --model VALUE",  # not in flags: the field with dashes
        "--tool-workers: Input should be greater than or equal to 1 (got 0)"]
    # A dict's or list's value is not echoed: the message names the bad part.
    assert config_error_lines(_error(model="m", admission=[1])) == [
        "--admission: Input should be a valid dictionary or instance of _Admission"]


def test_config_error_lines_model_level_errors_assigned_or_as_is() -> None:
    cross = _error(model="m", admission={"window_min": 5, "window_max": 2})
    # "assign": the first field of flags the message names, with that field's value.
    assert config_error_lines(cross, {"num_tool_workers": "--tool-workers"}) == [
        "--tool-workers: window_min > window_max in num_tool_workers=4"]  # not given: no value
    given = _error(model="m", num_tool_workers=3, admission={"window_min": 5, "window_max": 2})
    assert config_error_lines(given, {"num_tool_workers": "--tool-workers"}) == [
        "--tool-workers: window_min > window_max in num_tool_workers=3 (got 3)"]
    assert config_error_lines(cross) == ["config: window_min > window_max in num_tool_workers=4"]
    # "as_is": a cross-field check that writes command-line lines itself (serve's).
    same = _error(model="m", api_key="same")
    assert config_error_lines(same, model_errors="as_is") == [
        "--api-key: the API key equals the admin key; give each its own"]
    assert config_error_lines(_error(model="m", schedulers=[])) == [
        "config: at least one scheduler is needed"]


def test_config_error_lines_file_keys_are_dotted_under_the_file_flag() -> None:
    error = _error(admission={"window_max": 0, "window_mx": 7})
    assert config_error_lines(error, {"num_tool_workers": "--tool-workers"},
                              file_flag="--gateway-config") == [
        "--gateway-config model: required; add the key to the --gateway-config file",
        "--gateway-config admission.window_max: Input should be greater than or equal to 1 (got 0)",
        # was "--gateway-config admission.window_mx: Extra inputs are not permitted (got 7)"
        "--gateway-config: unknown key 'admission.window_mx'; remove it or correct its spelling"]
    # A model-level error names the file, and never dumps its keys (they may be secrets).
    lines = config_error_lines(_error(model="m", api_key="same"), file_flag="--gateway-config")
    assert lines == ["--gateway-config: --api-key: the API key equals the admin key; give each its own"]


def test_config_error_lines_never_print_a_secret() -> None:
    """A key under a misspelt name, or a bad value of a key field, was echoed as ``(got ...)``."""
    secret = "sk-do-not-print"
    lines = config_error_lines(_error(model="m", api_kye=secret), file_flag="--gateway-config")
    lines += config_error_lines(_error(model="m", api_key=12345678))  # e.g. a TOML number
    lines += config_error_lines(_error(model="m", admission={"window_min": 1, "admin_key": secret}))
    assert lines == [
        "--gateway-config: unknown key 'api_kye'; remove it or correct its spelling",
        "--api-key: Input should be a valid string",
        "--admission: unknown key 'admin_key'; remove it or correct its spelling"]

    class _Keys(BaseModel):
        api_key: str = Field(min_length=40)
        hf_token: SecretStr = Field(min_length=40)

    with pytest.raises(ValidationError) as info:
        _Keys.model_validate({"api_key": secret, "hf_token": SecretStr(secret)})
    lines = config_error_lines(info.value)
    assert lines[0] == "--api-key: String should have at least 40 characters"
    assert lines[1].startswith("--hf-token: ") and "got" not in lines[1]


def test_config_error_lines_options_of_the_gateway_command() -> None:
    """Dashed nested flags, ``[i]`` items, a hint for an unknown key, an example value, and no
    pydantic follow-up 'too short' after a bad item (``mars-openhands gateway``'s needs)."""

    class _Replica(BaseModel):
        model_config = ConfigDict(extra="forbid")
        url: str = Field(pattern="^http")

    class _Gateway(BaseModel):
        model_config = ConfigDict(extra="forbid")
        replicas: tuple[_Replica, ...] = Field(min_length=1)
        admission: _Admission = _Admission()

    def errors(**values) -> ValidationError:
        with pytest.raises(ValidationError) as info:
            _Gateway.model_validate(values)
        return info.value

    options = {"dashed_nested": True, "file_flag": "--config gw.json",
               "unknown_key_hint": lambda loc: f"'{loc[0]}' takes: window_min, window_max",
               "examples": {"replicas": "http://127.0.0.1:8001"}}
    lines = config_error_lines(errors(replicas=[{"url": "x"}], admission={"window_min": 0, "colour": 1}),
                               {"replicas": "--replica"}, **options)
    assert lines == [
        "--replica[0] url: String should match pattern '^http' (got 'x')",
        "--admission-window-min: Input should be greater than or equal to 1 (got 0)",
        "--config gw.json: unknown key 'admission.colour'; 'admission' takes: window_min, window_max"]
    assert config_error_lines(errors(), {"replicas": "--replica"}, **options) == [
        "--replica: required; pass --replica http://127.0.0.1:8001"]
    # Without the options: the index and key path below the field's flag.
    assert config_error_lines(errors(replicas=[{"url": "x"}], admission={"window_min": 0})) == [
        "--replicas[0] url: String should match pattern '^http' (got 'x')",
        "--admission window_min: Input should be greater than or equal to 1 (got 0)"]


def test_config_error_lines_say_a_quoted_value_once() -> None:
    class _Stream(BaseModel):
        stream_path: str

        @field_validator("stream_path")
        @classmethod
        def _jsonl(cls, value: str) -> str:
            raise ValueError(f"give a .jsonl path, not {value!r}")

    with pytest.raises(ValidationError) as info:
        _Stream(stream_path="s.parquet")
    assert config_error_lines(info.value) == ["--stream-path: give a .jsonl path, not 's.parquet'"]


def test_config_error_lines_of_a_document_are_dotted_key_paths() -> None:
    """``key_prefix``: the policy params, a workload file, a --tasks line, the in-process gateway's
    variable. Keys dotted after the prefix, a model-level error as its message, an unknown key
    with its section's keys and without its value, the whole document's value never shown."""
    error = _error(num_tool_workers=0, admission={"window_min": 0, "admin_kee": "sk-secret"})
    assert config_error_lines(error, key_prefix="cfg.", unknown_key_hint=keys_hint(_Config, "cfg")) == [
        "cfg.model: required; add the key",
        "cfg.num_tool_workers: Input should be greater than or equal to 1 (got 0)",
        "cfg.admission.window_min: Input should be greater than or equal to 1 (got 0)",
        "unknown key 'cfg.admission.admin_kee'; 'cfg.admission' takes: window_min, window_max"]
    assert config_error_lines(_error(model="m", schedulers=[]), key_prefix="") == [
        "at least one scheduler is needed"]
    with pytest.raises(ValidationError) as info:
        _Config.model_validate_json('{"model": "m", "api_key": "sk-secret"')  # cut short
    [line] = config_error_lines(info.value, key_prefix="")
    assert line.startswith("Invalid JSON: ") and "sk-secret" not in line
    # ... and with flags: a whole document given where an object was expected is not echoed.
    with pytest.raises(ValidationError) as info:
        _Config.model_validate("sk-secret")
    assert config_error_lines(info.value) == [
        "config: Input should be a valid dictionary or instance of _Config"]


def test_keys_hint_follows_the_location_through_nested_models() -> None:
    class _Item(BaseModel):
        url: str
        name: str = ""

    class _Doc(BaseModel):
        items: tuple[_Item, ...] = ()
        extra: _Admission | None = None
        replicas: int = 1

    hint = keys_hint(_Doc, hidden=("replicas",), added=("replica",))
    assert hint(("colour",)) == "the keys are: items, extra, replica"
    assert hint(("items", 2, "colour")) == "'items.2' takes: url, name"
    assert hint(("extra", "colour")) == "'extra' takes: window_min, window_max"
    assert hint(("extra", "window_mn")) == "did you mean 'window_min'? 'extra' takes: window_min, window_max"
    assert hint(("replicas", "x", "y")) is None  # not a model: the default advice
    assert keys_hint(_Doc, "doc")(("extra", "x")) == "'doc.extra' takes: window_min, window_max"


@pytest.mark.parametrize(("text", "shown"), [
    ("http://user:pass@host:8001/v1", "http://user:***@host:8001/v1"),
    ("https://ghp_token@github.com/o/r", "https://***@github.com/o/r"),
    ("http://u:p@ss@host", "http://u:***@host"),  # an unencoded @ in the password
    ("got ['http://a:b@x', 'http://c@y']", "got ['http://a:***@x', 'http://***@y']"),
    ("postgresql+psycopg://mars:pw@127.0.0.1/x", "postgresql+psycopg://mars:***@127.0.0.1/x"),
    ("http://host:8001/a@b and mail me@example.com", "http://host:8001/a@b and mail me@example.com"),
])
def test_redact_url_hides_the_userinfo_of_every_url(text: str, shown: str) -> None:
    assert redact_url(text) == shown


def test_config_error_lines_hide_a_urls_password() -> None:
    class _Replica(BaseModel):
        url: str = Field(pattern="^http")

    with pytest.raises(ValidationError) as info:
        _Replica(url="ftp://me:hunter2@host")
    assert config_error_lines(info.value, {"url": "--replica"}) == [
        "--replica: String should match pattern '^http' (got 'ftp://me:***@host')"]


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
