"""The runtime's own tables, next to DBOS's in the same database (SQLite file or PostgreSQL).

* ``mars_tasks``: one row per task: spec and digest, status, why it ended, deadline, the runner
  that holds it (host, pid, heartbeat).
* ``mars_task_events``: the event log, append-only; each event has a key unique within its task,
  so a step that DBOS runs twice (at-least-once) records once.
* ``mars_effects``: one row per tool call (its idempotency key): the intent (action, class, probe
  output) written and committed *before* the action runs, the attempt count, the outcome after.
  A row left ``started`` with no outcome is a call in doubt.
* ``mars_approvals``: one row per request for a person's decision (approval of a gated action, or
  an in-doubt irreversible action): the action's digest, the decision and its single use.
* ``mars_session_tokens``: the task's gateway session token (a random secret made at its first
  run), so a task resumed after a crash, by any runner, sends the token the gateway bound its
  session to. Kept apart from ``mars_tasks`` so an older database gains it without a migration,
  and out of the event log so ``tasks show`` never prints it.

Mental model: DBOS's step records make a restarted workflow replay instead of recompute; these
tables make side effects exactly-once (an intent before, an outcome after, checked at entry) and
answer ``tasks list|show|report`` without running anything. All writes are idempotent.
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

__all__ = ["SpecConflictError", "Store", "engine_url", "ensure_sqlite_compat"]

_META = sa.MetaData()
TASKS = sa.Table(
    "mars_tasks", _META,
    sa.Column("task_id", sa.String(128), primary_key=True),
    sa.Column("spec_json", sa.Text, nullable=False),
    sa.Column("spec_digest", sa.String(64), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("end_reason", sa.Text),
    sa.Column("submitted_at", sa.Float, nullable=False),
    sa.Column("deadline_at", sa.Float),
    sa.Column("started_at", sa.Float),
    sa.Column("ended_at", sa.Float),
    sa.Column("runner_id", sa.String(200)),
    sa.Column("runner_host", sa.String(200)),
    sa.Column("runner_pid", sa.Integer),
    sa.Column("runner_start_ticks", sa.BigInteger),
    sa.Column("heartbeat_at", sa.Float),
    sa.Column("num_runs", sa.Integer, nullable=False, default=0),
)
EVENTS = sa.Table(
    "mars_task_events", _META,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("task_id", sa.String(128), nullable=False, index=True),
    sa.Column("event_key", sa.String(300), nullable=False),
    sa.Column("step", sa.Integer),
    sa.Column("kind", sa.String(40), nullable=False),
    sa.Column("payload_json", sa.Text, nullable=False),
    sa.Column("t_wall", sa.Float, nullable=False),
    sa.UniqueConstraint("task_id", "event_key", name="mars_task_events_key"),
)
EFFECTS = sa.Table(
    "mars_effects", _META,
    sa.Column("key", sa.String(300), primary_key=True),
    sa.Column("task_id", sa.String(128), nullable=False, index=True),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("tool", sa.String(64), nullable=False),
    sa.Column("effect", sa.String(32), nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("num_attempts", sa.Integer, nullable=False),
    sa.Column("intent_json", sa.Text, nullable=False),
    sa.Column("outcome_json", sa.Text),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("ended_at", sa.Float),
)
APPROVALS = sa.Table(
    "mars_approvals", _META,
    sa.Column("request_id", sa.String(320), primary_key=True),
    sa.Column("task_id", sa.String(128), nullable=False, index=True),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("action_json", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("decided_at", sa.Float),
    sa.Column("decided_by", sa.String(200)),
    sa.Column("decision_reason", sa.Text),
    sa.Column("consumed_at", sa.Float),
)

SESSION_TOKENS = sa.Table(
    "mars_session_tokens", _META,
    sa.Column("task_id", sa.String(128), primary_key=True),
    sa.Column("token", sa.String(200), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "ended_budget", "ended_deadline",
                               "ended_policy", "error"})


class SpecConflictError(ValueError):
    """A task id that exists with a different spec."""


def engine_url(db_url: str) -> str:
    """The SQLAlchemy URL for our engine: ``postgresql://`` uses psycopg 3 (what DBOS installs)."""
    if db_url.startswith("postgresql://"):
        return "postgresql+psycopg://" + db_url[len("postgresql://"):]
    return db_url


