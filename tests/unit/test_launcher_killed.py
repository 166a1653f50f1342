"""Nothing a launcher started keeps running once the launcher is killed (SIGTERM, SIGINT, SIGKILL).

Two launcher kinds, each in a child Python process that starts a ``VllmServer`` and waits:
``script`` (a benchmark-style script: ``start()``, then ``stop()`` in ``finally``) and ``cli``
(``mars-openhands compare``: ``eval.cli.main`` running the subcommand, whose body is swapped for
the same start-and-wait). The server is a stand-in for vLLM's API server (``FAKE_SERVER``: it
answers ``/health`` and ``/v1/models`` and starts a ``sleep`` as its "engine core", in its group),
run through ``VllmServerOptions.python_executable``, so ``VllmServer`` takes the same path as with
vLLM: own session, readiness probe, watchdog, ``stop()``, atexit. The real server under the real
``compare --backend cpu`` is tests/integration/test_launcher_killed_cpu.py.

What is checked is selected by pid, never by name (other people's vLLM servers run on the same
machine): every descendant of the launcher just before the signal (pid and start time, from
/proc), plus the server's process group; all must be gone within ``BOUND_S``. Where the launcher
can run its teardown (the ``cli`` kind on SIGTERM or SIGINT), the group must already be gone when
the launcher has exited: the teardown ran in it, not in the watchdog afterwards.

Before the fix (no ``reap_with_owner`` by default, no SIGTERM handler in the CLI) the SIGTERM and
SIGKILL cases of both kinds failed: the stand-in server and its ``sleep`` stayed, re-parented.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mars_openhands.cli_signals import EXIT_TERMINATED
from mars_openhands.engine.harness.launch import live_pids_in_group
from tests.proc_tree import (
    alive,
    assert_ends_with_owner,
    command_line,
    descendants,
    identities,
    kill_alive,
    kill_leftovers,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 15.0
"""Seconds within which everything the launcher started must be gone (the watchdog polls every
0.5 s, then SIGTERM; the stand-ins die on SIGTERM; generous for a busy 2-core machine)."""

FAKE_SERVER = textwrap.dedent("""
    import http.server, json, subprocess, sys
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    body = json.dumps({"data": [{"id": args[args.index("--served-model-name") + 1]}]}).encode()
    subprocess.Popen(["sleep", "300"])  # the "engine core": same process group

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")

LAUNCHER = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if inherited ignored
    kind, fake_python, model_dir = sys.argv[1:4]

    def serve_forever(*_args, **_kwargs):
        from mars_openhands.engine.harness.launch import VllmServer
        server = VllmServer(model_dir=Path(model_dir), python_executable=fake_python,
                            startup_timeout_s=120.0, stop_timeout_s=3.0)
        server.start()
        try:
            print(server.pid, flush=True)
            time.sleep(300)
        finally:
            server.stop()
        return 0

    if kind == "script":
        serve_forever()
    else:
        import eval.compare
        eval.compare._main = serve_forever  # the subcommand's body: start a server and wait
        from eval.cli import main
        sys.exit(main(["compare"]))
