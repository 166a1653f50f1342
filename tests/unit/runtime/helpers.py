"""Test doubles that are real servers: a throwaway PostgreSQL cluster, a counter service on
loopback (the target of 'network writes'), the playback model, and a runner in a subprocess."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.openhands._helpers import free_port
from tests.proc_tree import reap_with_this_process

ROOT = Path(__file__).resolve().parents[3]
ENV_REQUIRE_POSTGRES = "MARS_REQUIRE_POSTGRES"
"""Set to 1 by .ci/run: a PostgreSQL leg that cannot start fails instead of skipping."""


def postgres_unavailable(reason: str) -> None:
    """Skip (developer machine) or fail (CI, ``MARS_REQUIRE_POSTGRES=1``) a PostgreSQL test."""
    if os.environ.get(ENV_REQUIRE_POSTGRES) == "1":
        pytest.fail(f"PostgreSQL required ({ENV_REQUIRE_POSTGRES}=1) but {reason}")
    pytest.skip(f"PostgreSQL not available: {reason} (apt-get install postgresql)")


def _pg_bin() -> Path | None:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(candidate, "initdb").exists() and Path(candidate, "pg_ctl").exists():
            return Path(candidate)
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


@contextmanager
def postgres_cluster() -> Iterator[str]:
    """Start a throwaway cluster on 127.0.0.1 (trust auth, no fsync); yield its base URL.

    As root the server runs as the ``postgres`` user (``runuser``): PostgreSQL refuses root.
    """
    bin_dir = _pg_bin()
    if bin_dir is None:
        postgres_unavailable("no initdb/pg_ctl under /usr/lib/postgresql/*/bin")
    base = Path(tempfile.mkdtemp(prefix="mars-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None or subprocess.run(["id", "postgres"], capture_output=True).returncode:
            postgres_unavailable("running as root without a 'postgres' user to run the server")
        shutil.chown(base, "postgres")
        prefix = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = base / "data"
    try:
        subprocess.run([*prefix, str(bin_dir / "initdb"), "-D", str(data), "-U", "mars", "-A", "trust",
                        "--no-sync", "-E", "UTF8"], check=True, capture_output=True, text=True)
        options = f"-p {port} -k {base} -h 127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        subprocess.run([*prefix, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "log"), "-o",
                        options, "-w", "-t", "60", "start"], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(base, ignore_errors=True)
        postgres_unavailable(f"{Path(e.cmd[len(prefix)]).name} failed: {(e.stderr or e.stdout)[-300:]}")
    postmaster = postmaster_pid(data)
    if os.getpgid(postmaster) == postmaster:  # pg_ctl runs it in a session of its own (setsid)
        reap_with_this_process(postmaster)  # a killed pytest leaves no cluster
    try:
        yield f"postgresql://mars@127.0.0.1:{port}"
    finally:
        subprocess.run([*prefix, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def postmaster_pid(data: Path) -> int:
    """The pid of the cluster's postmaster (the first line of ``<data>/postmaster.pid``)."""
    return int((data / "postmaster.pid").read_text().split()[0])


def create_database(base_url: str, name: str) -> str:
    """Create database ``name`` on the cluster; return its URL."""
    import psycopg

    with psycopg.connect(base_url + "/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{base_url}/{name}"


class CounterServer:
    """``POST /incr/<name>`` on loopback: counts raw hits, and applies a hit once per
    ``Idempotency-Key`` (no key: every hit applies). ``GET /counts`` returns both."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.applied: Counter[str] = Counter()
        self.keys: dict[str, set[str]] = {}
        lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                name = self.path.rsplit("/", 1)[-1]
                key = self.headers.get("Idempotency-Key")
                with lock:
                    server.hits[name] += 1
                    seen = server.keys.setdefault(name, set())
                    if key is None or key not in seen:
                        server.applied[name] += 1
                    if key:
                        seen.add(key)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(json.dumps({"applied": server.applied[name]}).encode())

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> CounterServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def git_workspace(path: Path) -> Path:
    """A git repository with one commit (what a coding task starts from)."""
    path.mkdir(parents=True)
    (path / "README.md").write_text("task workspace\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(["git", *args], cwd=path, check=True, env=env)
    return path


# ``python -m mars_openhands.runtime.cli`` is ``mars-openhands tasks`` without importing the other
# subcommands (~0.7 CPU-s per process); test_cli.py runs the top-level command itself.
TASKS_CLI = [sys.executable, "-m", "mars_openhands.runtime.cli"]


def cli(db_url: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``mars-openhands tasks ARGS --db URL`` in a subprocess and wait."""
    return subprocess.run([*TASKS_CLI, *args, "--db", db_url],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})


def deny_in_doubt(store: Any, db_url: str, task_id: str, reason: str) -> list[str]:
    """Deny every pending approval of ``task_id`` through ``tasks deny``; each must be an
    ``in_doubt`` escalation (a killed call the runner will not repeat on its own). Returns the
    denied digests (empty when none is pending)."""
    denied = []
    for request in store.approvals(task_id, status="pending"):
        assert request["kind"] == "in_doubt", request
        r = cli(db_url, "deny", task_id, request["digest"], "--reason", reason)
        assert r.returncode == 0, r.stderr
        denied.append(request["digest"])
    return denied


def start_runner(db_url: str, *args: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``mars-openhands tasks ARGS`` (submit/resume) as a runner process, output to ``log``;
    in a session of its own under the test process's watchdog: a runner waits for approvals
    forever, and a killed pytest must not leave it waiting."""
    out = log.open("ab")
    runner = subprocess.Popen([*TASKS_CLI, *args, "--db", db_url],
                              cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "a@a",
                                   "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "a@a", **env})
    reap_with_this_process(runner.pid)
    return runner
