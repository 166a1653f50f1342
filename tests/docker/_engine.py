"""A private Docker engine for the tests: its own ``dockerd`` in a temporary directory.

Nothing is shared with another daemon on the machine: the daemon listens on its own socket
(``<root>/docker.sock``; only this engine's children get ``DOCKER_HOST``), keeps images and
containers in ``<root>/data`` (a tmpfs), runs its own containerd under ``<root>/exec``, reads an empty
config file instead of ``/etc/docker/daemon.json``, and attaches containers to a bridge of its
own (``mdk<8 hex>``, a free ``/24``) without touching iptables, IP forwarding or masquerading
(containers reach the host's own addresses on the bridge and nothing beyond). :meth:`stop` removes
everything it made: containers, the daemon and its containerd (their process group, then any
process still naming the root), the root's mounts, the root (images with it), the bridge. A run
that died before ``stop`` (its daemon got SIGTERM with its parent: ``PR_SET_PDEATHSIG``) is swept
by the next :meth:`start`.

Docker's engine comes from Debian's ``docker.io`` (20.10; ``apt-get install`` when ``dockerd`` is
missing, as root), with ``mmdebstrap`` for the offline image build
(``docker/agent-server-base/build.sh``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ENGINE_PACKAGES = ("docker.io", "mmdebstrap")
"""Debian packages that give ``dockerd``, ``containerd``, ``runc``, the ``docker`` CLI, and the
root-filesystem builder of the offline image path."""
ROOT_PREFIX = "mars-dockerd-"
"""Prefix of every engine's temporary directory (``/tmp/mars-dockerd-XXXX``: short, for the
sockets' 108-byte path limit)."""
DATA_ROOT_SIZE = "12g"
"""Most the data root (a tmpfs: images and containers in memory, gone at once with its unmount;
on disk, deleting an imported image's ~100k files took ~2 min on a busy CI-sized machine). Pages
are used as written: the tests' images and containers take ~2.5 GB."""
_MARKER = "owner.json"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class AgentServerImage:
    """An image ``scripts/build_agent_server_image.sh`` built in a test engine."""

    tag: str
    base: str
    build_s: float
    log: str


class EngineUnavailable(RuntimeError):
    """Docker's engine is missing and cannot be installed here (the message says why, one line)."""


def ensure_engine() -> str:
    """Install Debian's ``docker.io`` and ``mmdebstrap`` where ``dockerd`` or ``mmdebstrap`` is
    missing (root, ``apt-get``; ~1-2 min). Returns what it did, one line.

    Raises:
        EngineUnavailable: missing, and not root or no ``apt-get`` or the install failed.
    """
    missing = [name for name in ("dockerd", "docker", "mmdebstrap") if shutil.which(name) is None]
    if not missing:
        return "Docker's engine is installed"
    how = f"apt-get install {' '.join(ENGINE_PACKAGES)}"
    if os.geteuid() != 0:
        raise EngineUnavailable(f"{', '.join(missing)} not installed and this user is not root: "
                                f"run `{how}` as root (Docker tests need a private dockerd)")
    if shutil.which("apt-get") is None:
        raise EngineUnavailable(f"{', '.join(missing)} not installed and no apt-get here: install "
                                "Docker's engine (dockerd) and mmdebstrap")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *ENGINE_PACKAGES]
    start = time.monotonic()
    out = subprocess.run(install, capture_output=True, text=True, env=env)
    if out.returncode != 0:  # stale package lists on a fresh machine
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env)
        out = subprocess.run(install, capture_output=True, text=True, env=env)
    if out.returncode != 0 or shutil.which("dockerd") is None:
        last = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EngineUnavailable(f"`{how}` failed (exit {out.returncode}): {last[0]}")
    return f"installed {' '.join(ENGINE_PACKAGES)} in {time.monotonic() - start:.0f} s"


