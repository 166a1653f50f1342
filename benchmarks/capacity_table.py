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
    """One table row of a plan folder (:func:`judged` adds the comparison columns).

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
    for column, (cap, unstable, label) in caps.items():
        row[column] = cap
        row[f"{column} unstable"] = unstable
        row[f"{column} label"] = label
    return judged(row)


def judged(row: dict[str, object]) -> dict[str, object]:
    """``row`` with ``mars`` against the best baseline (``best baseline``, ``mars ÷ best``, ``same
    bracket``) and the limit (``mars × limit``). Pure."""
    out = {k: v for k, v in row.items() if k not in ("best baseline", "mars ÷ best", "same bracket", "mars × limit")}
    baselines = {c: float(out[c]) for c in COLUMNS  # type: ignore[arg-type]
                 if c != "mars" and c in out and not math.isnan(float(out[c]))}  # type: ignore[arg-type]
    if "mars" in out and baselines:
        best = max(baselines, key=baselines.__getitem__)
        mars, cap = float(out["mars"]), baselines[best]  # type: ignore[arg-type]
        out["best baseline"] = out.get(f"{best} label", best)
        out["mars ÷ best"] = mars / cap if cap else math.nan
        out["same bracket"] = bool(mars == cap and out.get("mars unstable") == out.get(f"{best} unstable"))
    if "mars" in out and out.get("limit"):
        out["mars × limit"] = float(out["mars"]) / float(out["limit"])  # type: ignore[arg-type]
    return out


DEPLOYMENT_KEYS = ("GPU", "model", "KV", "host tier", "workload", "seed")
"""What makes two plan folders the same deployment (one row)."""


def merged(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per deployment, in first-seen order: folders of the same deployment (e.g. a plan of
    the baselines and a later one of ``mars`` alone after a change to it) are combined, a later
    folder's policy columns and limit replacing an earlier one's. Pure.

    >>> a = {**dict.fromkeys(DEPLOYMENT_KEYS, "x"), "fcfs": 1.0, "mars": 2.0, "limit": 4.0}
    >>> [(r["fcfs"], r["mars"], r["mars ÷ best"]) for r in merged([a, {**a, "mars": 3.0}])]
    [(1.0, 3.0, 3.0)]
    """
    by_key: dict[tuple[object, ...], dict[str, object]] = {}
    for row in rows:
        key = tuple(row[k] for k in DEPLOYMENT_KEYS)
        if key in by_key:
            unbracketed = [*by_key[key].get("unbracketed", []), *row.get("unbracketed", [])]  # type: ignore[misc]
            by_key[key] = {**by_key[key], **row, **({"unbracketed": unbracketed} if unbracketed else {})}
        else:
            by_key[key] = dict(row)
    return [judged(r) for r in by_key.values()]


def render(rows: list[dict[str, object]]) -> str:
    """The markdown table of :func:`row_of` rows (capacity in sessions/s, 4 significant figures). Pure."""
    def figure(value: object) -> str:
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"

    head = [*DEPLOYMENT_KEYS, *COLUMNS, "limit", "best baseline",
            "mars ÷ best", "mars × limit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = figure(r.get("mars ÷ best"))
        if r.get("same bracket"):
            ratio += " (same bracket)"
        cells = [str(r[k]) for k in DEPLOYMENT_KEYS]
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
    p.add_argument("folders", nargs="+", type=Path,
                   help="plan --out folders (plan.parquet, run.json); folders of the same deployment make "
                        "one row, a later folder's policies replacing an earlier one's")
    args = p.parse_args(argv)
    rows = []
    for folder in args.folders:
        try:
            rows.append(row_of(folder))
        except FileNotFoundError as e:
            print(f"capacity_table.py: error: {e}", file=sys.stderr)
            return 2
    sys.stdout.write(render(merged(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
