"""The gateway CLI's error lines and start-up line, and the proxy's body handling (pure parts)."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from mars_openhands.control.cli import ConfigError, add_gateway_subcommand, config_from_args
from mars_openhands.control.metadata import BadRequestError, build_engine_body
from mars_openhands.control.proxy import engine_content, probe_body
from tests.proc_tree import reap_with_this_process


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mars_openhands.control", *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.parametrize(
    "args, num_lines, needles",
    [
        (["--config", "missing.yaml"], 1,
         ["--config missing.yaml", "TOML (.toml) or JSON (.json)"]),
        (["--config", "missing.toml", "--replica", "http://127.0.0.1:1"], 1,
         ["--config missing.toml: cannot read it", "check the path"]),
        (["--replica", "http://127.0.0.1:1", "--stream-path", "exists.jsonl", "--port", "0"], 1,
         ["--stream-path exists.jsonl already exists", "pass a new path"]),
        # Were tracebacks, rc 1: FileNotFoundError, FileExistsError, PermissionError.
        (["--replica", "http://127.0.0.1:1", "--stream-path", "/proc/nope/x.jsonl", "--port", "0"],
         1, ["--stream-path /proc/nope/x.jsonl: cannot create files in /proc", "writable directory"]),
        (["--replica", "http://127.0.0.1:1", "--stream-path", "exists.jsonl/x.jsonl", "--port", "0"],
         1, ["--stream-path exists.jsonl/x.jsonl: ", "exists.jsonl is not a directory"]),
        (["--replica", "http://127.0.0.1:1", "--stream-path", "/sys/x.jsonl", "--port", "0"], 1,
         ["--stream-path /sys/x.jsonl: cannot create files in /sys"]),
        ([], 1, ["--replica: required; pass --replica http://127.0.0.1:8001"]),
        (["--replica", "127.0.0.1:1"], 1, ["--replica: replica url must start with http://"]),
        (["--replica", "http://a", "--admission-window-max", "0", "--port", "70000"], 2,
         ["--admission-window-max: Input should be greater than or equal to 1 (got 0)",
          "--port: Input should be less than or equal to 65535 (got 70000)"]),
        (["--config", "bad.json"], 2, ["--replica[0] url: replica url must start with http://",
                                       "--config bad.json: unknown key 'colour'"]),
        (["--config", "flat.json"], 2,
         ["--config flat.json: unknown key 'admission_window_min'; file keys are nested like the "
          'config: {"admission": {"window_min": ...}}',
          "--config flat.json: unknown key 'num-tool-workers'; write it as 'num_tool_workers'"]),
        (["--config", "flat.toml"], 1,
         ["--config flat.toml: unknown key 'reorder_starvation_s'; file keys are nested like the "
          "config: [reorder] starvation_s = ..."]),
        (["--config", "nested.json"], 1,
         ["--config nested.json: unknown key 'admission.colour'; 'admission' takes: window_max"]),
    ],
)
def test_bad_cli_input_is_one_line_per_problem_and_exit_2(tmp_path, args, num_lines,
                                                          needles) -> None:
    (tmp_path / "exists.jsonl").write_text("")
    (tmp_path / "bad.json").write_text(json.dumps({"replicas": [{"url": "x"}], "colour": 1}))
    replica = {"replicas": [{"url": "http://127.0.0.1:1"}]}
    (tmp_path / "flat.json").write_text(json.dumps(
        {**replica, "admission_window_min": 10, "num-tool-workers": 3}))
    (tmp_path / "flat.toml").write_text(
        'reorder_starvation_s = 3\n[[replicas]]\nurl = "http://127.0.0.1:1"\n')
    (tmp_path / "nested.json").write_text(json.dumps({**replica, "admission": {"colour": 1}}))
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == num_lines, lines
    for needle in needles:
        assert any(needle in line for line in lines), (needle, lines)
    assert all(line.startswith("mars-openhands gateway: ") for line in lines)


def _config_errors(*argv: str) -> list[str]:
    """The ConfigError lines of ``gateway argv`` (nothing starts)."""
    parser = argparse.ArgumentParser()
    gateway = add_gateway_subcommand(parser.add_subparsers())
    with pytest.raises(ConfigError) as info:
        config_from_args(gateway.parse_args(list(argv)))
    return str(info.value).splitlines()


def test_validation_error_lines_name_nested_flags() -> None:
    assert _config_errors("--replica", "http://a", "--admission-kv-set-usage", "2.0") == [
        "--admission-kv-set-usage: Input should be less than or equal to 1 (got 2.0)"]
    assert issubclass(ConfigError, ValueError)


def test_a_choice_field_is_a_flag_with_its_choices() -> None:
    parser = argparse.ArgumentParser()
    gateway = add_gateway_subcommand(parser.add_subparsers())
    config = config_from_args(gateway.parse_args(
        ["--replica", "http://a", "--admission-kv-usage-over-replicas", "max"]))
    assert config.admission.kv_usage_over_replicas == "max"
    assert config_from_args(gateway.parse_args(["--replica", "http://a"])).admission \
        .kv_usage_over_replicas == "pooled"
    with pytest.raises(SystemExit):
        gateway.parse_args(["--replica", "http://a", "--admission-kv-usage-over-replicas", "min"])


def test_a_check_across_fields_is_a_line_without_an_empty_flag(monkeypatch) -> None:
    key = "k" * 32
    monkeypatch.delenv("MARS_GATEWAY_API_KEY", raising=False)
    monkeypatch.delenv("MARS_GATEWAY_ADMIN_KEY", raising=False)
    assert _config_errors("--replica", "http://a", "--replica", "http://a") == [
        "replica URLs must be distinct, got ['http://a', 'http://a']"]
    assert _config_errors("--replica", "http://a", "--api-key", key, "--admin-key", key) == [
        "the admin key equals the API key: every agent that holds the API key could read other "
        "sessions' ids; give the admin key its own value"]


def test_no_error_line_prints_a_urls_password(monkeypatch) -> None:
    """A replica URL with credentials (``http://user:pass@host``; aiohttp sends them as basic
    auth) appears with its password hidden in every error that names it: the distinct check
    printed ['http://me:hunter2@a', ...], as did a bad scheme and the --replica spec's errors."""
    monkeypatch.delenv("MARS_GATEWAY_API_KEY", raising=False)
    monkeypatch.delenv("MARS_GATEWAY_ADMIN_KEY", raising=False)
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    url = "http://me:hunter2@a"
    assert _config_errors("--replica", url, "--replica", url + "/") == [
        "replica URLs must be distinct, got ['http://me:***@a', 'http://me:***@a']"]
    lines = _config_errors("--replica", "ftp://me:hunter2@a")
    lines += _config_errors("--replica", f"{url},key_env=NO_SUCH_KEY_VAR")
    lines += _config_errors("--replica", f"{url},colour=red")
    lines += _config_errors("--replica", "https://ghp_token@a", "--replica", "https://ghp_token@a")
    assert lines and not any("hunter2" in line or "ghp_token" in line for line in lines), lines
    assert "ftp://me:***@a" in lines[0] and "--replica http://me:***@a: key_env=" in lines[1]


