"""Issue 31's capacity table from ``mars-openhands plan`` folders: one row per deployment (GPU,
model, KV dtype, host tier, workload, seed), capacity at SLO per policy, and `mars` against the best
baseline and the unbounded-KV limit.

Each folder is one ``plan --out DIR`` (its ``plan.parquet`` and ``run.json``). Policies are matched to
columns by name: ``fcfs``, ``vllm-tuned``, ``vllm-offload`` (the better of ``vllm-offload-lru`` and
``-arc``), ``thunderagent``, ``continuum``, ``mars`` (``mars+adm``), each with or without an
``-offload`` suffix (the host-tier variants), and the limit. A tie is ``mars`` ≥ 0.98× the best
baseline (the issue's rule); because a capacity search only brackets the knee, a row where `mars` and
the best baseline share a bracket is marked ``same bracket``::

    python benchmarks/capacity_table.py runs/cap/h100-bf16 runs/cap/h100-fp8 ... > table.md
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import pandas as pd

COLUMNS = ("fcfs", "vllm-tuned", "vllm-offload", "thunderagent", "continuum", "mars")
"""Policy columns, baselines first; ``mars`` is the one judged."""
TIE = 0.98
"""Issue 31: `mars` at ≥ 0.98× the best baseline's capacity counts as a tie."""


def column_of(label: str) -> str | None:
    """The table column of a plan row's label, or None for the limit / an unknown policy. Pure.

    >>> [column_of(x) for x in ("mars+adm", "thunderagent-offload", "vllm-offload-arc", "unbounded-kv")]
    ['mars', 'thunderagent', 'vllm-offload', None]
    """
    name = label.removesuffix("+adm").removesuffix("-offload")
    if name.startswith("vllm-offload"):
        return "vllm-offload"
    name = re.sub(r"\+adm$", "", name)
    return name if name in COLUMNS else None


def deployment_of(facts: dict) -> dict[str, str]:
    """GPU, model, KV dtype, host tier, workload and seed of a plan's ``run.json`` facts. Pure."""
    scope = str(facts.get("scope", ""))
    tier = re.search(r"Host KV tier: ([0-9.]+ GiB)", scope)
    trimmed = "TRIMMED" in scope
    return {"GPU": str(facts.get("timing", "?")).split(" ")[0], "model": str(facts.get("model", "?")),
            "KV": str(facts.get("kv cache dtype", "?")), "host tier": tier.group(1) if tier else "none",
            "workload": Path(str(facts.get("workload", "?"))).name + (" (TRIMMED)" if trimmed else ""),
            "seed": str(facts.get("seed", "?"))}


def row_of(folder: Path) -> dict[str, object]:
    """One table row of a plan folder.

    Raises:
        FileNotFoundError: ``folder`` has no ``plan.parquet`` or ``run.json`` (not a finished plan).
    """
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: {'no such folder' if not folder.exists() else 'not a folder'}; "
                                "give plan --out folders")
    for name in ("plan.parquet", "run.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: {name} missing: not a finished plan")
    table = pd.read_parquet(folder / "plan.parquet")
    facts = json.loads((folder / "run.json").read_text(encoding="utf-8"))["facts"]
    row: dict[str, object] = dict(deployment_of(facts))
    caps: dict[str, tuple[float, float, str]] = {}
    for _, r in table.iterrows():
        cap, unstable = float(r["capacity_per_s"]), float(r["first_unstable_per_s"])
        if not r.get("is_bracketed", True):
            row["unbracketed"] = [*row.get("unbracketed", []), str(r["label"])]  # type: ignore[misc]
            cap = math.nan  # a lower bound only (the search's budget ran out): no capacity to compare
        if r["is_limit"]:
            row["limit"] = cap
            continue
        column = column_of(str(r["label"]))
        if column and (column not in caps or cap > caps[column][0]
                       or (math.isnan(caps[column][0]) and not math.isnan(cap))):
            caps[column] = (cap, unstable, str(r["label"]))
    for column, (cap, _, label) in caps.items():
        row[column] = cap
        row[f"{column} label"] = label
    baselines = {c: v for c, v in caps.items() if c != "mars" and not math.isnan(v[0])}
    if "mars" in caps and baselines:
        best = max(baselines, key=lambda c: baselines[c][0])
        mars, mars_unstable, _ = caps["mars"]
        cap, unstable, label = baselines[best]
        row["best baseline"] = label
        row["mars ÷ best"] = mars / cap if cap else math.nan
        row["same bracket"] = bool(mars == cap and mars_unstable == unstable)
    if "mars" in caps and row.get("limit"):
        row["mars × limit"] = caps["mars"][0] / float(row["limit"])  # type: ignore[arg-type]
    return row


def render(rows: list[dict[str, object]]) -> str:
    """The markdown table of :func:`row_of` rows (capacity in sessions/s, 4 significant figures). Pure."""
    def figure(value: object) -> str:
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"

    head = ["GPU", "model", "KV", "host tier", "workload", "seed", *COLUMNS, "limit", "best baseline",
            "mars ÷ best", "mars × limit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = figure(r.get("mars ÷ best"))
        if r.get("same bracket"):
            ratio += " (same bracket)"
        cells = [str(r[k]) for k in ("GPU", "model", "KV", "host tier", "workload", "seed")]
        cells += [figure(r.get(c)) + (f" ({r[c + ' label']})" if "offload" in str(r.get(c + " label", "")) else "")
                  for c in COLUMNS]
        cells.append(figure(r.get("limit")))
        cells += [str(r.get("best baseline", "–")), ratio, figure(r.get("mars × limit"))]
        lines.append("| " + " | ".join(cells) + " |")
    unbracketed = sorted({label for r in rows for label in r.get("unbracketed", [])})  # type: ignore[attr-defined]
    if unbracketed:
        lines.append(f"\n– also: no unstable rate found within the search's budget ({', '.join(unbracketed)}), "
                     "so that capacity is only a lower bound; rerun plan with more --search-runs")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the table of the given plan folders; 2 on a folder that is not a finished plan."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path, help="plan --out folders (plan.parquet, run.json)")
    args = p.parse_args(argv)
    rows = []
    for folder in args.folders:
        try:
            rows.append(row_of(folder))
        except FileNotFoundError as e:
            print(f"capacity_table.py: error: {e}", file=sys.stderr)
            return 2
    sys.stdout.write(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
