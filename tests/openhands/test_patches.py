"""``patches/``: each patch applies to the version it names, is never applied by default, and
does what its note says, tested on a copy of the installed file (this env is never modified)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.load_file import load_file

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

import openhands.sdk.agent.parallel_executor as stock_parallel_executor  # noqa: E402
from openhands.tools.terminal import TerminalAction, TerminalObservation  # noqa: E402

from mars_openhands.openhands import executor as evented  # noqa: E402
from mars_openhands.openhands.executor import EventedExecutor, EventSender  # noqa: E402

pytestmark = pytest.mark.openhands

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"
sys.path.insert(0, str(PATCHES))
import apply as patch_tool  # noqa: E402

SDK_VERSION = metadata.version("openhands-sdk")


def _copies(tmp_path: Path, name: str, relative: str) -> tuple[Path, Path]:
    """``(stock, patched)`` copies of the installed ``relative`` file (the installed one may be
    either: setup patches the app env), made with patch ``name``."""
    spec = patch_tool.PATCHES[name]
    site = Path(stock_parallel_executor.__file__).parents[3]
    patch = PATCHES / spec.files[metadata.version(spec.distribution)]
    copies = []
    for which in ("stock", "patched"):
        target = tmp_path / which / relative
        target.parent.mkdir(parents=True)
        shutil.copy(site / relative, target)
        copies.append(tmp_path / which)
    is_patched = patch_tool._git_apply(copies[0], patch, "--reverse", "--check")
    if is_patched:
        assert patch_tool._git_apply(copies[0], patch, "--reverse"), "does not revert"
    else:
        assert patch_tool._git_apply(copies[1], patch), "does not apply"
    return copies[0] / relative, copies[1] / relative


def _load(path: Path, name: str) -> object:
    return load_file(path, name, register=False)


def test_every_patch_has_a_note_and_the_readme_lists_it() -> None:
    readme = (PATCHES / "README.md").read_text()
    for name, spec in patch_tool.PATCHES.items():
        assert f"`{name}`" in readme, name
        for file in spec.files.values():
            assert (PATCHES / file).exists() and file in readme, file
    # Never applied by default: only the app env's setup target runs the tool, naming one patch.
    callers = [p for p in (ROOT / "Makefile", ROOT / ".ci" / "run", ROOT / "scripts" / "setup.sh")
               if "patches/apply.py" in p.read_text()]
    assert callers == [ROOT / "scripts" / "setup.sh"], callers
    runs = [line for line in callers[0].read_text().splitlines() if "patches/apply.py" in line
            and not line.lstrip().startswith("#")]
    assert len(runs) == 1 and "apply.py --python" in runs[0], runs
    assert runs[0].rstrip(" \\").endswith("openhands-ai-process-sandbox"), runs
    assert not [p for p in ROOT.glob("mars_openhands/**/*.py")
                if "import apply" in p.read_text() or "apply.run(" in p.read_text()]


def test_check_names_the_version_when_it_does_not_fit() -> None:
    ok, message = patch_tool.run("openhands-ai-process-sandbox", sys.executable, "check")
    if "openhands-ai" in {d.metadata["Name"] for d in metadata.distributions()}:
        assert ok, message
    else:
        assert not ok and "openhands-ai is not installed" in message and "1.11.0" in message


def test_the_enqueue_time_patch_makes_queue_wait_include_the_wait_for_the_executor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two terminal calls of one LLM response run one after the other (one worker, the terminal
    lock): the second one's tool_enqueued is stamped when the batch arrived, so its queue_wait_s
    holds the first one's run time. Without the patch it is the policy check alone (~0)."""
    _, path = _copies(tmp_path, "openhands-sdk-tool-enqueue-time",
                      "openhands/sdk/agent/parallel_executor.py")
    patched = _load(path, "mars_patched_parallel_executor")
    monkeypatch.setattr(evented, "_parallel_executor", patched)

    class Slow:
        def __call__(self, action, conversation=None):
            time.sleep(0.2)
            return TerminalObservation.from_text(text="ok", command=action.command, exit_code=0)

    sender = EventSender(None, tmp_path / "events.jsonl")
    wrapped = EventedExecutor(Slow(), "terminal", TerminalObservation, "s", sender, tmp_path, None)
    batch = [SimpleNamespace(action=TerminalAction(command=f"echo {i}"), tool_name="terminal")
             for i in range(2)]
    results = patched.ParallelToolExecutor(max_workers=1).execute_batch(
        batch, lambda event: [wrapped(event.action)])
    assert len(results) == 2 and not patched.TOOL_CALL_ENQUEUED_NS.get(id(object()))
    from mars_openhands.stream.events import parse_event

    starts = [e for e in map(parse_event, (tmp_path / "events.jsonl").read_text().splitlines())
              if e.kind == "tool_start"]
    assert starts[0].queue_wait_s < 0.1 and starts[1].queue_wait_s >= 0.19, starts
    del batch, results
    assert not patched.TOOL_CALL_ENQUEUED_NS  # entries go with their actions


def test_without_the_patch_enqueue_is_when_the_call_reaches_the_executor(tmp_path: Path) -> None:
    assert not hasattr(stock_parallel_executor, "TOOL_CALL_ENQUEUED_NS")  # never applied here
    t0 = time.monotonic_ns()
    stamps = evented._enqueued_stamps(TerminalAction(command="ls"))
    assert stamps["t_mono_ns"] >= t0


@pytest.mark.skipif(importlib.util.find_spec("openhands.app_server") is None,
                    reason="needs the OpenHands app (.venv-openhands-app)")
def test_the_process_sandbox_patch_reports_an_idle_server_running(tmp_path: Path) -> None:
    """An idle agent-server sleeps: the stock 1.11 code calls it STARTING (the app then waits for
    it until its timeout); patched, it is RUNNING and reached at 127.0.0.1."""
    relative = "openhands/app_server/sandbox/process_sandbox_service.py"
    stock_path, path = _copies(tmp_path, "openhands-ai-process-sandbox", relative)
    source = path.read_text()
    assert "f'http://127.0.0.1:{process_info.port}'" in source and "timeout: int = 120" in source
    patched = _load(path, "mars_patched_process_sandbox")
    stock = _load(stock_path, "mars_stock_process_sandbox")
    from openhands.app_server.sandbox.sandbox_models import SandboxStatus

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)  # it sleeps, as an idle server does
        info = patched.ProcessInfo(pid=sleeper.pid, port=9, user_id=None, working_dir=".",
                                   session_api_key="k", created_at=patched.utc_now(),
                                   sandbox_spec_id="s")

        def status(cls) -> SandboxStatus:
            service = cls.__new__(cls)
            return cls._get_process_status(service, info)

        assert status(stock.ProcessSandboxService) == SandboxStatus.STARTING  # the bug, unpatched
        assert status(patched.ProcessSandboxService) == SandboxStatus.RUNNING
        sleeper.send_signal(19)  # SIGSTOP: a paused sandbox stays PAUSED
        time.sleep(0.2)
        assert status(patched.ProcessSandboxService) == SandboxStatus.PAUSED
        sleeper.send_signal(18)
    finally:
        sleeper.kill()
        sleeper.wait()

