"""The tests' private Docker engine (``_engine.py``): it leaves nothing behind, a dead run's
leftovers are swept, and a missing engine that cannot be installed is one line saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.docker import _engine
from tests.docker._engine import EngineUnavailable, PrivateDockerd, ensure_engine

pytestmark = [pytest.mark.docker, pytest.mark.openhands, pytest.mark.integration,
              pytest.mark.timeout(300)]


def _tiny_rootfs(out: Path) -> Path:
    """A root filesystem holding this host's ``sleep`` and the libraries it loads (~2 MB)."""
    sleep = Path(shutil.which("sleep")).resolve()
    libs = [word for word in subprocess.run(["ldd", str(sleep)], capture_output=True,
                                            text=True).stdout.split() if word.startswith("/")]
    with tarfile.open(out, "w") as tar:
        for path in [str(sleep), *libs]:
            tar.add(os.path.realpath(path), arcname=path.lstrip("/"))
    return out


def _leftovers(root: Path, bridge: str) -> dict[str, object]:
    return {"processes": _engine._pids_naming(root), "mounts": _engine._mounts_under(root),
            "root": root.exists(), "bridge": Path(f"/sys/class/net/{bridge}").exists()}


def test_an_engine_leaves_no_daemon_container_mount_or_bridge(tmp_path: Path) -> None:
    engine = PrivateDockerd()
    try:
        engine.start()
        imported = engine.docker("import", str(_tiny_rootfs(tmp_path / "tiny.tar")), "tiny:1")
        assert imported.returncode == 0, imported.stderr
        run = engine.docker("run", "-d", "-p", "127.0.0.1::9", "tiny:1", str(shutil.which("sleep")),
                            "300")  # a published port: a docker-proxy too
        assert run.returncode == 0, run.stderr
        pid = int(engine.docker("inspect", "-f", "{{.State.Pid}}", run.stdout.strip()).stdout)
        assert _engine._alive(pid)
        during = _leftovers(engine.root, engine.bridge)
        assert during["processes"] and during["mounts"] and during["root"] and during["bridge"]
    finally:
        engine.stop()
    assert _leftovers(engine.root, engine.bridge) == {"processes": [], "mounts": [],
                                                      "root": False, "bridge": False}
    assert not _engine._alive(pid)  # the container's process went with it


def test_a_dead_runs_leftovers_are_swept_and_a_live_runs_kept() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = PrivateDockerd()  # its root and marker, as a run killed before stop() leaves them
    live = PrivateDockerd()
    try:
        subprocess.run(["ip", "link", "add", "name", dead.bridge, "type", "bridge"], check=True)
        (dead.root / _engine._MARKER).write_text(f'{{"pid": {gone.pid}, "bridge": "{dead.bridge}"}}')
        (live.root / _engine._MARKER).write_text(f'{{"pid": {os.getpid()}, "bridge": "{live.bridge}"}}')
        swept = _engine.sweep_dead_engines()
        assert dead.root in swept and live.root not in swept
        assert not dead.root.exists() and live.root.exists()
        assert not Path(f"/sys/class/net/{dead.bridge}").exists()
    finally:
        dead.stop()
        live.stop()


def test_a_missing_engine_that_cannot_be_installed_is_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine.shutil, "which", lambda name: None)
    monkeypatch.setattr(_engine.os, "geteuid", lambda: 1000)
    with pytest.raises(EngineUnavailable) as raised:
        ensure_engine()
    message = str(raised.value)
    assert "\n" not in message and "not root" in message
    assert "apt-get install docker.io mmdebstrap" in message
