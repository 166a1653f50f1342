"""Durable agent tasks: the workflow control plane (design.md §11; docs/tasks.md).

A task (``task.py``) runs as a DBOS workflow whose id is the task id (``engine.py``); every LLM call
and tool call is a checkpointed step recorded in an event log (``store.py``), so a runner killed at
any moment resumes from the log. Tool actions are classified into effect classes (``effects.py``),
pass a policy gate (``gate.py``, with the command guard ``guard.py`` as one rule set), may wait for
an approval bound to the action's digest, and carry idempotency keys; irreversible actions get an
intent record first. ``metrics.py`` aggregates per task; ``cli.py`` is ``mars-openhands tasks``.

Imports: ``stream``, ``policy``, the standard library, pydantic and DBOS Transact (with its
SQLAlchemy); never vLLM or OpenHands (the OpenHands driver lives in ``openhands/durable.py``).
Importing this package does nothing; DBOS is imported only by ``engine``, ``store`` and ``cli``.
"""
