"""Step boundaries, and the test hook that SIGKILLs the runner at them (crash-matrix tests).

Every LLM call and tool call passes three boundaries, named ``<phase>:<kind>:<step>[:<class>]``:

* ``before``: the step started, nothing done yet (no intent recorded);
* ``executed``: the action ran (the model answered, the command finished), its outcome is not
  recorded yet: the window in which a crash leaves a call in doubt;
* ``after``: the outcome is recorded and DBOS checkpointed the step.

``kind`` is ``llm`` or ``tool``; tool boundaries end with the effect class (``before:tool:3:irreversible``).
With ``MARS_RUNTIME_CRASH_AT`` set to comma-separated ``fnmatch`` patterns, the process kills itself
(SIGKILL, no cleanup) at the first matching boundary not yet listed in ``MARS_RUNTIME_CRASH_LOG``,
after appending it there, so each boundary fires once across restarts. Unset: a no-op.
"""

from __future__ import annotations

import fnmatch
import os
import signal
from pathlib import Path

from mars_openhands.runtime.config import ENV_CRASH_AT, ENV_CRASH_LOG

__all__ = ["boundary"]


def boundary(name: str) -> None:
    """Mark boundary ``name``; SIGKILL this process if the crash hook selects it (see module doc).

    Raises:
        ValueError: ``MARS_RUNTIME_CRASH_AT`` is set without ``MARS_RUNTIME_CRASH_LOG``.
    """
    patterns = os.environ.get(ENV_CRASH_AT)
    if not patterns or not any(fnmatch.fnmatchcase(name, p) for p in patterns.split(",")):
        return
    log = os.environ.get(ENV_CRASH_LOG)
    if not log:
        raise ValueError(f"{ENV_CRASH_AT} needs {ENV_CRASH_LOG}=FILE (where fired boundaries are kept)")
    path = Path(log)
    if name in (path.read_text().split() if path.exists() else []):
        return
    with path.open("a") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