""")


def _fake_python(tmp_path: Path) -> Path:
    """An executable that ``VllmServer`` runs as its ``python -m vllm...``: FAKE_SERVER."""
    path = tmp_path / "fake-vllm-python"
    path.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
@pytest.mark.parametrize("kind", ["script", "cli"])
def test_a_killed_launcher_leaves_no_process(kind: str, sig: signal.Signals, tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, kind, str(_fake_python(tmp_path)), str(tmp_path)],
        stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    started: dict[int, int] = {}
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        assert line.strip().isdigit(), f"the launcher did not start its server (exit {launcher.wait()})"
        pgid = int(line)
        assert wait_until(lambda: len(live_pids_in_group(pgid)) >= 2, 30.0), "server and engine core"
        started = descendants(launcher.pid)
        assert set(live_pids_in_group(pgid)) <= set(started), "the group is the launcher's"
        time.sleep(0.5)  # a watchdog has read the launcher's start time
        launcher.send_signal(sig)
        rc = launcher.wait(timeout=60)
        if kind == "cli" and sig != signal.SIGKILL:  # the teardown ran in the launcher itself
            assert live_pids_in_group(pgid) == [], f"exit {rc}: the server's group outlived it"
            assert rc == (EXIT_TERMINATED if sig == signal.SIGTERM else -signal.SIGINT), rc
        assert wait_until(lambda: not alive(started), BOUND_S), (
            f"{kind} launcher killed by {sig.name} (exit {rc}): still running {alive(started)} "
            f"of {sorted(started)}")
    finally:
        launcher.kill()
        launcher.wait()
        kill_alive(started)


RAY_LIKE_LAUNCHER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from mars_openhands.engine.harness.launch import VllmServer
    fake_python, model_dir = sys.argv[1:3]
    server = VllmServer(model_dir=Path(model_dir), python_executable=fake_python,
                        startup_timeout_s=120.0, stop_timeout_s=3.0)
    server.start()
    print(server.pid, flush=True)
    sys.stdin.readline()
    # A Ray worker's exit (ray.kill): SIGKILL every direct child, then exit at once, no atexit
    # (Ray's core_worker_shutdown_executor.cc: "Try killing all child processes of this worker").
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)
""")


