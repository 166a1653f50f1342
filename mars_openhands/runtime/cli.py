"""``mars-openhands tasks submit|list|show|resume|approve|deny|report``: durable agent tasks.

``submit`` and ``resume`` run tasks in this process until they end (Ctrl-C or a crash loses
nothing: ``resume`` continues from the log); the others only read or decide, from any shell, also
while a runner waits. Input errors are one line and exit 2. See docs/tasks.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from mars_openhands.cli_style import EXIT_USAGE, CliParser, cli_error, count_or_zero, redact_url
from mars_openhands.runtime.config import TASK_STATUSES

__all__ = ["add_tasks_subcommand", "format_event", "main", "shown_status"]

if importlib.util.find_spec("dbos") is None:  # the top-level CLI lists `tasks` as unavailable
    raise ImportError("DBOS Transact is not installed here (the 'runtime' extra)", name="dbos")

_DIGEST = re.compile(r"[0-9a-f]{64}")
EXIT_INPUT = EXIT_USAGE


class InputError(ValueError):
    """Bad input: printed as one line, exit 2."""


def _db_url(args: argparse.Namespace) -> tuple[str, str]:
    """The tasks database's URL, and how an error line names it: ``--db VALUE``,
    ``$MARS_TASKS_DB=VALUE`` or ``the default tasks database PATH`` (a password shown as ``***``).

    Raises:
        InputError: an empty value or an unsupported scheme, a URL that does not parse (e.g. a port
            that is not a number), a SQLite URL without a file (``sqlite://``: an in-memory
            database no other process sees) or a SQLite path that is a directory.
    """
    import os

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from mars_openhands.runtime.config import DEFAULT_DB_PATH, ENV_TASKS_DB, normalize_db_url

    before = getattr(args, "db_before", None)  # `tasks --db X list`
    if before is not None and args.db is not None and before != args.db:
        raise InputError(f"--db given twice ({redact_url(before)} before the command, "
                         f"{redact_url(args.db)} after it); give it once")
    flag = args.db if args.db is not None else before
    given = flag if flag is not None else os.environ.get(ENV_TASKS_DB) or None
    shown = redact_url(given) if given is not None else None
    label = (f"--db {shown}" if flag is not None else f"${ENV_TASKS_DB}={shown}" if given is not None
             else f"the default tasks database {DEFAULT_DB_PATH}")
    try:
        url = normalize_db_url(str(DEFAULT_DB_PATH) if given is None else given)
    except ValueError as e:  # empty, or an unsupported scheme: the message names the value and the fix
        raise InputError(f"{label.split(' ')[0]}: {e}") from None
    try:
        parsed = make_url(url)
    except (ValueError, ArgumentError) as e:  # a port that is not a number is int()'s ValueError
        raise InputError(f"{label}: not a database URL ({e}); give a SQLite file path, sqlite:///PATH "
                         "or postgresql://user@host:port/db") from None
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise InputError(f"{label}: no database file (SQLite in memory is seen by no other process); "
                             "give sqlite:///PATH or a file path")
        if Path(parsed.database).is_dir():
            raise InputError(f"{label}: {parsed.database} is a directory; give a database file path, "
                             f"e.g. {Path(parsed.database) / 'tasks.sqlite'}")
    return url, label


def _opened(label: str, open_db: Any) -> Any:
    """``open_db()`` (a :class:`Store` or :class:`Runtime`, which connect at once); a database that
    cannot be reached or opened is an :class:`InputError` naming ``label`` (``--db URL``)."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return open_db()
    except SQLAlchemyError as e:  # psycopg's "connection refused", SQLite's "unable to open"
        cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        fix = ("is the server running and reachable? start it or fix the URL" if "postgresql" in label
               else "check the path and its permissions")
        raise InputError(f"{label}: cannot open the tasks database ({cause}); {fix}") from None
    except OSError as e:  # the SQLite file's directory cannot be made
        where = f": {e.filename}" if e.filename else ""
        raise InputError(f"{label}: cannot create the tasks database ({e.strerror or e}{where}); check "
                         "the path and its permissions") from None


def _store(args: argparse.Namespace) -> Any:
    from mars_openhands.runtime.store import Store

    url, label = _db_url(args)
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists():
        raise InputError(f"{label}: no tasks database at {url[len('sqlite:///'):]} (submit a task "
                         "first, or give --db / MARS_TASKS_DB)")
    return _opened(label, lambda: Store(url))


def _task(store: Any, task_id: str) -> dict[str, Any]:
    row = store.task(task_id)
    if row is None:
        known = [t["task_id"] for t in store.tasks()][-10:]
        raise InputError(f"unknown task {task_id!r} (known: {', '.join(known) or 'none'}; "
                         "see `mars-openhands tasks list`)")
    return row


