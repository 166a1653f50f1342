"""What a user sees when an engine cannot start, and what is left on disk (serve/engine.py,
serve/cli.py), without Ray or vLLM: ``--model`` checked before Ray, an engine's failed start
that keeps its vLLM log and says where, and the engines' temporary directories removed on every
stop path.

Each test failed on the code before the fix (see the docstrings).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mars_openhands.engine.harness.launch import VllmServerError
from mars_openhands.serve import app
from mars_openhands.serve import engine as engine_mod
from mars_openhands.serve.cli import add_serve_subcommand, config_from_args, run_from_args
from mars_openhands.serve.config import ServeConfig


@pytest.fixture
def tmp_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tempfile.gettempdir()`` (where engines make their directories) is a new short directory
    (pytest's ``tmp_path`` under a worker is too long for the engines' ipc socket paths)."""
    root = Path(tempfile.mkdtemp(prefix="mst-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_long_temporary_directory_falls_back_to_tmp_for_the_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Unix socket path has at most 107 bytes: below a long $TMPDIR the engine's
    ``<run root>/engine<i>-<12 hex>/gpu.sock`` did not bind (seen under a pytest worker)."""
    monkeypatch.setattr(tempfile, "tempdir", "/tmp/" + "d" * 80)
    assert engine_mod.run_root("r1") == Path("/tmp/mars-serve-r1")
    assert engine_mod.kept_log_path("r1", 0).parent == Path("/tmp")
    monkeypatch.setattr(tempfile, "tempdir", "/var/tmp")
    assert engine_mod.run_root("r1") == Path("/var/tmp/mars-serve-r1")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_subcommand(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", "--port", "1", *argv])  # port 1: never free to bind,
    # but the port check runs after the model's


# ---------------------------------------------------------------------------- --model before Ray
@pytest.mark.parametrize(("model", "why"), [
    ("/nonexistent/model", "no such model directory, and not a Hugging Face model id"),
    ("./models/x", "no such model directory"),
    ("a/b/c", "no such model directory"),
    ("{dir}", "the directory has no config.json"),
    ("{file}", "a file, not a model directory"),
])
def test_a_bad_model_is_one_line_and_exit_2_before_ray(model: str, why: str, tmp_path: Path,
                                                       capsys, monkeypatch) -> None:
    """``--model /nonexistent/model`` started Ray and the engines, failed after ~100 s of
    retries and printed only "Failed to update the deployments ['engine-0']"."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_text("")
    model = model.format(dir=tmp_path / "empty", file=tmp_path / "weights.bin")
    monkeypatch.setattr(app, "serve_forever", lambda config: pytest.fail("Ray would start"))
    assert run_from_args(_parse("--model", model)) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mars-openhands serve: error: --model {model}: ") and why in line


def test_a_model_directory_is_made_absolute_and_an_id_is_left_to_the_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative directory reaches each engine as an absolute path (vLLM runs in the
    repository's directory), under the name the user gave; a Hugging Face id is not checked
    here (vLLM downloads it, or finds it in its cache); on a cluster nothing is checked here."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mars_openhands.control.config.check_port_free", lambda *a: None)
    config = config_from_args(_parse("--model", "m"))
    assert (config.model, config.served_model_name) == (str(tmp_path / "m"), "m")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert config_from_args(_parse("--model", "Qwen/Qwen3-8B")).model == "Qwen/Qwen3-8B"
    assert config_from_args(_parse("--model", "/nonexistent/model", "--ray-address",
                                   "ray://head:10001")).model == "/nonexistent/model"


def test_an_uncached_id_is_refused_when_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"^--model no-org/no-such-model-x: not in the local "
                                         "Hugging Face cache, and HF_HUB_OFFLINE is set"):
        engine_mod.checked_model("no-org/no-such-model-x")
    assert engine_mod.checked_model("tiny") == "tiny"


# ---------------------------------------------------------------- an engine that does not start
class _FailingServer:
    """A VllmServer whose server writes a log, then exits (or is interrupted by a signal)."""

    error: BaseException = VllmServerError("vLLM server (pid 7, port 9) exited with code 1.\n"
                                           "command: ...\nlog: ...")

    def __init__(self, options: Any) -> None:
        self.options = options

    def start(self) -> None:
        lines = [f"line {i}" for i in range(100)] + [
            "huggingface_hub.errors.HFValidationError: Repo id must be in the form ..."]
        self.options.log_path.write_text("\n".join(lines) + "\n")
        raise self.error

    def log_tail(self, num_lines: int = 60) -> str:
        return "\n".join(self.options.log_path.read_text().splitlines()[-num_lines:])

    def stop(self) -> None:
        pass


def test_a_failed_start_keeps_the_log_says_where_and_leaves_nothing_else(
        tmp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason (HFValidationError) was only in the engine's vllm.log, in a temporary
    directory deleted on this path; the user saw "Failed to update the deployments"."""
    monkeypatch.setattr(engine_mod, "VllmServer", _FailingServer)
    with pytest.raises(VllmServerError) as info:
        engine_mod.EngineReplica(ServeConfig(model="/models/m"), 0, "key", run_id="r1")
    message = str(info.value)
    kept = engine_mod.kept_log_path("r1", 0)
    assert message.startswith("engine-0 did not start: vLLM server (pid 7, port 9) exited with "
                              f"code 1.\nits vLLM log is kept at {kept} on ")
    assert message.endswith("HFValidationError: Repo id must be in the form ...")
    assert "HFValidationError" in kept.read_text()
    assert sorted(p.name for p in tmp_root.iterdir()) == [kept.name]  # run root removed

    # What serve prints: Ray Serve's status message ends with the engine's error.
    status = ("The deployment failed to start 3 times in a row. ... Error:\nray::ServeReplica:"
              "mars:engine-0.initialize_and_get_metadata() (pid=1, ip=10.0.0.1)\n  File \"x\"\n"
              f"RuntimeError: Traceback (most recent call last):\n  ...\nmars_openhands.engine."
              f"harness.launch.VllmServerError: {message}\n")
    assert engine_mod.engine_failure_text("engine-0", status) == message
    assert engine_mod.engine_failure_text("engine-1", "a\nb\nc", num_lines=2) == "b\nc"


def test_an_interrupted_start_leaves_nothing(tmp_root: Path, monkeypatch) -> None:
    monkeypatch.setattr(engine_mod, "VllmServer", _FailingServer)
    monkeypatch.setattr(_FailingServer, "error", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine_mod.EngineReplica(ServeConfig(), 1, run_id="r2")
    assert list(tmp_root.iterdir()) == []


def test_start_reports_each_failed_engine_in_its_error(monkeypatch) -> None:
    """serve printed only "Deploying application mars failed: Failed to update the deployments
    ['engine-0']"."""
    import ray
    from ray import serve
    from ray.serve._private.common import DeploymentStatus

    class Status:
        def __init__(self, status: Any, message: str) -> None:
            self.status, self.message = status, message

    deployments = {"engine-1": Status(DeploymentStatus.HEALTHY, ""),
                   "engine-0": Status(DeploymentStatus.DEPLOY_FAILED,
                                      "...Error:\n...VllmServerError: engine-0 did not start: "
                                      "exited.\nits vLLM log is kept at /tmp/x.log on h")}
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(app, "build_app", lambda *a, **k: None)

    def failed_run(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Deploying application mars failed: Failed to update the deployments "
                           "['engine-0']")

    monkeypatch.setattr(serve, "run", failed_run)
    monkeypatch.setattr(serve, "status", lambda: type("S", (), {"applications": {
        app.APP_NAME: type("A", (), {"deployments": deployments})}}))
    with pytest.raises(RuntimeError) as info:
        app.start(ServeConfig(), run_id="r3")
    assert str(info.value) == (
        "Deploying application mars failed: Failed to update the deployments ['engine-0']\n"
        "engine-0 did not start: exited.\nits vLLM log is kept at /tmp/x.log on h")


# ------------------------------------------------------------------- every stop path cleans up
def _engine_dirs(run_id: str) -> Path:
    """What engines of ``run_id`` leave when Ray kills them mid-start: their run directories."""
    for i in range(2):
        run_dir = engine_mod.run_root(run_id) / f"engine{i}-abc"
        run_dir.mkdir(parents=True)
        (run_dir / "gpu.sock").write_text("")
        (run_dir / "vllm.log").write_text("loading\n")
    return engine_mod.run_root(run_id)


@pytest.mark.parametrize("how", ["signal while starting", "failed start", "signal once serving"])
def test_every_stop_path_removes_the_engines_directories(how: str, tmp_root: Path, monkeypatch,
                                                         restore_handlers, capsys) -> None:
    """``timeout 60 serve ...`` (SIGTERM while the engines started) left
    /tmp/mars-serve-engine0-* and -engine1-* (gpu.sock, vllm.log): Ray killed the engines'
    actors before their clean-up ran. The real :func:`app.stop` runs here (Ray not started)."""
    seen: dict[str, Any] = {}

    def fake_start(config: ServeConfig, on_ray_started: Any = None,
                   run_id: str | None = None) -> tuple[Any, str]:
        seen["root"] = _engine_dirs(run_id)
        engine_mod.kept_log_path(run_id, 0).write_text("kept: its path was printed\n")
        if how == "failed start":
            raise RuntimeError("Deploying application mars failed")
        if how == "signal while starting":
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(3.0)  # serve.run's wait, interrupted by the signal
        return object(), "http://127.0.0.1:1"

    def signal_once_serving() -> None:  # after the "listening" line, never after serve_forever
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if "listening on" in capsys.readouterr().err:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    monkeypatch.setattr(app, "start", fake_start)
    if how == "signal once serving":
        threading.Thread(target=signal_once_serving, daemon=True).start()
    rc = app.serve_forever(ServeConfig())
    assert rc == {"signal while starting": 128 + signal.SIGTERM, "failed start": 1,
                  "signal once serving": 0}[how]
    assert seen["root"].name.startswith("mars-serve-") and not seen["root"].exists()
    assert [p.name for p in tmp_root.iterdir()] == [seen["root"].name + "-engine0-vllm.log"]