def test_no_error_line_prints_a_key(tmp_path, monkeypatch) -> None:
    """A key with a bad character (from a flag, the environment, key_env or the --config file),
    a key of the wrong type, or one under a misspelt name: the line names it, never its value."""
    secret = "sk-do not-print"
    monkeypatch.delenv("MARS_GATEWAY_API_KEY", raising=False)
    monkeypatch.delenv("MARS_GATEWAY_ADMIN_KEY", raising=False)
    monkeypatch.setenv("REPLICA_KEY", secret)
    config = tmp_path / "gw.json"
    config.write_text(json.dumps({"replicas": [{"url": "http://a", "api_key": secret}],
                                  "api-key": secret, "admin_key": 12345678}))
    lines = [
        *_config_errors("--replica", "http://a", "--api-key", secret),
        *_config_errors("--replica", "http://a,key_env=REPLICA_KEY"),
        *_config_errors("--config", str(config)),
    ]
    assert lines == [
        "--api-key: the key must be non-empty printable text without whitespace (15 characters given)",
        "--replica http://a key_env: replica api_key must be non-empty printable text without "
        "whitespace (15 characters given)",
        "--replica[0] api_key: replica api_key must be non-empty printable text without whitespace "
        "(15 characters given)",
        "--admin-key: Input should be a valid string",
        f"--config {config}: unknown key 'api-key'; write it as 'api_key' (file keys use underscores)"]
    monkeypatch.setenv("MARS_GATEWAY_ADMIN_KEY", secret)
    assert _config_errors("--replica", "http://a")[0].startswith("MARS_GATEWAY_ADMIN_KEY has whitespace")
    assert not any("not-print" in line or "12345678" in line or "SecretStr" in line
                   for line in lines)