def _set_parent_death_signal() -> None:
    """In the child before exec: SIGTERM when the test process dies, so the daemon stops its
    containers and exits instead of outliving a killed test run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _free_subnet() -> ipaddress.IPv4Network:
    """A ``172.30-31.x.0/24`` overlapping no address or route of this host."""
    used = subprocess.run(["ip", "-4", "-o", "route", "show", "table", "all"], capture_output=True,
                          text=True).stdout + subprocess.run(["ip", "-4", "-o", "addr"],
                                                             capture_output=True, text=True).stdout
    taken = []
    for word in used.split():
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(word, strict=False))
    candidates = [ipaddress.ip_network(f"172.{a}.{b}.0/24") for a in (30, 31) for b in range(256)]
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(t) for t in taken if t.version == 4 and t.prefixlen > 0):
            return net
    raise RuntimeError("no free 172.30-31.x.0/24 for the test engine's bridge")


class PrivateDockerd:
    """One ``dockerd`` of the tests' own (see the module docstring).

    Attributes:
        root: its temporary directory (socket, data root, exec root, log, pid file).
        env: ``os.environ`` plus ``DOCKER_HOST`` for this engine: give it to the children that use
            it (the docker CLI, the SDK's ``DockerWorkspace``, the OpenHands app).
        gateway_ip: the host's address on the engine's bridge: where containers reach the host
            (``host.docker.internal`` resolves to it with ``--add-host ...:host-gateway``).
    """

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir="/tmp"))
        self.bridge = f"mdk{os.urandom(4).hex()}"
        self.host = f"unix://{self.root}/docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": self.host}
        self.gateway_ip = ""
        self._proc: subprocess.Popen | None = None
        self._made_run_docker = not Path("/run/docker").exists()

    def docker(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        """Run ``docker ARGS`` against this engine; returns the finished process (text output)."""
        return subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout_s)

    def containers(self, image: str) -> list[str]:
        """Ids of this engine's running containers of ``image``."""
        return self.docker("ps", "-q", "--filter", f"ancestor={image}").stdout.split()

    def start(self, timeout_s: float = 90.0) -> None:
        """Sweep dead runs' leftovers, make the bridge, start the daemon, wait for its API.

        Raises:
            RuntimeError: the daemon exited or did not answer within ``timeout_s`` (its log's tail).
        """
        sweep_dead_engines()
        subnet = _free_subnet()
        self.gateway_ip = str(next(subnet.hosts()))
        (self.root / _MARKER).write_text(json.dumps({"pid": os.getpid(), "bridge": self.bridge}))
        for cmd in (["ip", "link", "add", "name", self.bridge, "type", "bridge"],
                    ["ip", "addr", "add", f"{self.gateway_ip}/{subnet.prefixlen}", "dev", self.bridge],
                    ["ip", "link", "set", self.bridge, "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        (self.root / "daemon.json").write_text("{}")  # not the machine's /etc/docker/daemon.json
        (self.root / "data").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DATA_ROOT_SIZE},mode=0700", "tmpfs",
                        str(self.root / "data")], check=True, capture_output=True)
        argv = ["dockerd", "--host", self.host, "--data-root", str(self.root / "data"),
                "--exec-root", str(self.root / "exec"), "--pidfile", str(self.root / "dockerd.pid"),
                "--config-file", str(self.root / "daemon.json"), "--bridge", self.bridge,
                "--iptables=false", "--ip-forward=false", "--ip-masq=false",
                "--log-level", "warn"]
        with open(self.root / "dockerd.log", "wb") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True,
                                          preexec_fn=_set_parent_death_signal)
        deadline = time.monotonic() + timeout_s
        while self.docker("version", "--format", "{{.Server.Version}}").returncode != 0:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "dockerd.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"dockerd did not start (exit {self._proc.returncode}):\n{tail}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Remove every container, stop the daemon, remove the root and the bridge. Idempotent;
        never raises for what is already gone."""
        if self._proc is not None and self._proc.poll() is None:
            ids = self.docker("ps", "-aq").stdout.split()
            if ids:
                self.docker("rm", "-f", *ids)
        _stop_engine(self.root, self.bridge, self._proc.pid if self._proc else None)
        if self._made_run_docker:  # the daemon makes /run/docker/plugins; another one did not
            for path in (Path("/run/docker/plugins"), Path("/run/docker")):
                with contextlib.suppress(OSError):
                    path.rmdir()


def _stop_engine(root: Path, bridge: str, pid: int | None) -> None:
    """Stop a daemon (its process group: SIGTERM, then SIGKILL after 30 s), kill any process
    still naming ``root`` (containerd shims), unmount what is under ``root``, delete ``root`` and
    the bridge."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    for other in _pids_naming(root) + _container_pids(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(other, signal.SIGKILL)
    for mount in sorted(_mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
    if Path(f"/sys/class/net/{bridge}").exists():
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def sweep_dead_engines() -> list[Path]:
    """Remove the leftovers of engines whose test process is gone (a run killed before its
    ``stop``). Returns the roots removed."""
    swept = []
    for root in Path("/tmp").glob(ROOT_PREFIX + "*"):
        try:
            owner = json.loads((root / _MARKER).read_text())
        except (OSError, ValueError):
            continue  # not started yet, or not ours
        if _alive(int(owner["pid"])):
            continue
        pid_file = root / "dockerd.pid"
        pid = int(pid_file.read_text()) if pid_file.exists() else None
        _stop_engine(root, str(owner["bridge"]), pid if pid and _alive(pid) else None)
        swept.append(root)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie child of ours counts as gone
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def _pids_naming(root: Path) -> list[int]:
    """Processes whose command line contains ``root`` (the daemon, containerd, its shims)."""
    pids = []
    needle = str(root).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def _container_pids(root: Path) -> list[int]:
    """Processes in the cgroups of this engine's containers (their ids: ``data/containers/*``):
    they outlive a daemon and shims killed without stopping them."""
    ids = [p.name for p in (root / "data" / "containers").glob("*") if len(p.name) == 64]
    pids = []
    for entry in Path("/proc").iterdir() if ids else ():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                groups = (entry / "cgroup").read_text()
                if any(i in groups for i in ids):
                    pids.append(int(entry.name))
    return pids


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    with open("/proc/self/mounts") as mounts:
        return [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