def _watchdogs_of(pgid: int) -> dict[int, int]:
    """The watchdog processes (``reaper.py``) of process group ``pgid``: pid -> start time."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if b"mars_openhands.engine.harness.reaper" in argv and str(pgid).encode() in argv:
            found.append(int(entry.name))
    return identities(found)


def test_an_owner_that_kills_its_children_as_it_exits_leaves_no_engine_core(tmp_path: Path) -> None:
    """What a Ray worker does when Ray kills its actor: SIGKILL its direct children, then exit.
    Under ``mars-openhands serve`` those were the vLLM API server and its watchdog; the engine
    core below the server ran on, re-parented to pid 1 (tests/integration/test_serve_stopped.py
    with real Ray and vLLM). The watchdog is no child of the owner now, so it survives that and
    ends the server's tree; then it leaves too."""
    launcher = subprocess.Popen([sys.executable, "-c", RAY_LIKE_LAUNCHER, str(_fake_python(tmp_path)),
                                 str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    started: dict[int, int] = {}
    try:
        assert launcher.stdout is not None and launcher.stdin is not None
        line = launcher.stdout.readline()
        assert line.strip().isdigit(), f"the launcher did not start its server (exit {launcher.wait()})"
        pgid = int(line)
        assert wait_until(lambda: len(live_pids_in_group(pgid)) >= 2, 30.0), "server and engine core"
        time.sleep(0.5)  # the watchdog has read the launcher's start time
        started = {**descendants(launcher.pid), **_watchdogs_of(pgid)}
        assert len(_watchdogs_of(pgid)) == 1 and set(live_pids_in_group(pgid)) <= set(started)
        launcher.stdin.write(b"exit\n")
        launcher.stdin.flush()
        assert launcher.wait(timeout=30) == 0
        assert wait_until(lambda: not alive(started), BOUND_S), (
            f"still running {alive(started)} of {sorted(started)}: "
            + "; ".join(f"{pid} {command_line(pid)!r}" for pid in alive(started)))
    finally:
        launcher.kill()
        launcher.wait()
        kill_alive(started)


PYTEST_LIKE_OWNER = textwrap.dedent("""
    import sys, time
    from tests.unit.runtime import helpers
    find_postmaster = helpers.postmaster_pid

    def postmaster_pid(data):  # the fixture's own look-up, also told to the test
        pid = find_postmaster(data)
        print(pid, flush=True)
        return pid

    helpers.postmaster_pid = postmaster_pid
    with helpers.postgres_cluster() as url:
        time.sleep(300)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_test_process_leaves_no_postgres_cluster(sig: signal.Signals, tmp_path: Path) -> None:
    """The runtime tests' throwaway PostgreSQL (tests/unit/runtime/helpers.py) runs in a session of
    its own (pg_ctl): its owner, killed, must not leave it running (tests/proc_tree.py's
    ``reap_with_this_process``). Before, the cluster stayed."""
    from tests.unit.runtime.helpers import _pg_bin

    if _pg_bin() is None:
        pytest.skip("PostgreSQL not available (apt-get install postgresql)")
    owner = subprocess.Popen([sys.executable, "-c", PYTEST_LIKE_OWNER], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    started: dict[int, int] = {}
    cluster_dir: Path | None = None
    try:
        assert owner.stdout is not None and owner.stderr is not None
        line = owner.stdout.readline()
        if not line.strip().isdigit():
            owner.wait()
            pytest.skip(f"the cluster did not start: {owner.stderr.read().decode()[-300:]}")
        postmaster = int(line)
        cluster_dir = Path(os.readlink(f"/proc/{postmaster}/cwd")).parent  # its data directory's parent
        time.sleep(1.0)  # the watchdog has read the owner's start time; backends started
        started = {**identities([postmaster]), **descendants(postmaster), **descendants(owner.pid)}
        assert postmaster in started and len(started) >= 3, "postmaster, its workers, the watchdog"
        assert_ends_with_owner(owner, started, sig, BOUND_S)
    finally:
        kill_leftovers(owner, started)
        if cluster_dir is not None and cluster_dir.name.startswith("mars-pg-"):  # the owner died
            shutil.rmtree(cluster_dir, ignore_errors=True)  # before its fixture could remove it


FAKE_ENGINE_OWNER = textwrap.dedent("""
    import time
    from mars_openhands.control.fake_engine import FakeEngineProcess
    with FakeEngineProcess() as engine:
        print(engine.proc.pid, flush=True)
        time.sleep(300)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_owner_leaves_no_fake_engine(sig: signal.Signals) -> None:
    """The gateway tests' and bench_gateway's fake vLLM server (``FakeEngineProcess``, in its
    owner's process group: a signal to the group reaches it, one to the owner alone did not)
    exits once its owner is gone (``--exit-with-parent``). Before, it kept serving."""
    pytest.importorskip("fastapi")
    owner = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE_OWNER], stdout=subprocess.PIPE,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    started: dict[int, int] = {}
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.strip().isdigit(), f"the fake engine did not start (exit {owner.wait()})"
        started = descendants(owner.pid)
        assert int(line) in started
        assert_ends_with_owner(owner, started, sig, BOUND_S)
    finally:
        kill_leftovers(owner, started)


SIGTERM_TWICE = textwrap.dedent("""
    import os, signal, time
    from mars_openhands.cli_signals import Terminated, sigterm_exits
    before = signal.getsignal(signal.SIGTERM)
    try:
        with sigterm_exits():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
            finally:  # the teardown: a second SIGTERM must not cut it short
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)
                print("teardown finished", flush=True)
    except Terminated as e:
        print("terminated", e.code, signal.getsignal(signal.SIGTERM) is before, flush=True)
""")


def test_sigterm_exits_once_lets_the_teardown_finish_and_restores_the_handler() -> None:
    done = subprocess.run([sys.executable, "-c", SIGTERM_TWICE], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert done.stdout.splitlines() == ["teardown finished", f"terminated {EXIT_TERMINATED} True"], (
        done.returncode, done.stderr[-2000:])


def test_every_subcommand_but_tasks_unwinds_on_sigterm() -> None:
    """``tasks`` keeps SIGTERM a crash (its runner is resumed like a crashed one); the others run
    inside ``sigterm_exits`` (eval/cli.py)."""
    from eval.cli import build_parser

    parser = build_parser()
    for argv, is_crash in ((["compare"], False), (["serve"], False),
                           (["tasks", "submit", "t.json"], True), (["tasks", "resume"], True)):
        args, _ = parser.parse_known_args(argv)
        if getattr(args, "accepts_any_args", False):
            continue  # unavailable in this environment
        assert getattr(args, "sigterm_is_crash", False) is is_crash, argv
