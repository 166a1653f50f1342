"""``tasks report`` output: a console table, and files (Parquet rows, JSON summary, a PNG plot).

rich, pandas/pyarrow and matplotlib are imported when used (the ``eval`` extra brings the last
two; both environments from scripts/setup.sh have it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["print_report", "write_report"]

_SUMMARY_LABELS = (
    ("num_tasks", "tasks", "{:d}"), ("num_succeeded", "succeeded", "{:d}"),
    ("e2e_mean_s", "E2E mean (s)", "{:.2f}"), ("e2e_p95_s", "E2E P95 (s)", "{:.2f}"),
    ("tool_wait_share", "tool-wait share", "{:.1%}"),
    ("recovery_success_rate", "recovery success rate", "{:.0%}"),
    ("num_recovered_tasks", "tasks recovered", "{:d}"),
    ("num_duplicate_effects", "duplicate side effects", "{:d}"),
    ("num_possible_duplicate_effects", "possible duplicate side effects (re-run after a crash "
     "left them in doubt; check the target)", "{:d}"),
    ("cost_per_successful_task_usd", "cost per successful task (USD)", "{:.4f}"),
    ("share_ended_by_budget", "ended by budget", "{:.0%}"),
    ("share_ended_by_deadline", "ended by deadline", "{:.0%}"),
    ("share_ended_by_policy", "ended by policy", "{:.0%}"),
)


def _fmt(value: Any, pattern: str) -> str:
    return "—" if value is None else pattern.format(value)


def print_report(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Print the per-task table and the summary (rich). Mutates nothing.

    ``dup`` counts known duplicate side effects, ``dup?`` possible ones (``metrics`` module doc).
    """
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    table = Table(title="tasks")
    for name in ("task", "status", "E2E s", "tool s", "tool share", "runs", "LLM calls", "tools",
                 "tokens", "cost $", "dup", "dup?", "denied", "reason"):
        table.add_column(name)
    for r in rows:
        table.add_row(r["task_id"], r["status"], f"{r['e2e_s']:.2f}", f"{r['tool_s']:.2f}",
                      f"{r['tool_wait_share']:.0%}", str(r["num_runs"]), str(r["num_llm_calls"]),
                      str(r["num_tool_calls"]), str(r["num_llm_tokens"]), f"{r['cost_usd']:.4f}",
                      str(r["num_duplicate_effects"]), str(r["num_possible_duplicate_effects"]),
                      str(r["num_denied"]), (r["end_reason"] or "")[:50])
    console.print(table)
    summary_table = Table(title="over tasks", show_header=False)
    for key, label, pattern in _SUMMARY_LABELS:
        summary_table.add_row(label, _fmt(summary.get(key), pattern))
    console.print(summary_table)


def write_report(rows: list[dict[str, Any]], summary: dict[str, Any], out: Path) -> list[Path]:
    """Write ``tasks.parquet``, ``summary.json`` and ``task_times.png`` under ``out``.

    Returns:
        The paths written.

    Raises:
        ValueError: ``out`` exists and is not a directory.
    """
    import pandas as pd

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    paths = [out / "tasks.parquet", out / "summary.json", out / "task_times.png"]
    frame.to_parquet(paths[0], index=False)
    paths[1].write_text(json.dumps(summary, indent=1))
    _plot(rows, paths[2])
    return paths


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: where each task's E2E time went (LLM, tools, waiting for a person, other).
    Right: the E2E CDF with its P95."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cdf) = plt.subplots(1, 2, figsize=(11, max(3.0, 0.35 * len(rows) + 1.5)))
    names = [r["task_id"] for r in rows]
    left = [0.0] * len(rows)
    for key, label in (("llm_s", "LLM"), ("tool_s", "tools"), ("approval_wait_s", "waiting for a person")):
        values = [min(r[key], r["e2e_s"]) for r in rows]
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.barh(names, [max(0.0, r["e2e_s"] - x) for r, x in zip(rows, left, strict=True)], left=left,
            label="other (runtime, restarts)", color="lightgrey")
    ax.set_xlabel("seconds")
    ax.set_title("E2E time per task")
    ax.legend(fontsize=8)
    e2e = sorted(r["e2e_s"] for r in rows)
    if e2e:
        cdf.step(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], where="post")
    cdf.set_xlabel("E2E task time (s)")
    cdf.set_ylabel("fraction of tasks")
    cdf.set_title("task latency CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