def format_event(event: dict[str, Any]) -> str:
    """One line for a log event (``[task] step N kind: details``). Pure."""
    p, kind = event["payload"], event["kind"]
    step = f" step {event['step']}" if event.get("step") is not None else ""
    if kind == "llm_call":
        usage = p["response"].get("usage") or {}
        calls = [(c.get("function") or c).get("name", "?")  # OpenAI shape, or OpenHands' MessageToolCall
                 for c in p["response"].get("message", {}).get("tool_calls") or []]
        detail = f"{usage.get('completion_tokens', '?')} tokens → {', '.join(calls) or 'text'}"
    elif kind == "tool_call":
        detail = (f"{p['tool']} [{p['effect']}] {p['status']} in {p.get('duration_s', 0):.2f} s "
                  f"(attempt {p.get('num_attempts')}): {json.dumps(p['arguments'])[:80]}")
    elif kind == "gate":
        detail = f"{p['verdict']} by {p['rule']}: {p['reason'][:100]}"
    elif kind in ("approval_requested", "escalated"):
        detail = f"digest {p['digest']}: {p['reason'][:120]}"
    elif kind == "task_ended":
        detail = f"{p['status']}: {p['reason']}"
    else:
        detail = json.dumps({k: v for k, v in p.items() if k not in ("usage", "runner")})[:140]
    return f"[{event['task_id']}]{step} {kind}: {detail}"


def _print_event(event: dict[str, Any]) -> None:
    print(format_event(event), flush=True)
    if event["kind"] in ("approval_requested", "escalated"):
        verb = "approve (run it)" if event["kind"] == "approval_requested" else "approve (run it again)"
        print(f"    waiting for a person: mars-openhands tasks approve {event['task_id']} "
              f"{event['payload']['digest']}   # {verb}; or tasks deny ...", flush=True)


def _run_tasks(args: argparse.Namespace, task_ids: list[str] | None, specs: list[Any]) -> int:
    """Open a runner, submit ``specs``, start ``task_ids`` (+ the specs'), wait, print a summary."""
    from mars_openhands.runtime.config import RuntimeConfig
    from mars_openhands.runtime.engine import Runtime

    url, label = _db_url(args)
    config = RuntimeConfig(db_url=url)
    with _opened(label, lambda: Runtime(config)) as runtime:
        ids = list(task_ids or [])
        for spec in specs:
            _row, is_new = runtime.submit(spec)
            print(f"[{spec.task_id}] {'submitted' if is_new else 'exists: attaching'} "
                  f"(db {config.db_url})", flush=True)
            ids.append(spec.task_id)
        if task_ids is None and not specs:
            ids = runtime.resumable()
            if not ids:
                print("nothing to resume: every task has ended or its runner is alive")
                return 0
        if getattr(args, "no_wait", False):
            return 0
        for task_id in ids:
            print(f"[{task_id}] {runtime.start(task_id)}", flush=True)
        rows = runtime.wait(ids, on_event=_print_event)
    for row in rows:
        print(json.dumps({"task_id": row["task_id"], "status": row["status"],
                          "reason": row["end_reason"], "num_runs": row["num_runs"]}))
    return 0 if all(r["status"] == "succeeded" for r in rows) else 1


def cmd_submit(args: argparse.Namespace) -> int:
    """``tasks submit FILE``: store the tasks (or attach to existing ones) and run them here."""
    from mars_openhands.runtime.task import load_task_specs

    overrides = {"workspace": args.workspace} if args.workspace else None
    specs = load_task_specs(args.file, overrides)
    return _run_tasks(args, [], specs)


def cmd_resume(args: argparse.Namespace) -> int:
    """``tasks resume [TASK ...]``: continue tasks whose runner died, from their last checkpoint."""
    store = _store(args)  # a missing SQLite file is an error here: there is nothing to resume
    for task_id in args.task_ids:
        _task(store, task_id)
    store.close()
    return _run_tasks(args, args.task_ids or None, [])


def shown_status(row: dict[str, Any], stale_after_s: float) -> str:
    """A task's status as ``tasks list`` shows it: a task not ended whose runner is gone (killed,
    crashed) says so and how to continue it, e.g. ``running (runner gone; tasks resume T)``; one
    stored with ``--no-wait`` says ``submitted (no runner; tasks resume T)``. Reads ``/proc``
    (runner liveness: ``engine.is_runner_alive``)."""
    from mars_openhands.runtime.engine import is_runner_alive
    from mars_openhands.runtime.store import TERMINAL_STATUSES

    status = row["status"]
    if status in TERMINAL_STATUSES or is_runner_alive(row, stale_after_s):
        return status
    gone = "runner gone" if row.get("runner_id") else "no runner"
    return f"{status} ({gone}; tasks resume {row['task_id']})"