def test_config_help_states_the_nested_file_format_and_no_contradictory_default() -> None:
    parser = argparse.ArgumentParser()
    gateway = add_gateway_subcommand(parser.add_subparsers())
    helps = {a.option_strings[0]: a.help for a in gateway._actions if a.option_strings}
    assert 'nested like the config' in helps["--config"]
    assert '"admission": {"window_min": 10}' in helps["--config"]
    assert "CPU count" in helps["--num-tool-workers"]
    assert "None" not in helps["--num-tool-workers"]  # the field's default_factory, not None
    assert helps["--port"].endswith("(default: 8000)")  # plain defaults are still shown


def _start_gateway(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start the gateway CLI with SIGINT at its default (as from a terminal); return it and its
    start-up line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mars_openhands.control", "--port", "0", *args],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    reap_with_this_process(proc.pid)  # a killed pytest leaves no gateway
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline and "listening" not in line:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
    return proc, line


def test_ctrl_c_stops_the_gateway_quietly_and_closes_the_stream(tmp_path) -> None:
    stream = tmp_path / "stream.jsonl"
    proc, line = _start_gateway("--replica", "http://127.0.0.1:9/", "--stream-path", str(stream),
                                "--stream-write-parquet")
    try:
        assert "listening" in line, line
        time.sleep(0.5)  # let the control loop record at least one event
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == f"mars-openhands gateway: gateway stopped; stream: {stream}"
    lines = stream.read_text().splitlines()
    assert lines and all(json.loads(x)["source"] == "gateway" for x in lines)  # no torn last line
    assert len(pd.read_parquet(stream.with_suffix(".parquet"))) == len(lines)  # closed on shutdown


def test_start_up_line_names_url_replicas_admission_and_stream(tmp_path) -> None:
    stream = tmp_path / "run" / "stream.jsonl"
    proc, line = _start_gateway("--replica", "http://127.0.0.1:9/,name=alpha",
                                "--no-is-admission-enabled", "--stream-path", str(stream))
    try:
        assert line.startswith("MARS gateway listening on http://127.0.0.1:"), line
        port = line.split("http://127.0.0.1:")[1].split(" ")[0]
        assert port.isdigit() and port != "0"
        assert "replicas: alpha=http://127.0.0.1:9" in line
        assert "admission: off" in line and f"stream: {stream}" in line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [{"role": "user", "content": "hé \"q\" }"}], "stream": True},
        {"model": "m", "prompt": "x", "mars_session": "s", "mars_last_step": 1},
        {"model": "m", "vllm_xargs": {"k": 1}, "session_id": "native"},
        {"model": "m", "messages": [], "tools": [{"type": "function"}], "mars_side": 1},
        {"model": "m", "vllm_xargs": {"mars_side": 1, "mars_turn": 4}, "tools": []},
        {},
    ],
)
def test_engine_content_matches_build_engine_body(body) -> None:
    raw = json.dumps(body, indent=1).encode() + b"\n "
    fields = probe_body(raw)
    assert fields == {**{k: v for k, v in body.items() if k in (
        "mars_session", "session_id", "prompt_cache_key", "mars_last_step", "mars_side",
        "vllm_xargs", "stream")}, "has_tools": bool(body.get("tools"))}
    for session_id, turn, last_step, prev_tool, age_s in (("s-1", 3, 1, ("bash", 2.5), 4.25),
                                                          (None, 3, None, None, None),
                                                          ("s-1", None, None, ("bash", 2.5), 4.25)):
        out = json.loads(engine_content(raw, fields, session_id, turn, last_step, prev_tool, age_s))
        assert out == build_engine_body(body, session_id, turn, last_step, prev_tool, age_s)
        assert out["vllm_xargs"].get("mars_session_age_s") == age_s
        assert "mars_side" not in out
        xargs = out["vllm_xargs"]
        if turn is None:  # a side request: no turn, no previous tool, mars_side=1
            assert xargs.get("mars_side") == 1 and "mars_turn" not in xargs
            assert "mars_prev_tool" not in xargs
        else:
            assert xargs["mars_turn"] == turn and "mars_side" not in xargs


@pytest.mark.parametrize("raw, needle", [(b"{nope", "not valid JSON"), (b"[1]", "JSON object"),
                                         (b"", "not valid JSON")])
def test_probe_rejects_non_objects(raw, needle) -> None:
    with pytest.raises(BadRequestError, match=needle):
        probe_body(raw)
