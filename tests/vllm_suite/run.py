"""Run vLLM's own scheduler tests against every scheduler class we ship (``make vllm-suite``).

The tests come from the pinned vLLM's sdist (``scripts/fetch_vllm_tests.py``, run by
``scripts/setup.sh``; nothing is downloaded here). Each class runs in its own pytest process
(``plugin.py`` swaps it in), two at a time by default; stock ``AsyncScheduler`` runs too, as the
reference. Every failure must be listed in ``expected_failures.toml`` under its class with the
policy difference that makes the test's expectation not apply; the run fails on

* a failure that is not listed (a regression, or a new difference to review),
* a listed test that passed (the list must stay true: remove the entry),
* a listed test that did not run (renamed or gone).

A class of ours is expected to fail what stock ``AsyncScheduler`` fails (listed once, under
``[classes.AsyncScheduler]``: the synchronous-Scheduler expectations) plus its own entries.

Tests under ``[deselect]`` are not run unless ``--full`` (CI time; each entry says why). Tests
under ``[not_constructed]`` build the scheduler with ``object.__new__`` (no ``__init__``) and mock
only the attributes vLLM's method reads: they test a vLLM method on a mock, not a scheduler, and
are expected to fail for every class of ours (stock ``AsyncScheduler`` must pass them).

Usage::

    .venv/bin/python tests/vllm_suite/run.py                 # every class, 2 at a time
    .venv/bin/python tests/vllm_suite/run.py -c FcfsScheduler -c MarsScheduler --jobs 1
    .venv/bin/python tests/vllm_suite/run.py --full          # also the [deselect]ed tests

Exit status: 0 when every class matched its list, 1 otherwise (or when the tests are missing:
one line says to run setup), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EXPECTED_PATH = HERE / "expected_failures.toml"
TEST_DIR = "tests/v1/core"
TEST_FILES = (
    "test_scheduler.py", "test_async_scheduler.py", "test_priority_preemption_bug.py",
    "test_priority_scheduler_random.py", "test_deferred_block_free.py",
    "test_worker_slot_overflow.py", "test_swa_inflight_window_free.py", "test_prefix_replay.py",
)
CLASSES: dict[str, str] = {
    "AsyncScheduler": "vllm:AsyncScheduler",
    "FcfsScheduler": "mars_openhands.engine.schedulers.fcfs:FcfsScheduler",
    "InferceptScheduler": "mars_openhands.engine.schedulers.infercept:InferceptScheduler",
    "MarsScheduler": "mars_openhands.engine.schedulers.mars:MarsScheduler",
    "MarsPreviewScheduler": "mars_openhands.engine.schedulers.mars_preview:MarsPreviewScheduler",
    "AutellixScheduler": "mars_openhands.engine.schedulers.autellix:AutellixScheduler",
    "ContinuumScheduler": "mars_openhands.engine.schedulers.continuum:ContinuumScheduler",
    "ThunderAgentScheduler": "mars_openhands.engine.schedulers.thunderagent:ThunderAgentScheduler",
}
"""Name in ``expected_failures.toml`` -> ``--mars-scheduler-cls``; stock first (the reference)."""
STRICT_CLASSES = ("FcfsScheduler", "InferceptScheduler")
"""Classes whose scheduling is stock vLLM's: they may fail only what stock ``AsyncScheduler``
fails (checked on the list by tests/unit/test_vllm_suite_expectations.py)."""


@dataclass(frozen=True)
class Expectations:
    """The parsed ``expected_failures.toml``: per class ``{test id: reason}``, and the tests
    left out of a default run ``{test id: reason}``. Test ids are relative to tests/v1/core."""

    failures: dict[str, dict[str, str]]
    deselect: dict[str, str]
    not_constructed: dict[str, str] = field(default_factory=dict)

    def listed(self, name: str) -> dict[str, str]:
        """Class ``name``'s expected failures: its own; for a class of ours also stock
        ``AsyncScheduler``'s (every class here is one, so the synchronous-Scheduler expectations
        fail for all) and ``not_constructed``. Pure."""
        own = self.failures.get(name, {})
        if name == "AsyncScheduler":
            return own
        return {**self.failures.get("AsyncScheduler", {}), **self.not_constructed, **own}


def load_expectations(path: Path = EXPECTED_PATH) -> Expectations:
    """Parse and validate the expectations file. Pure but for the read.

    Raises:
        ValueError: an unknown class or key, or an empty reason (naming it and the file).
    """
    data = tomllib.loads(path.read_text())
    unknown = set(data) - {"deselect", "not_constructed", "classes"}
    if unknown:
        raise ValueError(f"{path}: unknown tables {sorted(unknown)}; expected [deselect], "
                         "[not_constructed] and [classes.<name>]")
    failures = data.get("classes", {})
    for name, entries in failures.items():
        if name not in CLASSES:
            raise ValueError(f"{path}: unknown class [classes.{name}]; known: {sorted(CLASSES)}")
        for test_id, reason in entries.items():
            if not isinstance(reason, str) or not reason.strip():
                raise ValueError(f"{path}: [classes.{name}] {test_id!r} needs a reason")
    tables = {t: data.get(t, {}) for t in ("deselect", "not_constructed")}
    for table, entries in tables.items():
        for test_id, reason in entries.items():
            if not isinstance(reason, str) or not reason.strip():
                raise ValueError(f"{path}: [{table}] {test_id!r} needs a reason")
    return Expectations({n: dict(failures.get(n, {})) for n in CLASSES},
                        dict(tables["deselect"]), dict(tables["not_constructed"]))


@dataclass
class Verdict:
    """One class's outcomes against its list."""

    name: str
    num_passed: int = 0
    num_failed: int = 0
    unexpected: list[str] = field(default_factory=list)
    """Failed, not listed."""
    now_passing: list[str] = field(default_factory=list)
    """Listed, passed."""
    not_run: list[str] = field(default_factory=list)
    """Listed, neither passed nor failed (renamed, gone or deselected)."""
    wall_s: float = 0.0
    error: str | None = None
    """The run itself failed (no outcomes): the reason."""

    @property
    def ok(self) -> bool:
        return self.error is None and not (self.unexpected or self.now_passing or self.not_run)


