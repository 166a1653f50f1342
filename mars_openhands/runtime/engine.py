"""The runner: DBOS set-up, the task workflow, and submit / start / attach / resume / wait.

One :class:`Runtime` per process (DBOS itself is a process singleton). Its DBOS executor id is
unique to the process (``mars-<host>-<pid>-<random>``), so launching a runner never recovers a task
another live runner holds: a task is resumed only by ``tasks resume`` (or a resubmission) once its
runner is dead: same host → its pid is gone (start time checked against pid reuse); another host →
its heartbeat is older than ``RuntimeConfig.stale_after_s``. DBOS then re-enqueues the workflow
and exactly one runner dequeues it.

The workflow (``mars_task``, id = task id) claims the task, runs the task's driver (``chat`` here,
``openhands`` from ``openhands/durable.py``) over a :class:`~mars_openhands.runtime.run.TaskRun`,
runs the acceptance command, undoes compensable writes if the task was ended early, and records
the final status with its reason.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from dbos import DBOS, SetWorkflowID

from mars_openhands.process_tree import is_process_alive, process_start_ticks
from mars_openhands.runtime.agent import run_chat_agent
from mars_openhands.runtime.config import RuntimeConfig
from mars_openhands.runtime.run import AgentOutcome, TaskEndedError, TaskRun
from mars_openhands.runtime.store import TERMINAL_STATUSES, Store
from mars_openhands.runtime.task import TaskSpec

__all__ = ["DRIVER_ENTRY_POINTS", "DRIVER_HINTS", "AgentOutcome", "DriverUnavailableError", "Runtime",
           "driver_kinds", "is_runner_alive", "load_driver"]

APP_VERSION = "mars-runtime-1"
"""DBOS application version of the task workflow. Bump it only when the order of a workflow's
steps changes, so a runner never replays an old log with new code."""

DRIVER_ENTRY_POINTS = "mars_openhands.task_drivers"
"""Entry-point group of the task drivers the runtime does not own: kind -> ``module:function``,
declared in ``pyproject.toml`` by the layer that owns the driver (``openhands``:
``openhands/durable.py``), so the runtime never names a higher layer's module. ``chat`` is the
runtime's own (:mod:`mars_openhands.runtime.agent`)."""

DRIVER_HINTS: dict[str, str] = {
    "openhands": "OpenHands tasks run in the OpenHands env (Python >= 3.12): use "
                 ".venv-openhands/bin/mars-openhands tasks ...",
}
"""Task kind -> where its driver runs, said when it cannot be loaded here."""

_ACTIVE: list[Runtime] = []  # this process's open runtime (at most one, like DBOS's instance)


class DriverUnavailableError(RuntimeError):
    """The task's driver cannot be imported in this environment."""


def driver_kinds() -> list[str]:
    """Task kinds with a driver installed here (``chat`` and the entry points). Pure."""
    return sorted({"chat", *_driver_entry_points()})


def _driver_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=DRIVER_ENTRY_POINTS)}


def load_driver(kind: str) -> Callable[[TaskRun], AgentOutcome]:
    """The driver function of task kind ``kind``.

    Raises:
        DriverUnavailableError: unknown kind, or its driver cannot be loaded here (says where it
            runs).
    """
    if kind == "chat":
        return run_chat_agent
    hint = DRIVER_HINTS.get(kind, "")
    entry = _driver_entry_points().get(kind)
    if entry is None:
        if hint:
            raise DriverUnavailableError(
                f"task kind {kind!r} has no driver installed here (no {DRIVER_ENTRY_POINTS!r} "
                f"entry point: reinstall the package with scripts/setup.sh). {hint}")
        raise DriverUnavailableError(f"unknown task kind {kind!r}; supported: {driver_kinds()}")
    try:
        return entry.load()
    except ImportError as e:
        raise DriverUnavailableError(f"task kind {kind!r} cannot run in this environment "
                                     f"({e.name or e} is missing). {hint}".strip()) from None