def cmd_list(args: argparse.Namespace) -> int:
    """``tasks list``: one line per task."""
    from mars_openhands.runtime.config import RuntimeConfig

    store = _store(args)
    rows = store.tasks(args.status)
    stale_after_s = RuntimeConfig.model_fields["stale_after_s"].default
    statuses = [shown_status(r, stale_after_s) for r in rows]
    width = max([17, *(len(s) for s in statuses)])
    print(f"{'task':24} {'kind':9} {'status':{width}} {'runs':>4}  reason")
    for r, status in zip(rows, statuses, strict=True):
        print(f"{r['task_id']:24} {r['kind']:9} {status:{width}} {r['num_runs']:>4}  {r['end_reason'] or ''}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """``tasks show TASK``: status, pending decisions with their digests, effects, recent events."""
    store = _store(args)
    row = _task(store, args.task_id)
    spec = json.loads(row["spec_json"])
    print(f"task {row['task_id']} ({row['kind']}): {row['status']}"
          + (f" — {row['end_reason']}" if row["end_reason"] else ""))
    print(f"  workspace {spec['workspace']}; runs {row['num_runs']}; runner {row['runner_id'] or '-'}")
    print(f"  budget {json.dumps(spec['budget'])}; deadline "
          f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(row['deadline_at'])) if row['deadline_at'] else 'none'}")
    for a in store.approvals(args.task_id, status="pending"):
        print(f"  WAITING ({a['kind']}) step {a['step']}: {a['reason']}\n    digest {a['digest']}\n"
              f"    action {json.dumps(a['action'])[:300]}\n"
              f"    mars-openhands tasks approve {args.task_id} {a['digest']}  |  tasks deny ...")
    for e in store.effects(args.task_id):
        print(f"  effect step {e['step']:>3} {e['tool']:12} {e['effect']:17} {e['status']:12} "
              f"attempts {e['num_attempts']}  key {e['key']}")
    events = store.events(args.task_id)
    for e in events[-args.events:] if args.events else events:
        print("  " + format_event(e))
    while args.follow and row["status"] not in ("succeeded", "failed", "error") \
            and not row["status"].startswith("ended"):
        time.sleep(0.5)
        for e in store.events(args.task_id, after_id=events[-1]["id"] if events else 0):
            events.append(e)
            print("  " + format_event(e), flush=True)
        row = _task(store, args.task_id)
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    """``tasks approve|deny TASK DIGEST``: decide a pending request bound to the action's digest."""
    from dbos import DBOSClient

    digest = args.digest.strip().lower()
    if not _DIGEST.fullmatch(digest):
        raise InputError(f"bad digest {args.digest!r}: give the 64-hex SHA-256 shown by "
                         f"`mars-openhands tasks show {args.task_id}`")
    store = _store(args)
    _task(store, args.task_id)
    requests = [a for a in store.approvals(args.task_id) if a["digest"] == digest]
    pending = [a for a in requests if a["status"] == "pending"]
    if not pending:
        seen = f" (its requests are already {', '.join(sorted({a['status'] for a in requests}))})" if requests else ""
        raise InputError(f"no action with digest {digest[:12]}… waits for a decision in task "
                         f"{args.task_id}{seen}; see `mars-openhands tasks show {args.task_id}`")
    request = pending[0]
    decision = "approved" if args.decision == "approve" else "denied"
    if not store.decide(request["request_id"], decision, args.by, args.reason or ""):
        raise InputError(f"request {request['request_id']} was decided meanwhile; see tasks show")
    client = DBOSClient(system_database_url=store.db_url)
    try:
        client.send(args.task_id, {"request_id": request["request_id"], "digest": digest,
                                   "decision": decision}, topic=f"decision:{request['request_id']}")
    finally:
        client.destroy()
    print(f"[{args.task_id}] {decision} step {request['step']} ({request['kind']}) digest {digest[:12]}…")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``tasks report``: task metrics as a table; with ``--out DIR`` also Parquet, JSON and a plot."""
    from mars_openhands.runtime import metrics
    from mars_openhands.runtime.report import print_report, write_report

    store = _store(args)
    for task_id in args.task_ids:
        _task(store, task_id)
    rows = metrics.task_rows(store, args.task_ids or None)
    summary = metrics.summarize(rows)
    print_report(rows, summary)
    if args.out is not None:
        for path in write_report(rows, summary, args.out):
            print(f"wrote {path}")
    return 0


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=None, metavar="URL|PATH",
                        help="tasks database: a SQLite file path, sqlite:///PATH or "
                        "postgresql://user@host:port/db (default $MARS_TASKS_DB, else "
                        "runs/tasks/tasks.sqlite under the cwd)")


def add_tasks_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``tasks`` and its sub-commands on the top-level CLI's subparsers."""
    parser = subparsers.add_parser(
        "tasks", help="durable agent tasks: submit, watch, approve, resume, report",
        description="Durable agent tasks (docs/tasks.md). Runs in the env that has DBOS: .venv "
                    "(chat tasks) or .venv-openhands (chat and OpenHands tasks).")
    # Also before the command (`tasks --db X list`), under its own name: a sub-command's default
    # would overwrite the value otherwise.
    parser.add_argument("--db", dest="db_before", default=None, metavar="URL|PATH",
                        help="tasks database (also accepted after the command; see its --help)")
    sub = parser.add_subparsers(dest="tasks_command", metavar="<tasks-command>")
    commands = (
        ("submit", cmd_submit, "store tasks from FILE (JSON / JSON lines) and run them here"),
        ("resume", cmd_resume, "continue tasks whose runner died (default: all such tasks)"),
        ("list", cmd_list, "one line per task"),
        ("show", cmd_show, "a task's status, pending decisions (digests), effects and events"),
        ("approve", cmd_decide, "approve the pending action with DIGEST (single use)"),
        ("deny", cmd_decide, "deny the pending action with DIGEST"),
        ("report", cmd_report, "task metrics: table; --out DIR adds Parquet, JSON and a plot"),
    )
    for name, func, text in commands:
        p = sub.add_parser(name, help=text, description=text)
        _add_common(p)
        # SIGTERM stays a crash (no unwinding, see mars_openhands/cli_signals.py): a killed runner
        # is resumed like a crashed one, and unwinding the main thread under a running workflow
        # thread tore DBOS down beneath it, which then tried to compensate.
        p.set_defaults(func=_guarded(func), decision=name, sigterm_is_crash=True)
        if name == "submit":
            p.add_argument("file", type=Path, help="task file (see docs/tasks.md)")
            p.add_argument("--workspace", default=None, help="set every task's workspace")
            p.add_argument("--no-wait", action="store_true", help="only store the tasks "
                           "(run them later with `tasks resume`)")
        elif name in ("resume", "report"):
            p.add_argument("task_ids", nargs="*", metavar="TASK")
            if name == "report":
                p.add_argument("--out", type=Path, default=None, help="directory for tasks.parquet, "
                               "summary.json and task_times.png")
        elif name == "list":
            p.add_argument("--status", default=None, choices=TASK_STATUSES, metavar="STATUS",
                           help=f"only tasks with this status: {', '.join(TASK_STATUSES)} (default: all)")
        elif name == "show":
            p.add_argument("task_id", metavar="TASK")
            p.add_argument("--events", type=count_or_zero, default=20, metavar="N",
                           help="print the last N events (0: all; default: %(default)s)")
            p.add_argument("--follow", action="store_true", help="keep printing until the task ends")
        else:
            p.add_argument("task_id", metavar="TASK")
            p.add_argument("digest", metavar="DIGEST")
            p.add_argument("--reason", default="", help="why (kept in the log, told to the agent)")
            p.add_argument("--by", default=_whoami(), help="who decides (default: $USER)")
    parser.set_defaults(func=lambda a: parser.print_help() or EXIT_INPUT)
    return parser


def _whoami() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in a container
        return "unknown"


def _guarded(func: Any) -> Any:
    """Wrap a command: input errors become one line on stderr and exit 2."""
    def run(args: argparse.Namespace) -> int:
        from mars_openhands.runtime.engine import DriverUnavailableError
        from mars_openhands.runtime.store import SpecConflictError

        try:
            return func(args)
        except (InputError, SpecConflictError, DriverUnavailableError, ValueError) as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            return cli_error(f"mars-openhands tasks {args.tasks_command}", message)
        except KeyboardInterrupt:
            print(f"mars-openhands tasks {args.tasks_command}: interrupted; nothing is lost, "
                  "continue with `mars-openhands tasks resume`", file=sys.stderr)
            return 130
    return run


def main(argv: list[str] | None = None) -> int:
    """``python -m mars_openhands.runtime.cli <tasks-command> ...``."""
    parser = CliParser(prog="mars-openhands")
    add_tasks_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tasks", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