def judge(name: str, outcomes: dict[str, str], listed: dict[str, str]) -> Verdict:
    """Compare one class's outcomes (``{test id: "passed"|"failed"|"skipped"}``) with its list.
    Pure."""
    verdict = Verdict(name)
    for test_id, outcome in sorted(outcomes.items()):
        if outcome == "failed":
            verdict.num_failed += 1
            if test_id not in listed:
                verdict.unexpected.append(test_id)
        elif outcome == "passed":
            verdict.num_passed += 1
            if test_id in listed:
                verdict.now_passing.append(test_id)
    verdict.not_run = sorted(t for t in listed if outcomes.get(t) not in ("passed", "failed"))
    return verdict


def test_dir(dest: Path) -> Path:
    return dest / TEST_DIR


def _run_class(name: str, dest: Path, deselect: list[str], log_dir: Path) -> tuple[dict[str, str], float, str | None]:
    """Run the suite against one class; returns (outcomes by test id, wall seconds, error)."""
    outcomes_path = log_dir / f"{name}.json"
    log_path = log_dir / f"{name}.log"
    outcomes_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-c", str(HERE / "pytest.ini"), "--rootdir", str(dest),
           "-p", "plugin", "--mars-scheduler-cls", CLASSES[name], "--mars-outcomes",
           str(outcomes_path), "-q", "-rN", "--tb=short", "--durations=10",
           *[f"{TEST_DIR}/{f}" for f in TEST_FILES],
           *[arg for t in deselect for arg in ("--deselect", f"{TEST_DIR}/{t}")]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MARS_VLLM_SUITE_ENV", None)
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, check=False)
    wall_s = time.monotonic() - start
    if not outcomes_path.is_file() or proc.returncode not in (0, 1):
        return {}, wall_s, f"pytest exited {proc.returncode} without outcomes; see {log_path}"
    prefix = f"{TEST_DIR}/"
    raw = json.loads(outcomes_path.read_text())
    return {k.removeprefix(prefix): v for k, v in raw.items()}, wall_s, None


def _report(verdict: Verdict, listed: dict[str, str]) -> list[str]:
    lines = [f"{verdict.name:22s} {verdict.num_passed:4d} passed {verdict.num_failed:4d} failed "
             f"({len(listed)} listed) {verdict.wall_s:6.0f} s  "
             + ("ok" if verdict.ok else "MISMATCH")]
    if verdict.error:
        lines.append(f"  error: {verdict.error}")
    lines += [f"  failed, not listed: {t}" for t in verdict.unexpected]
    lines += [f"  listed, now passes (remove it): {t}" for t in verdict.now_passing]
    lines += [f"  listed, did not run: {t}" for t in verdict.not_run]
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    from fetch_vllm_tests import DEFAULT_DEST, is_extracted

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--cls", action="append", choices=sorted(CLASSES),
                        help="run only this class (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--full", action="store_true", help="also run the [deselect]ed tests")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args(argv)
    if not is_extracted(args.dest):
        print(f"vllm-suite: vLLM's scheduler tests are missing from {args.dest}: run "
              "`bash scripts/setup.sh engine` (or `.venv/bin/python scripts/fetch_vllm_tests.py`)",
              file=sys.stderr)
        return 1
    expected = load_expectations()
    deselect = [] if args.full else sorted(expected.deselect)
    names = args.cls or list(CLASSES)
    log_dir = args.dest.parent / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = dict(zip(names, pool.map(lambda n: _run_class(n, args.dest, deselect, log_dir), names),
                        strict=True))
    verdicts = []
    for name in names:
        outcomes, wall_s, error = runs[name]
        listed = {t: r for t, r in expected.listed(name).items() if t not in deselect}
        verdict = judge(name, outcomes, listed)
        verdict.wall_s, verdict.error = wall_s, error
        verdicts.append(verdict)
        print("\n".join(_report(verdict, listed)))
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    num_bad = sum(not v.ok for v in verdicts)
    print(f"vllm-suite: {len(verdicts) - num_bad} classes matched their lists, {num_bad} did not "
          f"({time.monotonic() - start:.0f} s wall, {cpu_s:.0f} CPU s; {len(deselect)} tests "
          f"deselected; logs in {log_dir})")
    return 1 if num_bad else 0


if __name__ == "__main__":
    sys.exit(main())
