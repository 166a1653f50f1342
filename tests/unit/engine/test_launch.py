"""Unit tests for the vLLM server launcher that run without starting vLLM."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from mars_openhands.engine.harness.launch import (
    OWNER_ENV_VAR,
    REPO_ROOT,
    VllmServer,
    VllmServerError,
    VllmServerOptions,
    build_command,
    build_env,
    find_free_port,
    find_owned_server_pids,
    live_pids_in_group,
    terminate_process_group,
)


def _flag_value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_free_port_is_bindable() -> None:
    port = find_free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if it were taken


def test_default_command_serves_dummy_weights_on_loopback(tmp_path: Path) -> None:
    cmd = build_command(VllmServerOptions(model_dir=tmp_path, python_executable="/py"), 8123)
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag_value(cmd, "--model") == str(tmp_path)
    assert _flag_value(cmd, "--load-format") == "dummy"
    assert _flag_value(cmd, "--host") == "127.0.0.1"
    assert _flag_value(cmd, "--port") == "8123"
    assert _flag_value(cmd, "--dtype") == "float32"
    assert _flag_value(cmd, "--max-model-len") == "4096"
    assert "--enforce-eager" in cmd
    for absent in ("--scheduler-cls", "--num-gpu-blocks-override", "--enable-prefix-caching"):
        assert absent not in cmd


def test_every_option_maps_to_its_flag(tmp_path: Path) -> None:
    opts = VllmServerOptions(
        model_dir=tmp_path,
        served_model_name="m",
        scheduler_cls="mars_openhands.engine.schedulers.mars.MarsScheduler",
        executor_backend="mars_openhands.engine.harness.executor.emulated.EmulatedExecutor",
        additional_config={"mars": {"ttl_s": 2.0}},
        num_gpu_blocks_override=64,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=2048,
        block_size=32,
        enable_prefix_caching=False,
        enforce_eager=False,
        api_key="k1",
        extra_args=("--seed", "7"),
    )
    cmd = build_command(opts, 9000)
    assert "--api-key" not in cmd and "k1" not in " ".join(cmd)  # argv is world-readable (ps)
    assert build_env(opts, {"VLLM_API_KEY": "inherited"})["VLLM_API_KEY"] == "k1"
    assert "VLLM_API_KEY" not in build_env(opts.model_copy(update={"api_key": None}),
                                           {"VLLM_API_KEY": "inherited"})
    assert _flag_value(cmd, "--served-model-name") == "m"
    assert _flag_value(cmd, "--scheduler-cls") == opts.scheduler_cls
    assert _flag_value(cmd, "--distributed-executor-backend") == opts.executor_backend
    assert json.loads(_flag_value(cmd, "--additional-config")) == {"mars": {"ttl_s": 2.0}}
    assert _flag_value(cmd, "--num-gpu-blocks-override") == "64"
    assert _flag_value(cmd, "--max-num-seqs") == "8"
    assert _flag_value(cmd, "--max-num-batched-tokens") == "512"
    assert _flag_value(cmd, "--max-model-len") == "2048"
    assert _flag_value(cmd, "--block-size") == "32"
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" not in cmd
    assert cmd[-2:] == ["--seed", "7"]
    on = build_command(opts.model_copy(update={"enable_prefix_caching": True}), 9000)
    assert "--enable-prefix-caching" in on and "--no-enable-prefix-caching" not in on


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"num_gpu_blocks_override": -1}, "num_gpu_blocks_override"),
        ({"port": 70000}, "port"),
        ({"block_size": 48}, "multiple of 32"),
        ({"scheduler_cls": "not a class"}, "dotted name"),
        ({"additional_config": {"x": object()}}, "JSON-serializable"),
        ({"extra_args": ("--port=1",)}, "repeats '--port'"),
        ({"extra_args": ("--api-key", "k")}, "api_key="),
        ({"extra_args": ("--max-num-seqs", "4")}, "max_num_seqs="),
        ({"max_num_seq": 4}, "Extra inputs are not permitted"),
        (
            {"num_gpu_blocks_override": 64, "block_size": 32, "max_model_len": 4096},
            "2048 tokens < max_model_len = 4096",
        ),
    ],
)
def test_bad_options_are_rejected_naming_the_field(tmp_path: Path, bad: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        VllmServerOptions(model_dir=tmp_path, **bad)


def test_options_and_keywords_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="not both"):
        VllmServer(VllmServerOptions(model_dir=tmp_path), max_num_seqs=2)


def test_env_puts_repo_first_on_pythonpath_and_stays_offline(tmp_path: Path) -> None:
    opts = VllmServerOptions(
        model_dir=tmp_path, kv_cache_space_gib=2, extra_env={"HF_HUB_OFFLINE": "0", "X": "y"}
    )
    env = build_env(opts, {"PYTHONPATH": f"/a{os.pathsep}{REPO_ROOT}", "KEEP": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/a"]
    assert (REPO_ROOT / "mars_openhands" / "__init__.py").exists()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "0" and env["X"] == "y"  # extra_env wins
    assert env["KEEP"] == "1"
    assert env[OWNER_ENV_VAR] == str(os.getpid())
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    in_process = build_env(opts.model_copy(update={"worker_in_engine_process": True}), {})
    assert in_process["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_properties_before_start_raise_clearly(tmp_path: Path) -> None:
    server = VllmServer(model_dir=tmp_path)
    with pytest.raises(VllmServerError, match="not started"):
        _ = server.url
    with pytest.raises(VllmServerError, match="not started"):
        _ = server.pid
    assert not server.is_running and server.log_tail() == ""
    server.stop()  # idempotent before start


def test_process_that_exits_early_raises_with_log_tail(tmp_path: Path) -> None:
    # A "python" that prints and exits stands in for vLLM rejecting a flag.
    fake_python = tmp_path / "fake-python"
    fake_python.write_text("#!/bin/sh\necho 'error: unrecognized arguments: --bogus'\nexit 2\n")
    fake_python.chmod(0o755)
    server = VllmServer(
        model_dir=tmp_path, python_executable=str(fake_python), log_path=tmp_path / "s.log"
    )
    with pytest.raises(VllmServerError, match=r"(?s)exited with code 2.*unrecognized arguments"):
        server.start()
    assert not server.is_running


def test_timeout_raises_and_kills_the_whole_group(tmp_path: Path) -> None:
    # A "server" that never listens and forks a grandchild: both must be gone after.
    fake_python = tmp_path / "fake-python"
    fake_python.write_text("#!/bin/sh\nsleep 300 &\necho never ready pgid=$$\nsleep 300\n")
    fake_python.chmod(0o755)
    server = VllmServer(
        model_dir=tmp_path,
        python_executable=str(fake_python),
        startup_timeout_s=1.5,
        stop_timeout_s=2.0,
        log_path=tmp_path / "s.log",
    )
    t0 = time.monotonic()
    with pytest.raises(VllmServerError, match=r"(?s)not ready after 2 s.*never ready"):
        server.start()
    assert time.monotonic() - t0 < 10
    pgid = int(re.search(r"pgid=(\d+)", (tmp_path / "s.log").read_text()).group(1))
    assert live_pids_in_group(pgid) == []  # the shell and its backgrounded sleep
    assert pgid not in find_owned_server_pids(os.getpid())


def test_terminate_process_group_escalates_to_sigkill(tmp_path: Path) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.5)  # let it install the handler
    t0 = time.monotonic()
    terminate_process_group(proc.pid, timeout_s=0.5)
    assert proc.wait(timeout=5) == -9
    assert 0.4 < time.monotonic() - t0 < 5
    assert live_pids_in_group(proc.pid) == []


def test_host_kv_tier_becomes_vllms_offloading_flags() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from mars_openhands.engine.harness.launch import host_kv_flags
    from mars_openhands.engine.harness.offload.params import SPEC_NAME, HostKvParams

    flags = host_kv_flags(HostKvParams(size_gib=8, eviction="arc"))
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(flags)
    assert (args.kv_offloading_backend, args.kv_offloading_size) == ("native", 8.0)
    extra = args.kv_transfer_config.kv_connector_extra_config
    assert (extra["spec_name"], extra["eviction_policy"]) == (SPEC_NAME, "arc")