def is_runner_alive(row: dict[str, Any], stale_after_s: float) -> bool:
    """Whether the runner recorded on task ``row`` is still running. Reads ``/proc`` on this host:
    the recorded pid must still be the process that started at the recorded start time (a reused
    pid is another process; a SIGKILLed runner its parent has not reaped yet is a zombie, gone).
    A runner on another host counts as alive while its heartbeat is younger than ``stale_after_s``."""
    if not row.get("runner_id"):
        return False
    if row.get("runner_host") == socket.gethostname():
        return is_process_alive(int(row["runner_pid"]), row.get("runner_start_ticks"))
    return time.time() - float(row.get("heartbeat_at") or 0.0) < stale_after_s


@DBOS.workflow(name="mars_task")
def _task_workflow(task_id: str) -> dict[str, Any]:
    assert _ACTIVE, "the mars_task workflow ran without an open Runtime in this process"
    return _ACTIVE[-1].run_workflow(task_id)


class Runtime:
    """A runner process's view of the tasks database; runs tasks once :meth:`open`.

    Args:
        config: storage and behaviour (default: ``RuntimeConfig()``, i.e. ``$MARS_TASKS_DB``).
    """

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config or RuntimeConfig()
        if self.config.db_url.startswith("sqlite:///"):
            Path(self.config.db_url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.config.db_url)
        pid = os.getpid()
        self.runner = {"id": f"mars-{socket.gethostname()}-{pid}-{uuid.uuid4().hex[:8]}",
                       "host": socket.gethostname(), "pid": pid, "start_ticks": process_start_ticks(pid)}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def open(self) -> Runtime:
        """Launch DBOS in this process (one open Runtime per process) and start the heartbeat.

        Raises:
            RuntimeError: another Runtime is open in this process.
        """
        if _ACTIVE:
            raise RuntimeError("a Runtime is already open in this process; close() it first")
        DBOS(config={"name": "mars-openhands-tasks", "system_database_url": self.config.db_url,
                     "executor_id": self.runner["id"], "application_version": APP_VERSION,
                     "log_level": "WARNING", "notification_listener_polling_interval_sec": 0.2})
        DBOS.launch()
        # SQLAlchemy's engine logs every statement at INFO once a host app (OpenHands' logger set-up)
        # moves loggers at WARNING to INFO; ERROR is left alone.
        logging.getLogger("sqlalchemy").setLevel(logging.ERROR)
        _ACTIVE.append(self)
        self._heartbeat = threading.Thread(target=self._beat, name="mars-heartbeat", daemon=True)
        self._heartbeat.start()
        return self

    def close(self) -> None:
        """Stop the heartbeat and DBOS, release the database. Idempotent."""
        self._stop.set()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
            DBOS.destroy(destroy_registry=False)
        self.store.close()

    def __enter__(self) -> Runtime:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self.store.heartbeat(self.runner["id"])
            except Exception:  # a busy database must not kill the runner; the next beat retries
                continue

    # ---- submitting and starting -------------------------------------------------------------
    def submit(self, spec: TaskSpec) -> tuple[dict[str, Any], bool]:
        """Store ``spec`` (or find the same task); does not start it. Returns ``(row, is_new)``.

        Raises:
            SpecConflictError: the id exists with another spec.
            DriverUnavailableError: the task's kind cannot run in this environment.
        """
        load_driver(spec.agent.kind)  # refuse before anything is stored or started
        if not Path(spec.workspace).is_dir():
            raise ValueError(f"task {spec.task_id}: workspace {spec.workspace} is not a directory")
        return self.store.create_task(spec.task_id, spec.model_dump_json(), spec.digest(),
                                      spec.agent.kind, spec.deadline_s)

    def start(self, task_id: str) -> Literal["started", "resumed", "attached", "finished"]:
        """Run the task here: start its workflow, resume it (runner dead), or attach (runner alive).

        Raises:
            KeyError: unknown task.
            DriverUnavailableError: its kind cannot run in this environment.
        """
        row = self.store.task(task_id)
        if row is None:
            raise KeyError(task_id)
        if row["status"] in TERMINAL_STATUSES:
            return "finished"
        load_driver(row["kind"])
        status = DBOS.get_workflow_status(task_id)
        if status is None:
            with SetWorkflowID(task_id):
                DBOS.start_workflow(_task_workflow, task_id)
            return "started"
        if status.status in ("SUCCESS", "ERROR", "CANCELLED"):
            return "finished"
        if status.status == "ENQUEUED":
            return "resumed"
        if is_runner_alive(row, self.config.stale_after_s) and row["runner_id"] != self.runner["id"]:
            return "attached"
        DBOS.resume_workflow(task_id)
        return "resumed"

    def resumable(self) -> list[str]:
        """Tasks not ended whose runner is dead (or that never started)."""
        return [r["task_id"] for r in self.store.tasks() if r["status"] not in TERMINAL_STATUSES
                and not is_runner_alive(r, self.config.stale_after_s)]

    def wait(self, task_ids: list[str], on_event: Callable[[dict[str, Any]], None] | None = None,
             poll_s: float = 0.2, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait until every task has ended; call ``on_event`` for each new log event. Returns rows.

        Raises:
            TimeoutError: ``timeout_s`` passed first.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last_id = max([e["id"] for t in task_ids for e in self.store.events(t)], default=0)
        while True:
            for event in self.store.events(after_id=last_id):
                last_id = event["id"]
                if on_event is not None and event["task_id"] in task_ids:
                    on_event(event)
            rows = [self.store.task(t) or {} for t in task_ids]
            if all(r.get("status") in TERMINAL_STATUSES for r in rows):
                return rows
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"tasks {task_ids} still running after {timeout_s} s")
            time.sleep(poll_s)

    # ---- the workflow body -------------------------------------------------------------------
    def run_workflow(self, task_id: str) -> dict[str, Any]:
        """Body of the ``mars_task`` workflow (runs again from the top after every restart)."""
        row = self.store.task(task_id)
        assert row is not None, f"workflow {task_id} has no mars_tasks row"
        spec = TaskSpec.model_validate_json(row["spec_json"])
        self.store.claim(task_id, self.runner)
        num_runs = int((self.store.task(task_id) or {}).get("num_runs", 1))
        self.store.add_event(task_id, f"run:{num_runs}", "run_started",
                             {"runner": self.runner, "num_runs": num_runs, "is_recovery": num_runs > 1})
        run = TaskRun(spec, self.store, self.config, row["deadline_at"])
        status, reason = self._drive(run)
        DBOS.run_step({"name": "finish"}, self._finish, run, status, reason)
        return {"task_id": task_id, "status": status, "reason": reason}

    def _drive(self, run: TaskRun) -> tuple[str, str]:
        try:
            outcome = load_driver(run.spec.agent.kind)(run)
        except TaskEndedError as e:
            run.compensate_all(e.reason)
            return e.status, e.reason
        except Exception as e:  # the agent or its driver broke: end the task, keep the log
            reason = f"{type(e).__name__}: {e}"
            run.compensate_all(reason)
            return "error", reason
        if outcome.status == "error":
            run.compensate_all(outcome.message)
            return "error", outcome.message
        accepted = run.accept()
        if accepted.get("command") is None:  # nothing was checked: say so, not "passed"
            return "succeeded", f"agent {outcome.status}; no acceptance command was given (finishing accepts)"
        if accepted["accepted"]:
            return "succeeded", f"agent {outcome.status}; acceptance passed"
        return "failed", f"agent {outcome.status}; acceptance failed (exit {accepted.get('exit_code')})"

    def _finish(self, run: TaskRun, status: str, reason: str) -> None:
        run.record("ended", "task_ended", {"status": status, "reason": reason,
                                           "usage": run.usage.model_dump()})
        self.store.set_status(run.task_id, status, reason)