def _unixepoch(*args: Any) -> float | int | None:
    """SQLite's ``unixepoch()`` including the ``'subsec'`` modifier (SQLite >= 3.42)."""
    now = time.time()
    if args in ((), ("now",)):
        return int(now)
    if args == ("subsec",) or args == ("now", "subsec"):
        return int(now * 1000) / 1000.0
    return None  # other forms are not used by DBOS; NULL is SQLite's answer to bad input


def _add_unixepoch(dbapi_connection: Any, _record: Any) -> None:
    if isinstance(dbapi_connection, sqlite3.Connection):
        for num_args in (0, 1, 2):
            dbapi_connection.create_function("unixepoch", num_args, _unixepoch)


def ensure_sqlite_compat() -> None:
    """Make DBOS's SQLite schema work on SQLite < 3.42. Idempotent; mutates SQLAlchemy's global
    engine events when needed.

    DBOS on Python >= 3.12 writes timestamps with ``unixepoch('subsec')``, a modifier SQLite added in
    3.42; older libraries (Debian 12 ships 3.40) return NULL and every insert fails its NOT NULL
    column. Application functions take precedence over SQLite's built-ins, so registering
    ``unixepoch`` on each new connection of every engine (DBOS's included) fixes it.
    """
    if sqlite3.sqlite_version_info >= (3, 42) or sa.event.contains(sa.engine.Engine, "connect", _add_unixepoch):
        return
    sa.event.listen(sa.engine.Engine, "connect", _add_unixepoch)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=30000")  # a runner and a CLI share the file
    cursor.close()


