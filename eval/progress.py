"""Progress of a long command when its output is not a terminal: one log line per step.

rich's progress bars draw nothing when stderr is a file or a pipe (``compare ... 2>log``, CI, a
``nohup`` run), so such a run was silent for minutes. :class:`LineProgress` takes the bars' place
there: it has the part of ``rich.progress.Progress``'s interface the sweep uses (``add_task``,
``update``, a context manager) and prints a line whenever a task's description changes (each
finished run, each knee probe) or a task completes::

    [02:41] runs: fcfs__load1.2 done (3/8)
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

__all__ = ["LineProgress", "progress_display"]


class LineProgress:
    """Prints ``[mm:ss] <description> (<done>/<total>)`` lines to ``file`` (default stderr).

    Mutates: its tasks; writes to ``file``. Not thread-safe (the sweep reports from one thread).
    """

    def __init__(self, file: IO[str] | None = None, clock: Any = time.monotonic) -> None:
        self._file = file
        self._clock = clock
        self._t0 = clock()
        self._tasks: list[dict[str, Any]] = []

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        """Start a task; returns its id. Prints nothing until it moves."""
        self._tasks.append({"description": description, "total": total, "completed": 0.0})
        return len(self._tasks) - 1

    def update(self, task_id: int, *, advance: float | None = None, description: str | None = None,
               **_: Any) -> None:
        """Advance ``task_id`` and/or rename it; print a line when the name changed or it completed."""
        task = self._tasks[task_id]
        was_done = task["total"] is not None and task["completed"] >= task["total"]
        if advance:
            task["completed"] += advance
        renamed = description is not None and description != task["description"]
        if description is not None:
            task["description"] = description
        is_done = task["total"] is not None and task["completed"] >= task["total"]
        if renamed or (is_done and not was_done):
            self._print(task)

    def _print(self, task: dict[str, Any]) -> None:
        elapsed = int(self._clock() - self._t0)
        total = task["total"]
        count = f" ({int(min(task['completed'], total))}/{int(total)})" if total else ""
        print(f"[{elapsed // 60:02d}:{elapsed % 60:02d}] {task['description']}{count}",
              file=self._file or sys.stderr, flush=True)


def progress_display(console: Any) -> Any:
    """rich bars (description, bar, done/total, elapsed, ETA) on ``console`` when it is a terminal,
    else a :class:`LineProgress` on stderr: the progress a sweep reports to (``plan``, ``compare``)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if not console.is_terminal:
        return LineProgress()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console)
