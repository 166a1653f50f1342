"""Result blocks: the docs' measured figures, written by the tool from a recorded run, never by hand.

A *record* is the small summary of one ``compare`` results directory that the docs cite, committed
as ``docs/results/<name>.json``: the run's commit, date and command (``run.json``), the SHA-256 of
its ``results.parquet``, its base rates and walls, and one row per run with the metrics the blocks
show, plus the SHA-256 of those rows. A *block* is the Markdown between ``<!-- <block>:begin -->``
and ``<!-- <block>:end -->`` in README.md or docs/*.md; :data:`BLOCKS` says which record and which
renderer make it. :func:`render` is pure, so a test re-renders every block from its record and
compares (tests/unit/eval/test_result_blocks.py): a figure edited by hand, in a block or in its
record's rows, fails it, and so does a block without a record.

Writing (the tool that measured them)::

    mars-openhands compare --quick --out runs/quick --readme-block quick     # run, record, rewrite
    python -m eval.result_blocks record runs/quick --block quick              # record an existing run
    python -m eval.result_blocks render                                       # re-render every block
    python -m eval.result_blocks check                                        # exit 1 if one is stale
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from eval.policies import reference_tag
from eval.provenance import REPO_ROOT
from eval.report import (
    METRICS,
    best_baselines,
    goodput_column,
    headroom_table,
    paper_comparison,
    ttft_share_column,
)
from eval.report import format_figure as _fmt
from mars_openhands.cli_style import CliParser, cli_error

__all__ = ["BLOCKS", "RECORD_DIR", "BlockError", "find_blocks", "publish_record", "record_run", "recorded_command",
           "render", "rendered_docs", "replace_files", "rows_digest", "save_record", "write_blocks"]

RECORD_DIR = Path("docs/results")
"""Where the records live, relative to the repository root."""

_ROW_COLUMNS = ("run_id", "gpu", "label", "policy", "is_admission_enabled", "is_baseline", "is_reference",
                "load_x", "rate_per_s", "status", "wall_s", "num_sessions", "num_completed",
                *(m.column for m in METRICS))
"""The results-table columns a record keeps per run."""

_MARKER = re.compile(r"<!-- (?P<name>[a-z0-9-]+):begin -->\n(?P<body>.*?)<!-- (?P=name):end -->", re.S)


class BlockError(ValueError):
    """A results directory that cannot be recorded, or a block without its record; the message
    names the file and the fix."""


# -- records ----------------------------------------------------------------------------------------

def rows_digest(rows: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 of ``rows`` as canonical JSON (sorted keys, no spaces). Pure."""
    text = json.dumps(list(rows), sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _clean(value: Any) -> Any:
    """A results-table cell as plain JSON (numpy scalars to Python, NaN kept as NaN)."""
    if hasattr(value, "item"):
        value = value.item()
    return value


def record_run(results_dir: str | Path, name: str) -> dict[str, Any]:
    """The record of the ``compare`` results in ``results_dir``, for the blocks of record ``name``.

    Raises:
        BlockError: ``results.parquet`` or ``run.json`` missing, no commit in it (a run before
            compare recorded one), a run at a checkout with uncommitted changes (``+dirty``: the
            block would name code that exists nowhere), an interrupted sweep, or a failed run.
    """
    results_dir = Path(results_dir)
    parquet, facts_path = results_dir / "results.parquet", results_dir / "run.json"
    for path in (parquet, facts_path):
        if not path.is_file():
            raise BlockError(f"{path}: missing; give the --out folder of a finished `mars-openhands compare`")
    facts = json.loads(facts_path.read_text(encoding="utf-8"))["facts"]
    commit = str(facts.get("commit", ""))
    if not commit or commit.startswith("unknown"):
        raise BlockError(f"{facts_path}: no commit recorded; rerun compare from a git checkout")
    if facts.get("interrupted"):
        raise BlockError(f"{facts_path}: the run was interrupted ({facts['interrupted']}); a block shows "
                         "complete runs only: run the command to its end")
    if commit.endswith("+dirty"):
        raise BlockError(f"{facts_path}: the run was made at {commit} (uncommitted changes); commit them "
                         "and run again so that the block names code that exists")
    table = pd.read_parquet(parquet)
    failed = table.loc[table["status"] != "ok", "run_id"].tolist()
    if failed:
        raise BlockError(f"{parquet}: runs failed ({', '.join(failed)}); a block shows complete jobs only")
    rows = [{c: _clean(r[c]) for c in _ROW_COLUMNS if c in table.columns} for _, r in table.iterrows()]
    keep = {k: v for k, v in facts.items() if k.startswith(("base rate", "wall", "sessions", "turns", "seed",
                                                            "KV blocks", "scope", "admission", "jobs"))}
    return {"name": name, "commit": commit, "date": facts.get("date"), "command": facts.get("command"),
            "results_sha256": hashlib.sha256(parquet.read_bytes()).hexdigest(), "facts": keep,
            "rows": rows, "rows_sha256": rows_digest(rows)}


def load_record(path: Path) -> dict[str, Any]:
    """Read a record; raises BlockError when its rows do not match their digest (edited by hand)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if rows_digest(data["rows"]) != data["rows_sha256"]:
        raise BlockError(f"{path}: its rows do not match rows_sha256 (edited by hand?); record the run "
                         "again with `python -m eval.result_blocks record`")
    return data


# -- rendering --------------------------------------------------------------------------------------

def _frame(record: Mapping[str, Any]) -> pd.DataFrame:
    return pd.DataFrame(record["rows"])


def _label(label: str) -> str:
    return label.replace("+adm", " (+ admission)")


def _x(value: float) -> str:
    return f"{_fmt(value)}×"


def _knees(record: Mapping[str, Any]) -> list[tuple[str, float, int, bool]]:
    """(gpu, knee sessions/s, probes, cached) per GPU, from the record's facts. Pure."""
    facts, frame = record["facts"], _frame(record)
    gpus = list(dict.fromkeys(frame["gpu"]))
    out = []
    for gpu in gpus:
        suffix = f" ({gpu})" if len(gpus) > 1 else ""
        search = str(facts.get(f"base rate search{suffix}", ""))
        rows = frame.loc[frame["gpu"] == gpu]
        knee = float((rows["rate_per_s"] / rows["load_x"]).median())
        out.append((gpu, knee, search.count("→"), "(cached)" in search))
    return out


def _walls(record: Mapping[str, Any]) -> str:
    """``"158 s (ideal times 16 s, knee search 43 s, runs 96 s)"`` from the facts. Pure."""
    facts = record["facts"]
    total = next((v for k, v in facts.items() if k.startswith("wall (s) of")), None)
    phases = dict(part.rsplit(" ", 1) for part in str(facts.get("wall (s) per phase", "")).split(", ") if part)
    names = {"ideal": "ideal times", "knee": "knee search", "capacity": "capacity", "runs": "runs"}
    inner = ", ".join(f"{names.get(k, k)} {v} s" for k, v in phases.items())
    return f"{total} s ({inner})" if total else "not recorded"


def _provenance(record: Mapping[str, Any]) -> str:
    """Command, worker processes, commit, date and record file. The job count is part of what ran:
    a knee search probes ``jobs // searches`` rates a round, so its knee (and every load) can
    differ with it (docs/compare.md, "Knee search")."""
    jobs = record["facts"].get("jobs")
    return (f"`{record['command']}` with {jobs} worker processes (`--jobs {jobs}` reproduces it "
            f"anywhere) at {record['commit']} on {record['date']} (docs/results/{record['name']}.json)")


_QUICK_COLUMNS = (("mean E2E (s)", "e2e_mean_s"), ("P95 E2E (s)", "e2e_p95_s"), ("P99 E2E (s)", "e2e_p99_s"),
                  ("goodput α=3 (sess/s)", goodput_column(3.0)), ("mean slowdown", "slowdown_mean"),
                  ("TTFT ≤ 10 s", ttft_share_column(10.0)), ("max admission wait (s)", "admission_wait_max_s"),
                  ("re-prefilled tokens", "reprefill_tokens"), ("preemptions", "num_preemptions"))


def _cell(column: str, value: Any) -> str:
    """One figure as the result tables print it. Pure."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if column.startswith("ttft_"):
        return f"{100 * float(value):.3g}%" if float(value) < 1 else "100%"
    if column == "reprefill_tokens":
        return f"{float(value) / 1e6:.3g} M"
    if column == "num_preemptions":
        return f"{int(value):,}"
    return _fmt(value)


def _runs_table(frame: pd.DataFrame, columns: Sequence[tuple[str, str]], corner: str) -> str:
    lines = [f"| {corner} | " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for _, r in frame.sort_values(["load_x"], kind="stable").iterrows():
        tag = "limit" if r.get("is_reference") else reference_tag(str(r.get("policy")))
        name = f"*{r['label']} ({tag})*" if tag else _label(r["label"])
        lines.append(f"| {r['load_x']:g}×: {name} | " + " | ".join(_cell(c, r[c]) for _, c in columns) + " |")
    return "\n".join(lines)


def _gains_sentence(frame: pd.DataFrame) -> str:
    """Mars against the best and the worst baseline at the heaviest load, per metric. Pure."""
    gains = paper_comparison(frame).set_index("metric")
    if gains.empty:
        return ""
    heavy = frame["load_x"].max()
    parts = [f"{_x(gains.at[m, 'vs_best'])} in {m}" for m in ("mean E2E", "P95 E2E", "P99 E2E", "goodput α=3")
             if m in gains.index]
    worst = [f"{_x(gains.at[m, 'vs_worst'])}" for m in ("mean E2E", "P95 E2E", "P99 E2E") if m in gains.index]
    best = ", ".join(dict.fromkeys(str(gains.at[m, "best_baseline"]) for m in gains.index))
    return (f"At {heavy:g}× the best baseline per metric is {best}; against it mars (+ admission) is "
            f"{', '.join(parts)} (> 1: mars better; the paper reports 1.44–5.94× in mean E2E, 1.29–3.37× "
            f"in P90/P95 and 2–7.56× in goodput over its baselines); against the worst baseline "
            f"{', '.join(worst)} in mean, P95 and P99 E2E.")


def _headroom_sentence(frame: pd.DataFrame) -> str:
    table = headroom_table(frame)
    if table.empty:
        return ""
    rooms = ", ".join(f"{r['load_x']:g}×: {_x(r['room_e2e_mean_s'])} mean, {_x(r['room_e2e_p95_s'])} P95"
                      for _, r in table.iterrows())
    mine = ", ".join(f"{_x(r['policy_e2e_p95_s'])}" for _, r in table.iterrows())
    return (f"The unbounded-KV limit (the same arrivals with KV for every session at once) bounds what any KV "
            f"policy can gain: the best baseline is within {rooms} of it; mars's P95 is {mine} the limit's.")


def render_quick(record: Mapping[str, Any]) -> str:
    """The ``--quick`` block: facts, one row per run, the gains at the heaviest load. Pure."""
    frame = _frame(record)
    knees = "; ".join(f"FCFS knee {knee:.4g} sessions/s, found in {n} probes{' (cached)' if cached else ''}"
                      for _, knee, n, cached in _knees(record))
    facts = record["facts"]
    head = (f"{_provenance(record)}: {facts.get('sessions')} sessions, {facts.get('turns')} turns, seed "
            f"{facts.get('seed')}; {knees}; wall on the machine it ran on {_walls(record)}.")
    parts = [head]
    for gpu, group in frame.groupby("gpu", sort=False):  # one GPU for --quick; each in turn otherwise
        parts.append(_runs_table(group, _QUICK_COLUMNS, str(gpu).upper().replace("_", " ")))
        parts.append(" ".join(filter(None, (_gains_sentence(group), _headroom_sentence(group)))))
    return "\n\n".join(parts) + "\n"


_SUMMARY_COLUMNS = ("e2e_mean_s", "e2e_p95_s", "e2e_p99_s", goodput_column(3.0))


def _summary_table(frame: pd.DataFrame) -> str:
    """Per load: the best baseline per metric, mars+adm, and best / mars. Pure."""
    best = best_baselines(frame)
    lines = ["| load (rate) | best baseline: mean / P95 / P99 / goodput | mars+adm | mars vs best: mean, P95, "
             "P99, goodput |", "|---|---|---|---|"]
    for load_x, group in frame.groupby("load_x", sort=True):
        mars = group.loc[group["policy"] == "mars"].iloc[0]
        b = best.loc[best["load_x"] == load_x].set_index("column")
        ratios = [(float(b.at[c, "value"]) / float(mars[c])) if not c.startswith("goodput")
                  else (float(mars[c]) / float(b.at[c, "value"])) for c in _SUMMARY_COLUMNS]
        rate = float(group["rate_per_s"].iloc[0])
        lines.append(f"| {load_x:g}× ({rate:.4g}/s) | "
                     + " / ".join(f"{_fmt(b.at[c, 'value'])} ({b.at[c, 'label']})" for c in _SUMMARY_COLUMNS)
                     + " | " + " / ".join(_fmt(mars[c]) for c in _SUMMARY_COLUMNS)
                     + " | " + ", ".join(_x(r) for r in ratios) + " |")
    return "\n".join(lines)


def render_default_job(record: Mapping[str, Any]) -> str:
    """The default job's README block: facts, then per GPU mars against the best baseline. Pure."""
    frame = _frame(record)
    knees = ", ".join(f"{gpu} {knee:.4g} sessions/s ({n} probes{', cached' if cached else ''})"
                      for gpu, knee, n, cached in _knees(record))
    head = (f"{_provenance(record)}: {len(frame)} runs, all ok, in {_walls(record)} on the machine it ran "
            f"on. Knees: {knees}. Ratios are best baseline / mars (goodput: mars / best), > 1 = mars "
            "better; where two baselines tie, either may be named.")
    parts = [head, ""]
    for gpu, group in frame.groupby("gpu", sort=False):
        parts += [f"**{gpu}**", "", _summary_table(group), ""]
    return "\n".join(parts)


_RUN_COLUMNS = (("mean E2E (s)", "e2e_mean_s"), ("P95 (s)", "e2e_p95_s"), ("P99 (s)", "e2e_p99_s"),
                ("goodput α=3", goodput_column(3.0)), ("mean slowdown", "slowdown_mean"),
                ("preemptions", "num_preemptions"), ("run wall (s)", "wall_s"))


def render_default_job_runs(record: Mapping[str, Any]) -> str:
    """Every run of the default job, per GPU (docs/compare.md). Pure."""
    frame = _frame(record)
    parts = [f"{_provenance(record)}. *run wall* is the wall-clock time of the run on the machine it ran on.", ""]
    for gpu, group in frame.groupby("gpu", sort=False):
        lines = ["| load | policy | " + " | ".join(h for h, _ in _RUN_COLUMNS) + " |",
                 "|" + "---|" * (len(_RUN_COLUMNS) + 2)]
        for _, r in group.sort_values("load_x", kind="stable").iterrows():
            lines.append(f"| {r['load_x']:g}× | {r['label']} | "
                         + " | ".join(_cell(c, r[c]) for _, c in _RUN_COLUMNS) + " |")
        parts += [f"#### {gpu}", "", "\n".join(lines), ""]
    return "\n".join(parts)


BLOCKS: Mapping[str, tuple[str, Callable[[Mapping[str, Any]], str]]] = {
    "quick": ("quick", render_quick),
    "default-job": ("default-job", render_default_job),
    "default-job-runs": ("default-job", render_default_job_runs),
}
"""Block name -> (record name, renderer)."""


def render(block: str, record: Mapping[str, Any]) -> str:
    """The Markdown of ``block`` from ``record`` (between the markers, ending in a newline). Pure.

    Raises:
        BlockError: an unknown block name (lists the known ones).
    """
    if block not in BLOCKS:
        raise BlockError(f"unknown result block {block!r}; known: {', '.join(BLOCKS)}")
    return _wrap(BLOCKS[block][1](record))


def _wrap(text: str, width: int = 100) -> str:
    """Prose paragraphs filled to ``width`` columns, as the docs are; tables and headings kept. Pure."""
    paragraphs = []
    for paragraph in text.strip().split("\n\n"):
        if paragraph.startswith(("|", "#", "**")):
            paragraphs.append(paragraph)
        else:
            paragraphs.append(textwrap.fill(" ".join(paragraph.split()), width, break_long_words=False,
                                            break_on_hyphens=False))
    return "\n\n".join(paragraphs) + "\n"


# -- files ------------------------------------------------------------------------------------------

def doc_files(root: Path = REPO_ROOT) -> list[Path]:
    """README.md and docs/*.md under ``root``."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def find_blocks(text: str) -> list[tuple[str, str]]:
    """``(block name, body)`` of every result block in a Markdown text. Pure."""
    return [(m.group("name"), m.group("body")) for m in _MARKER.finditer(text)]


def rendered_docs(root: Path = REPO_ROOT, only_record: str | None = None,
                  records: Mapping[str, Mapping[str, Any]] | None = None) -> list[tuple[Path, str]]:
    """The docs whose blocks (or those of record ``only_record``) would change, with their new text.

    Reads README.md and docs/*.md; writes nothing. ``records`` (record name -> record) are used
    in place of the committed ``docs/results/<name>.json`` (a run not yet saved).

    Raises:
        BlockError: a block whose record is missing, or a record whose rows were edited.
    """
    loaded: dict[str, Mapping[str, Any]] = dict(records or {})

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in BLOCKS or (only_record and BLOCKS[name][0] != only_record):
            return m.group(0)
        record_name = BLOCKS[name][0]
        if record_name not in loaded:
            record_path = root / RECORD_DIR / f"{record_name}.json"
            if not record_path.is_file():
                raise BlockError(f"block {name!r} has no record {record_path}; record a run with "
                                 f"`python -m eval.result_blocks record DIR --block {record_name}`")
            loaded[record_name] = load_record(record_path)
        return f"<!-- {name}:begin -->\n{render(name, loaded[record_name])}<!-- {name}:end -->"

    changed = []
    for path in doc_files(root):
        text = path.read_text(encoding="utf-8")
        new = _MARKER.sub(replace, text)
        if new != text:
            changed.append((path, new))
    return changed


def write_blocks(root: Path = REPO_ROOT, only_record: str | None = None) -> list[Path]:
    """Re-render every block (or those of record ``only_record``) in README.md and docs/*.md.

    Every file is rendered before any is written (:func:`replace_files`), so an error leaves
    them all as they were.

    Returns:
        The files that changed. Raises BlockError for a block whose record is missing.
    """
    return replace_files(rendered_docs(root, only_record))


def publish_record(record: Mapping[str, Any], root: Path = REPO_ROOT) -> list[Path]:
    """Save ``record`` as ``docs/results/<name>.json`` and rewrite the blocks drawn from it.

    The record's file and every block are rendered first; only then are the files replaced, each
    by a rename of a finished temporary file beside it. A rendering error leaves the record and
    the docs as they were, in step.

    Returns:
        The record's path, then the docs that changed.

    Raises:
        BlockError: a block that cannot be rendered (see :func:`rendered_docs`).
        OSError: a file that cannot be written (the temporary files are removed).
    """
    path = root / RECORD_DIR / f"{record['name']}.json"
    docs = rendered_docs(root, record["name"], {record["name"]: record})
    return replace_files([(path, record_text(record)), *docs])


def replace_files(files: Sequence[tuple[Path, str]]) -> list[Path]:
    """Write each text to a temporary file beside its path, then rename them all into place.

    Mutates: the files (and their parent folders, created). A failure while writing the
    temporary files removes them and changes nothing; the renames are each atomic.

    Returns:
        The paths, in order. Raises OSError from the writes.
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            staged.append((tmp, path))
            tmp.write_text(text, encoding="utf-8")
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in staged:
        os.replace(tmp, path)
    return [path for _, path in staged]


def record_text(record: Mapping[str, Any]) -> str:
    """``docs/results/<name>.json``'s text: one line per row, so a diff shows which runs changed. Pure."""
    head = {k: v for k, v in record.items() if k != "rows"}
    rows = ",\n".join("  " + json.dumps(r, sort_keys=True) for r in record["rows"])
    text = json.dumps(head, indent=1, sort_keys=True)[:-2] + ',\n "rows": [\n' + rows + "\n ]\n}\n"
    json.loads(text)  # still one JSON object
    return text


def save_record(record: Mapping[str, Any], root: Path = REPO_ROOT) -> Path:
    """Write ``docs/results/<name>.json`` alone (:func:`publish_record` also rewrites its blocks)."""
    path = root / RECORD_DIR / f"{record['name']}.json"
    return replace_files([(path, record_text(record))])[0]


def recorded_command(name: str, root: Path = REPO_ROOT) -> str | None:
    """The ``compare`` command line of the committed record ``name``; ``None`` without one.

    Raises:
        BlockError: a record whose rows were edited by hand.
    """
    path = root / RECORD_DIR / f"{name}.json"
    return str(load_record(path)["command"]) if path.is_file() else None


def is_ancestor(commit: str, root: Path = REPO_ROOT) -> bool | None:
    """Whether ``commit`` is in the history of ``root``'s HEAD; ``None`` without git."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", commit, "HEAD"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(proc.returncode)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m eval.result_blocks record DIR --block NAME | render | check``."""
    prog = "python -m eval.result_blocks"
    parser = CliParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="record a compare results directory and rewrite its blocks")
    rec.add_argument("results_dir", help="the --out folder of a finished compare")
    rec.add_argument("--block", required=True, choices=sorted({r for r, _ in BLOCKS.values()}),
                     help="the record's name (docs/results/NAME.json)")
    ren = sub.add_parser("render", help="re-render the blocks from the committed records")
    ren.add_argument("--block", default=None, choices=sorted({r for r, _ in BLOCKS.values()}),
                     help="only the blocks of this record (default: every block)")
    sub.add_parser("check", help="exit 1 when a block differs from its record's rendering")
    args = parser.parse_args(argv)
    try:
        if args.action in ("record", "render"):
            if args.action == "record":
                record_path, *docs = publish_record(record_run(args.results_dir, args.block))
                print(f"recorded {record_path}")
            else:
                docs = write_blocks(only_record=args.block)
            for path in docs:
                print(f"rewrote {path}")
            return 0
        stale = [p for p in doc_files() if _stale(p)]
    except (BlockError, OSError) as e:
        return cli_error(f"{prog} {args.action}", str(e))
    for path in stale:
        print(f"{path}: a result block differs from its record; run `{prog} render`", file=sys.stderr)
    return 1 if stale else 0


def _stale(path: Path) -> bool:
    """Whether a block of ``path`` differs from its record's rendering. Raises BlockError for a
    block without a record."""
    for name, body in find_blocks(path.read_text(encoding="utf-8")):
        if name in BLOCKS:
            record_path = REPO_ROOT / RECORD_DIR / f"{BLOCKS[name][0]}.json"
            if not record_path.is_file():
                raise BlockError(f"{path.name}: block {name!r} has no record {record_path}; record a run "
                                 f"with `python -m eval.result_blocks record DIR --block {BLOCKS[name][0]}`")
            if render(name, load_record(record_path)) != body:
                return True
    return False


if __name__ == "__main__":
    sys.exit(main())