class Store:
    """Read and write the runtime's tables. Thread-safe (one SQLAlchemy engine, short transactions).

    Args:
        db_url: ``sqlite:///...`` or ``postgresql://...`` (see ``config.normalize_db_url``).
        create: create the tables if missing (idempotent).
    """

    def __init__(self, db_url: str, create: bool = True) -> None:
        self.db_url = db_url
        is_sqlite = db_url.startswith("sqlite")
        if is_sqlite:
            ensure_sqlite_compat()
        self.engine = sa.create_engine(engine_url(db_url), pool_pre_ping=not is_sqlite,
                                       connect_args={"timeout": 30} if is_sqlite else {})
        if is_sqlite:
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self._insert = sqlite.insert if is_sqlite else postgresql.insert
        if create:
            _META.create_all(self.engine, checkfirst=True)

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()

    # ---- tasks -------------------------------------------------------------------------------
    def create_task(self, task_id: str, spec_json: str, digest: str, kind: str,
                    deadline_s: float | None) -> tuple[dict[str, Any], bool]:
        """Insert a task, or return the existing one with the same digest.

        Returns:
            ``(row, is_new)``.

        Raises:
            SpecConflictError: ``task_id`` exists with another spec digest.
        """
        now = time.time()
        row = {"task_id": task_id, "spec_json": spec_json, "spec_digest": digest, "kind": kind,
               "status": "submitted", "submitted_at": now, "num_runs": 0,
               "deadline_at": now + deadline_s if deadline_s else None}
        with self.engine.begin() as c:
            # RETURNING, not rowcount: drivers differ on rowcount for ON CONFLICT DO NOTHING.
            inserted = c.execute(self._insert(TASKS).values(**row).on_conflict_do_nothing()
                                 .returning(TASKS.c.task_id)).first() is not None
        existing = self.task(task_id)
        assert existing is not None, f"task {task_id} vanished after insert"
        if existing["spec_digest"] != digest:
            raise SpecConflictError(
                f"task {task_id} already exists with a different spec (digest "
                f"{existing['spec_digest'][:12]} vs {digest[:12]}); task ids are immutable: use a "
                "new task_id, or resubmit the original spec to attach")
        return existing, inserted

    def task(self, task_id: str) -> dict[str, Any] | None:
        """The task's row as a dict, or ``None``."""
        with self.engine.connect() as c:
            row = c.execute(sa.select(TASKS).where(TASKS.c.task_id == task_id)).mappings().first()
        return dict(row) if row else None

    def tasks(self, status: str | None = None) -> list[dict[str, Any]]:
        """All task rows in submission order (optionally of one status)."""
        query = sa.select(TASKS).order_by(TASKS.c.submitted_at)
        if status is not None:
            query = query.where(TASKS.c.status == status)
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(query).mappings()]

    def set_status(self, task_id: str, status: str, end_reason: str | None = None) -> None:
        """Set the task's status; a terminal status also sets ``ended_at`` (first time only)."""
        values: dict[str, Any] = {"status": status}
        if end_reason is not None:
            values["end_reason"] = end_reason
        with self.engine.begin() as c:
            c.execute(sa.update(TASKS).where(TASKS.c.task_id == task_id).values(**values))
            if status in TERMINAL_STATUSES:
                c.execute(sa.update(TASKS).where(TASKS.c.task_id == task_id)
                          .where(TASKS.c.ended_at.is_(None)).values(ended_at=time.time()))

    def claim(self, task_id: str, runner: dict[str, Any]) -> None:
        """Record that ``runner`` (id, host, pid, start ticks) runs the task now; counts a run."""
        now = time.time()
        with self.engine.begin() as c:
            c.execute(sa.update(TASKS).where(TASKS.c.task_id == task_id).values(
                runner_id=runner["id"], runner_host=runner["host"], runner_pid=runner["pid"],
                runner_start_ticks=runner["start_ticks"], heartbeat_at=now,
                num_runs=TASKS.c.num_runs + 1, status="running",
                started_at=sa.func.coalesce(TASKS.c.started_at, now)))

    def heartbeat(self, runner_id: str) -> None:
        """Refresh the heartbeat of every task ``runner_id`` holds."""
        with self.engine.begin() as c:
            c.execute(sa.update(TASKS).where(TASKS.c.runner_id == runner_id)
                      .values(heartbeat_at=time.time()))

    def session_token(self, task_id: str) -> str:
        """The task's gateway session token: made (``secrets.token_urlsafe(32)``) and stored on
        first use, the stored one ever after (concurrent first uses agree: the first insert wins).
        """
        import secrets

        with self.engine.begin() as c:
            c.execute(self._insert(SESSION_TOKENS).values(
                task_id=task_id, token=secrets.token_urlsafe(32), created_at=time.time())
                .on_conflict_do_nothing())
            return str(c.execute(sa.select(SESSION_TOKENS.c.token).where(
                SESSION_TOKENS.c.task_id == task_id)).scalar())

    # ---- event log ---------------------------------------------------------------------------
    def add_event(self, task_id: str, event_key: str, kind: str, payload: dict[str, Any],
                  step: int | None = None) -> bool:
        """Append an event unless one with ``event_key`` exists. Returns whether it was added."""
        row = {"task_id": task_id, "event_key": event_key, "kind": kind, "step": step,
               "payload_json": json.dumps(payload, default=str), "t_wall": time.time()}
        with self.engine.begin() as c:
            return c.execute(self._insert(EVENTS).values(**row).on_conflict_do_nothing()
                             .returning(EVENTS.c.id)).first() is not None

    def event(self, task_id: str, event_key: str) -> dict[str, Any] | None:
        """One event's payload by key, or ``None``."""
        with self.engine.connect() as c:
            text = c.execute(sa.select(EVENTS.c.payload_json).where(
                EVENTS.c.task_id == task_id, EVENTS.c.event_key == event_key)).scalar()
        return json.loads(text) if text is not None else None

    def events(self, task_id: str | None = None, after_id: int = 0) -> list[dict[str, Any]]:
        """Events in log order (all tasks or one), each with ``payload`` decoded."""
        query = sa.select(EVENTS).where(EVENTS.c.id > after_id).order_by(EVENTS.c.id)
        if task_id is not None:
            query = query.where(EVENTS.c.task_id == task_id)
        with self.engine.connect() as c:
            rows = [dict(r) for r in c.execute(query).mappings()]
        for r in rows:
            r["payload"] = json.loads(r.pop("payload_json"))
        return rows

    # ---- effects -----------------------------------------------------------------------------
    def effect(self, key: str) -> dict[str, Any] | None:
        """The effect row of an idempotency key (``intent``/``outcome`` decoded), or ``None``."""
        with self.engine.connect() as c:
            row = c.execute(sa.select(EFFECTS).where(EFFECTS.c.key == key)).mappings().first()
        return _decoded_effect(row) if row else None

    def effects(self, task_id: str) -> list[dict[str, Any]]:
        """A task's effect rows in step order."""
        with self.engine.connect() as c:
            rows = c.execute(sa.select(EFFECTS).where(EFFECTS.c.task_id == task_id)
                             .order_by(EFFECTS.c.step)).mappings().all()
        return [_decoded_effect(r) for r in rows]

    def start_effect(self, key: str, task_id: str, step: int, digest: str, tool: str, effect: str,
                     intent: dict[str, Any]) -> int:
        """Commit the intent (status ``started``) before the action runs; return the attempt number."""
        now = time.time()
        with self.engine.begin() as c:
            c.execute(self._insert(EFFECTS).values(
                key=key, task_id=task_id, step=step, digest=digest, tool=tool, effect=effect,
                status="started", num_attempts=0, intent_json=json.dumps(intent, default=str),
                started_at=now).on_conflict_do_nothing())
            c.execute(sa.update(EFFECTS).where(EFFECTS.c.key == key).values(
                status="started", num_attempts=EFFECTS.c.num_attempts + 1, started_at=now))
            return int(c.execute(sa.select(EFFECTS.c.num_attempts).where(EFFECTS.c.key == key)).scalar())

    def finish_effect(self, key: str, status: str, outcome: dict[str, Any]) -> None:
        """Record the outcome (``done``, ``failed``, ``compensated``, ``not_repeated``)."""
        with self.engine.begin() as c:
            c.execute(sa.update(EFFECTS).where(EFFECTS.c.key == key).values(
                status=status, outcome_json=json.dumps(outcome, default=str), ended_at=time.time()))

    # ---- approvals ---------------------------------------------------------------------------
    def request_approval(self, request_id: str, task_id: str, step: int, digest: str, kind: str,
                         action: dict[str, Any], reason: str) -> dict[str, Any]:
        """Create a pending request (idempotent) and return its row."""
        with self.engine.begin() as c:
            c.execute(self._insert(APPROVALS).values(
                request_id=request_id, task_id=task_id, step=step, digest=digest, kind=kind,
                action_json=json.dumps(action), reason=reason, status="pending",
                created_at=time.time()).on_conflict_do_nothing())
        row = self.approval(request_id)
        assert row is not None, f"approval request {request_id} vanished after insert"
        return row

    def approval(self, request_id: str) -> dict[str, Any] | None:
        """One request row (``action`` decoded), or ``None``."""
        with self.engine.connect() as c:
            row = c.execute(sa.select(APPROVALS).where(APPROVALS.c.request_id == request_id)).mappings().first()
        return _decoded_approval(row) if row else None

    def approvals(self, task_id: str | None = None, status: str | None = None) -> list[dict[str, Any]]:
        """Request rows in creation order, optionally of one task and/or status."""
        query = sa.select(APPROVALS).order_by(APPROVALS.c.created_at)
        if task_id is not None:
            query = query.where(APPROVALS.c.task_id == task_id)
        if status is not None:
            query = query.where(APPROVALS.c.status == status)
        with self.engine.connect() as c:
            return [_decoded_approval(r) for r in c.execute(query).mappings()]

    def decide(self, request_id: str, decision: str, by: str, reason: str) -> bool:
        """Move a ``pending`` request to ``approved`` / ``denied``. Returns False if not pending."""
        assert decision in ("approved", "denied"), decision
        with self.engine.begin() as c:
            return bool(c.execute(sa.update(APPROVALS).where(
                APPROVALS.c.request_id == request_id, APPROVALS.c.status == "pending").values(
                status=decision, decided_at=time.time(), decided_by=by,
                decision_reason=reason)).rowcount)

    def consume(self, request_id: str) -> bool:
        """Use an approval once: ``approved`` → ``consumed``. True if this call (or an earlier call
        for the same request, replayed) consumed it; False if it was never approved."""
        with self.engine.begin() as c:
            changed = c.execute(sa.update(APPROVALS).where(
                APPROVALS.c.request_id == request_id, APPROVALS.c.status == "approved").values(
                status="consumed", consumed_at=time.time())).rowcount
            if changed:
                return True
            status = c.execute(sa.select(APPROVALS.c.status).where(
                APPROVALS.c.request_id == request_id)).scalar()
        return status == "consumed"


def _decoded_effect(row: Any) -> dict[str, Any]:
    out = dict(row)
    out["intent"] = json.loads(out.pop("intent_json"))
    text = out.pop("outcome_json")
    out["outcome"] = json.loads(text) if text else None
    return out


def _decoded_approval(row: Any) -> dict[str, Any]:
    out = dict(row)
    out["action"] = json.loads(out.pop("action_json"))
    return out
