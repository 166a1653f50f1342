"""Results directory of ``mars-openhands compare``: ``summary.md`` tables and PNG plots (design.md §7).

Input is a *results table*: one row per run (policy × admission × load), with the columns of
:data:`RESULT_COLUMNS` (metric columns NaN for a failed run), and for the plots each run's
per-session table (``e2e_s`` column). Everything here is pure except the ``write_*`` functions,
which only write files under the directory they are given.

Ratios (``ratio_table``) are ``run value / reference value`` at the same load: below 1 is better for
latency-like metrics (E2E, slowdown, preemptions), above 1 is better for throughput, goodput and
the KV retention hit ratio. References: FCFS (policy ``fcfs`` without admission if it ran, else
with it) and, per metric, the best baseline at that load (the lowest or highest value among the
baseline runs, whichever is better for that metric).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from eval.policies import reference_tag

__all__ = [
    "ADDS_PART",
    "AT_LIMIT_PCT",
    "METRICS",
    "PAPER_ABLATIONS",
    "PAPER_GAINS",
    "RESULT_COLUMNS",
    "Metric",
    "ablation_table",
    "best_baselines",
    "excess_over_limit_pct",
    "format_figure",
    "capacity_ratios",
    "goodput_column",
    "paper_comparison",
    "ratio_table",
    "render_summary",
    "ttft_share_column",
    "write_plots",
    "write_summary",
]


def goodput_column(alpha: float) -> str:
    """Results-table column holding goodput (sessions/s) at SLO factor ``alpha``."""
    return f"goodput_a{alpha:g}_per_s"


def ttft_share_column(slo_s: float) -> str:
    """Results-table column holding the share of turns with agent TTFT <= ``slo_s`` seconds."""
    return f"ttft_le{slo_s:g}s_share"


class Metric:
    """One summary column: results-table ``column``, table ``label``, and its better direction."""

    __slots__ = ("column", "is_higher_better", "label")

    def __init__(self, column: str, label: str, is_higher_better: bool) -> None:
        self.column, self.label, self.is_higher_better = column, label, is_higher_better

    @property
    def ratio_label(self) -> str:
        """Header of this metric in a ratio table: the label with its unit replaced by ``(ratio)``."""
        return re.sub(r"\s*\([^)]*\)$", "", self.label) + " (ratio)"


METRICS: tuple[Metric, ...] = (
    Metric("e2e_mean_s", "mean E2E (s)", False),
    Metric("e2e_p50_s", "P50 E2E (s)", False),
    Metric("e2e_p90_s", "P90 E2E (s)", False),
    Metric("e2e_p95_s", "P95 E2E (s)", False),
    Metric("e2e_p99_s", "P99 E2E (s)", False),
    Metric("throughput_per_s", "throughput (sess/s)", True),
    Metric(goodput_column(3.0), "goodput α=3 (sess/s)", True),
    Metric("slowdown_mean", "mean slowdown", False),
    Metric("num_preemptions", "preemptions", False),
    Metric("kv_hit_ratio", "KV retention hit ratio", True),
    Metric(ttft_share_column(10.0), "TTFT≤10s share", True),
    Metric(ttft_share_column(30.0), "TTFT≤30s share", True),
    Metric("admission_wait_max_s", "max admission wait (s)", False),
    Metric("reprefill_tokens", "re-prefilled tokens", False),
)
"""Metrics of the summary tables, in column order."""

RESULT_COLUMNS: tuple[str, ...] = (
    "run_id", "gpu", "label", "policy", "is_admission_enabled", "is_baseline", "is_reference", "load_x",
    "rate_per_s",
    "status", "error", "wall_s", "num_sessions", "num_completed", "makespan_s",
    *(m.column for m in METRICS),
)
"""Columns every results table has (plus ``goodput_a<α>_per_s`` for each α of the sweep)."""


def format_figure(value: Any, digits: int = 3) -> str:
    """A figure as the tables print it: ``digits`` significant digits, thousands separated, ``–``
    for a missing value (``1,122``, ``0.00869``, ``1.12``). Pure."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"  # counts (re-prefilled tokens) read the same in every table
    v = float(value)
    if abs(v) >= 1e4:
        return f"{v:,.0f}"
    if v != 0 and abs(v) < 1e-3:
        return f"{v:.{digits}g}"
    if abs(v) < 1 - 0.5 * 10 ** -digits:  # would not round up to 1
        return f"{v:.{digits}g}"
    return f"{v:,.{max(digits - int(math.log10(abs(v))) - 1, 0)}f}"


_fmt = format_figure


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _fcfs_rows(ok: pd.DataFrame) -> pd.DataFrame:
    """FCFS reference row per load: without admission if present, else with it."""
    fcfs = ok.loc[ok["policy"] == "fcfs"].sort_values("is_admission_enabled")
    return fcfs.drop_duplicates("load_x", keep="first").set_index("load_x")


def ratio_table(results: pd.DataFrame, reference: str) -> pd.DataFrame:
    """``value / reference value`` for every successful run and metric, at the run's load. Pure.

    Args:
        results: results table (:data:`RESULT_COLUMNS`).
        reference: ``"fcfs"`` (FCFS at that load, see the module docstring) or ``"best_baseline"``
            (per metric, the best ``is_baseline`` run at that load).

    Returns:
        One row per successful run: ``label``, ``load_x`` and one column per metric of
        :data:`METRICS` (NaN where the reference is missing, zero or NaN).

    Raises:
        ValueError: unknown ``reference``.
    """
    if reference not in ("fcfs", "best_baseline"):
        raise ValueError(f"unknown ratio reference {reference!r}; expected 'fcfs' or 'best_baseline'")
    ok = results.loc[results["status"] == "ok"]
    out = ok[["label", "load_x"]].copy()
    fcfs = _fcfs_rows(ok)
    baselines = ok.loc[ok["is_baseline"].astype(bool)]
    for metric in METRICS:
        if reference == "fcfs":
            ref = ok["load_x"].map(fcfs[metric.column]) if not fcfs.empty else np.nan
        else:
            grouped = baselines.groupby("load_x")[metric.column]
            best = grouped.max() if metric.is_higher_better else grouped.min()
            ref = ok["load_x"].map(best)
        ref = pd.Series(ref, index=ok.index, dtype="float64").replace(0.0, np.nan)
        out[metric.column] = ok[metric.column].astype("float64") / ref
    return out.reset_index(drop=True)


def _load_header(load_x: float, rate_per_s: float, is_absolute: bool) -> str:
    if is_absolute:
        return f"### rate {rate_per_s:.4g} sessions/s"
    return f"### load {load_x:g}× base ({rate_per_s:.4g} sessions/s)"


def _absolute_section(results: pd.DataFrame, is_absolute: bool) -> list[str]:
    parts = ["## Absolute values", "",
             "E2E and throughput in the backend's time (virtual for `sim`); *run wall (s)* is this "
             "machine's wall-clock time for the run (live backends: including the server start).", ""]
    header = ["run", *(m.label for m in METRICS), "completed", "run wall (s)"]
    for load_x, group in results.groupby("load_x", sort=True):
        parts += [_load_header(load_x, float(group["rate_per_s"].iloc[0]), is_absolute), ""]
        rows = []
        for _, r in group.iterrows():
            if r["status"] != "ok":
                rows.append([r["label"], *(["FAILED"] + ["–"] * (len(METRICS) - 1)), "–",
                             _fmt(r["wall_s"])])
                continue
            rows.append([r["label"], *(_fmt(r[m.column]) for m in METRICS),
                         f"{int(r['num_completed'])}/{int(r['num_sessions'])}", _fmt(r["wall_s"])])
        parts += [_md_table(header, rows), ""]
    return parts


def _ratio_section(results: pd.DataFrame, reference: str, title: str) -> list[str]:
    ratios = ratio_table(results, reference)
    parts = [f"## {title}", "",
             "value / reference at the same load: < 1 is better for E2E, slowdown and preemptions; "
             "> 1 is better for throughput, goodput and the hit ratio.", ""]
    header = ["run", *(m.ratio_label for m in METRICS)]
    for load_x, group in ratios.groupby("load_x", sort=True):
        parts += [f"### load {load_x:g}", ""]
        rows = [[r["label"], *(_fmt(r[m.column]) for m in METRICS)] for _, r in group.iterrows()]
        parts += [_md_table(header, rows), ""]
    return parts


def _replica_section(results: pd.DataFrame) -> list[str]:
    """Several replicas: each run's re-homes and, with ``--lose-replica``, what the loss cost."""
    if "num_rehomes" not in results.columns or results["num_rehomes"].isna().all():
        return []
    ok = results.loc[results["status"] == "ok"]
    has_loss = "lost_replica" in ok.columns and ok["lost_replica"].notna().any()
    header = "| run | sessions re-homed | completed |"
    if has_loss:
        header += (" replica lost (at s) | sessions re-placed | turns failed | re-prefilled tokens | "
                   "requests aborted (KV checked: no leak) |")
    parts = ["## Replicas", "",
             "Sessions re-homed: moved off a live replica by the router. A lost replica's requests are "
             "aborted and its KV blocks checked for leaks (a leak fails the run); its sessions are "
             "re-placed and re-prefill their context elsewhere.", "",
             header, "|" + "---|" * (header.count("|") - 1)]
    for _, r in ok.iterrows():
        line = f"| {r['run_id']} | {int(r['num_rehomes']):,} | {int(r['num_completed'])}/{int(r['num_sessions'])} |"
        if has_loss and pd.notna(r["lost_replica"]):
            line += (f" {int(r['lost_replica'])} ({r['lost_at_s']:g}) | {int(r['loss_sessions_replaced']):,} | "
                     f"{int(r['loss_turns_failed']):,} | {int(r['loss_reprefill_tokens']):,} | "
                     f"{int(r['loss_requests_aborted']):,} |")
        elif has_loss:  # a run taken from a capacity probe: its counters were not kept
            line += " – | – | – | – | – |"
        parts.append(line)
    return [*parts, ""]


def _failures_section(results: pd.DataFrame) -> list[str]:
    failed = results.loc[results["status"] != "ok"]
    if failed.empty:
        return []
    parts = ["## Failed runs", ""]
    for _, r in failed.iterrows():
        parts.append(f"- `{r['run_id']}`: {str(r['error']).strip().splitlines()[-1] if r['error'] else '?'}")
    return [*parts, ""]


PAPER_GAINS: tuple[tuple[str, str, bool, str], ...] = (
    ("mean E2E", "e2e_mean_s", False, "1.44–5.94×"),
    ("P90 E2E", "e2e_p90_s", False, "1.29–3.37×"),
    ("P95 E2E", "e2e_p95_s", False, "1.29–3.37×"),
    ("P99 E2E", "e2e_p99_s", False, "not reported"),
    ("goodput α=3", "goodput_a3_per_s", True, "2–7.56×"),
)
"""(label, results column, higher is better, the MARS paper's reported gain over its baselines);
design.md §7 (MARS, arXiv 2604.26963, H100/H200, Qwen3-Coder-30B-A3B-Instruct and GPT-OSS-120B)."""


def paper_comparison(results: pd.DataFrame, policy: str = "mars") -> pd.DataFrame:
    """Gain of ``policy``'s runs over the best and the worst baseline at the heaviest load. Pure.

    Gain = baseline / ours for lower-is-better metrics and ours / baseline otherwise, so > 1 means
    ``policy`` is better, as the paper reports its ``1.44–5.94×``. With a ``gpu`` column each run
    is compared with the baselines of its own GPU (a two-GPU table has every label twice).

    Returns:
        One row per metric of :data:`PAPER_GAINS` and run of ``policy`` (``label``, ``metric``,
        ``vs_best``, ``vs_worst``, ``best_baseline``, ``paper``, and ``gpu`` when the table has
        several GPUs); empty when ``policy`` or the baselines have no successful run at the
        heaviest load.
    """
    ok = results.loc[results["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame()
    groups = list(ok.groupby("gpu", sort=False, dropna=False)) if "gpu" in ok else [(None, ok)]
    rows = []
    for gpu, own in groups:
        heavy = own.loc[own["load_x"] == own["load_x"].max()]
        for row in _paper_gains(heavy, policy):
            rows.append({**row, "gpu": gpu} if len(groups) > 1 else row)
    return pd.DataFrame(rows)


def _paper_gains(heavy: pd.DataFrame, policy: str) -> list[dict[str, Any]]:
    """:func:`paper_comparison`'s rows for the runs of one GPU at one load. Pure."""
    ours = heavy.loc[heavy["policy"] == policy]
    base = heavy.loc[heavy["is_baseline"].astype(bool)]
    rows = []
    for _, run in ours.iterrows():
        for label, column, is_higher_better, paper in PAPER_GAINS:
            if column not in base or base[column].isna().all() or not run[column]:
                continue
            values = base.set_index("label")[column].astype("float64").dropna()
            # a label twice at one load and GPU (no compare makes one) counts by its best run
            by_label = values.groupby(level=0, sort=False)
            values = by_label.max() if is_higher_better else by_label.min()
            best, worst = (values.idxmax(), values.idxmin()) if is_higher_better else (
                values.idxmin(), values.idxmax())
            ours_v = float(run[column])
            gains = [(ours_v / v if is_higher_better else v / ours_v) if v else math.nan
                     for v in (float(values[best]), float(values[worst]))]
            rows.append({"label": run["label"], "metric": label, "vs_best": gains[0],
                         "vs_worst": gains[1], "best_baseline": best, "paper": paper})
    return rows


def _admission_sentence(results: pd.DataFrame, admission: Any) -> str:
    """Which runs had the gateway admission window, and under which ``--admission`` mode. Pure."""
    ok = results.loc[results["status"] == "ok"]
    heavy = ok.loc[ok["load_x"] == ok["load_x"].max()]
    on = [str(x) for x in heavy.loc[heavy["is_admission_enabled"].astype(bool), "label"]]
    off = [str(x) for x in heavy.loc[~heavy["is_admission_enabled"].astype(bool), "label"]]
    mode = f"`--admission {admission}`" if admission else "the admission setting"
    why = (" (auto: the MARS policies with their control plane, the baselines without, as published)"
           if admission == "auto" else "")
    return (f"Gateway admission window under {mode}{why}: on for {', '.join(on) or 'no run'}; "
            f"off for {', '.join(off) or 'no run'}.")


def _paper_section(results: pd.DataFrame, admission: Any = None) -> list[str]:
    table = paper_comparison(results)
    if table.empty:
        return []
    parts = ["## Against the paper (heaviest load)", "",
             "Gain of `mars` over the baselines (> 1: mars is better; baseline / mars for latency, "
             "mars / baseline for goodput), next to the gains the MARS paper reports, as listed in "
             "design.md §7 (../shared/docs/design.md).", "", _admission_sentence(results, admission), ""]
    rows = [[r["label"], r["metric"], f"{_fmt(r['vs_best'])}× (vs {r['best_baseline']})",
             f"{_fmt(r['vs_worst'])}×", r["paper"]] for _, r in table.iterrows()]
    parts += [_md_table(["run", "metric", "vs best baseline", "vs worst baseline", "paper"], rows), ""]
    return parts


PAPER_ABLATIONS: Mapping[str, tuple[str, str]] = {
    "mars-mlfq": ("priority coordinator", "2–5×"),
    "mars-no-control-plane": ("external control plane", "1.5–3×"),
    "mars-no-coscheduler": ("opportunistic co-scheduler", "1.5–2×"),
}
"""Ablation variant -> (the paper's part it differs in, how much worse the MARS paper reports mars
without it; §6, as listed in design.md §7). ``mars`` runs without the MLFQ priority coordinator,
so its variant, ``mars-mlfq``, switches the part *on* (:data:`ADDS_PART`)."""
ADDS_PART: frozenset[str] = frozenset({"mars-mlfq"})
"""Variants that have the part ``mars`` lacks: for them "without it" is ``mars`` itself."""

_ABLATION_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("mean E2E", "e2e_mean_s", False), ("P95 E2E", "e2e_p95_s", False),
    ("goodput α=3", "goodput_a3_per_s", True), ("mean slowdown", "slowdown_mean", False),
)


def ablation_table(results: pd.DataFrame, capacity: pd.DataFrame | None = None) -> pd.DataFrame:
    """How much worse mars is without each part than with it, per load. Pure.

    "× worse" = without / with for lower-is-better metrics, with / without for goodput and
    capacity, so > 1 means the part helps, as the paper reports it; "without" is the variant,
    or ``mars`` itself for a variant that switches a part on (:data:`ADDS_PART`). The variant's
    run is compared with the ``mars`` run of the same load and admission setting where there is
    one, else with any ``mars`` run at that load (``mars-no-control-plane`` has no window; its
    reference is ``mars`` with it).

    Returns:
        Columns ``variant``, ``part``, ``load_x``, ``metric``, ``worse_x``, ``paper``; empty
        without ``mars`` or a variant.
    """
    ok = results.loc[results["status"] == "ok"]
    mars = ok.loc[ok["policy"] == "mars"]
    rows = []
    for _, run in ok.loc[ok["policy"].isin(list(PAPER_ABLATIONS))].iterrows():
        ref = mars.loc[mars["load_x"] == run["load_x"]]
        same = ref.loc[ref["is_admission_enabled"] == run["is_admission_enabled"]]
        ref = same if not same.empty else ref
        if ref.empty:
            continue
        part, paper = PAPER_ABLATIONS[run["policy"]]
        for label, column, is_higher_better in _ABLATION_METRICS:
            ours, theirs = float(ref[column].iloc[0]), float(run[column])
            if run["policy"] in ADDS_PART:
                ours, theirs = theirs, ours
            worse = (ours / theirs if theirs else math.nan) if is_higher_better else (
                theirs / ours if ours else math.nan)
            rows.append({"variant": run["label"], "part": part, "load_x": run["load_x"], "metric": label,
                         "worse_x": worse, "paper": paper})
    if capacity is not None and not capacity.empty:
        cap = capacity.groupby("policy")["capacity_per_s"].max()
        for variant, (part, paper) in PAPER_ABLATIONS.items():
            if variant in cap.index and "mars" in cap.index and cap[variant] > 0 and cap["mars"] > 0:
                with_, without = float(cap["mars"]), float(cap[variant])
                if variant in ADDS_PART:
                    with_, without = without, with_
                rows.append({"variant": variant, "part": part, "load_x": math.nan, "metric": "capacity",
                             "worse_x": with_ / without, "paper": paper})
    return pd.DataFrame(rows, columns=["variant", "part", "load_x", "metric", "worse_x", "paper"])


def _ablation_section(results: pd.DataFrame, capacity: pd.DataFrame | None) -> list[str]:
    table = ablation_table(results, capacity)
    if table.empty:
        return []
    parts = ["## Ablations against the paper (MARS §6)", "",
             "How much worse mars is without one part of the paper's design than with it (without / "
             "with for E2E and slowdown, with / without for goodput and capacity; > 1: the part helps), "
             "next to the paper's figure; mars itself runs without the priority coordinator "
             "(mars-mlfq has it). "
             "What each variant switches off: docs/compare.md \"Ablations\".", ""]
    metrics = list(dict.fromkeys(table["metric"]))
    rows = []
    for (variant, load_x), group in table.groupby(["variant", "load_x"], sort=False, dropna=False):
        by_metric = group.set_index("metric")["worse_x"]
        load = "capacity" if pd.isna(load_x) else f"{load_x:g}"
        rows.append([variant, str(group["part"].iloc[0]), load,
                     *(f"{_fmt(by_metric[m])}×" if m in by_metric else "–" for m in metrics),
                     str(group["paper"].iloc[0])])
    parts += [_md_table(["variant", "part", "load", *metrics, "paper"], rows), ""]
    return parts


def best_baselines(results: pd.DataFrame) -> pd.DataFrame:
    """The best baseline run per load and metric (of :data:`METRICS`). Pure.

    Returns:
        Columns ``load_x``, ``column``, ``label``, ``value``: one row per load and metric that some
        successful baseline run has a value for.
    """
    ok = results.loc[(results["status"] == "ok") & results["is_baseline"].astype(bool)]
    rows = []
    for load_x, group in ok.groupby("load_x", sort=True):
        for metric in METRICS:
            if metric.column not in group:
                continue
            values = group.set_index("label")[metric.column].astype("float64").dropna()
            if values.empty:
                continue
            label = values.idxmax() if metric.is_higher_better else values.idxmin()
            rows.append({"load_x": load_x, "column": metric.column, "label": label, "value": values[label]})
    return pd.DataFrame(rows, columns=["load_x", "column", "label", "value"])


_BEST_SHOWN = ("e2e_mean_s", "e2e_p95_s", "e2e_p99_s", goodput_column(3.0), "slowdown_mean",
               ttft_share_column(10.0), "admission_wait_max_s", "reprefill_tokens")
"""Metrics of the "best baseline at each load" table."""


def _best_section(results: pd.DataFrame, is_absolute: bool) -> list[str]:
    best = best_baselines(results)
    if best.empty:
        return []
    metrics = [m for m in METRICS if m.column in _BEST_SHOWN]
    parts = ["## Best baseline at each load (per metric)", "",
             "The best of all baseline runs at that load, per metric: the reference of the "
             "\"best baseline\" ratios below.", ""]
    rows = []
    rates = results.groupby("load_x")["rate_per_s"].first()
    for load_x, group in best.groupby("load_x", sort=True):
        by_column = group.set_index("column")
        load = f"{rates[load_x]:.4g}/s" if is_absolute else f"{load_x:g}×"
        rows.append([load, *(f"{by_column.at[m.column, 'label']} ({_fmt(by_column.at[m.column, 'value'])})"
                             if m.column in by_column.index else "–" for m in metrics)])
    parts += [_md_table(["load", *(m.label for m in metrics)], rows), ""]
    return parts


_HEADROOM = ("e2e_mean_s", "e2e_p95_s", "e2e_p99_s", goodput_column(3.0))
"""Metrics of the headroom table."""


def headroom_table(results: pd.DataFrame, policy_label: str | None = None) -> pd.DataFrame:
    """How far the best baseline and ``policy_label`` are from the unbounded-KV reference. Pure.

    The reference (rows with ``is_reference``) is the same arrivals on an engine with KV for every
    session at once: what no KV policy can beat by managing KV. For each load with a reference row:
    ``room_<metric>`` = best baseline ÷ reference for E2E metrics (reference ÷ best baseline for
    goodput), the largest gain over the best baseline any KV policy could still reach;
    ``policy_<metric>`` = the policy's value in the same direction (≥ 1: worse than the reference).

    Args:
        results: results table (:data:`RESULT_COLUMNS`).
        policy_label: the run label to place (default ``mars+adm``, else ``mars``).

    Returns:
        One row per load: ``load_x``, ``reference_<metric>``, ``room_<metric>``, ``policy_<metric>``
        and ``reference_slowdown_mean``; empty without reference rows.
    """
    ok = results.loc[results["status"] == "ok"]
    is_ref = ok["is_reference"].fillna(False).astype(bool) if "is_reference" in ok else pd.Series(False, ok.index)
    ref, rest = ok.loc[is_ref], ok.loc[~is_ref]
    if ref.empty:
        return pd.DataFrame()
    if policy_label is None:
        policy_label = "mars+adm" if (rest["label"] == "mars+adm").any() else "mars"
    best = best_baselines(rest)
    rows = []
    for load_x, group in ref.groupby("load_x", sort=True):
        r = group.iloc[0]
        row: dict[str, Any] = {"load_x": load_x, "reference_slowdown_mean": r["slowdown_mean"]}
        mine = rest.loc[(rest["load_x"] == load_x) & (rest["label"] == policy_label)]
        for column in _HEADROOM:
            is_higher_better = column.startswith("goodput")
            b = best.loc[(best["load_x"] == load_x) & (best["column"] == column), "value"]
            values = {"room": b.iloc[0] if len(b) else np.nan,
                      "policy": mine[column].iloc[0] if len(mine) else np.nan}
            row[f"reference_{column}"] = r[column]
            for key, v in values.items():
                num, den = (r[column], v) if is_higher_better else (v, r[column])
                row[f"{key}_{column}"] = float(num) / float(den) if den and not pd.isna(den) else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _headroom_section(results: pd.DataFrame, is_absolute: bool) -> list[str]:
    table = headroom_table(results)
    if table.empty:
        return []
    label = "mars+adm" if (results["label"] == "mars+adm").any() else "mars"
    parts = ["## Headroom: the unbounded-KV reference", "",
             "The same arrivals on an engine with KV for every session at once (stock vLLM scheduling; "
             "nothing waits for KV, is preempted or re-prefilled): the physical limit of what managing "
             "KV can reach with this GPU's step times. *Room* = best baseline ÷ reference for E2E "
             "(reference ÷ best baseline for goodput): the largest gain over the best baseline that any "
             f"KV policy could still reach. *{label} ÷ ref.* in the same direction (1.00 = at the limit).", ""]
    rates = results.groupby("load_x")["rate_per_s"].first()
    names = {"e2e_mean_s": "mean", "e2e_p95_s": "P95", "e2e_p99_s": "P99", goodput_column(3.0): "goodput α=3"}
    header = ["load", "reference mean / P95 / P99 E2E (s)", "reference goodput α=3", "reference mean slowdown",
              *(f"room: {names[c]}" for c in _HEADROOM), *(f"{label} ÷ ref.: {names[c]}" for c in _HEADROOM)]
    rows = []
    for _, r in table.iterrows():
        load = f"{rates[r['load_x']]:.4g}/s" if is_absolute else f"{r['load_x']:g}×"
        rows.append([load, " / ".join(_fmt(r[f"reference_{c}"]) for c in _HEADROOM[:3]),
                     _fmt(r[f"reference_{goodput_column(3.0)}"]), _fmt(r["reference_slowdown_mean"]),
                     *(f"{_fmt(r[f'room_{c}'])}×" for c in _HEADROOM),
                     *(f"{_fmt(r[f'policy_{c}'])}×" for c in _HEADROOM)])
    parts += [_md_table(header, rows), ""]
    return parts


def capacity_ratios(capacity: pd.DataFrame) -> pd.DataFrame:
    """``capacity`` with ``vs_best_baseline`` = capacity / the best baseline's on the same GPU. Pure."""
    out = capacity.copy()
    if out.empty:
        return out.assign(vs_best_baseline=pd.Series(dtype="float64"))
    base = out.loc[out["is_baseline"].astype(bool)].groupby("gpu")["capacity_per_s"].max()
    out["vs_best_baseline"] = out["capacity_per_s"] / out["gpu"].map(base).replace(0.0, np.nan)
    return out


def _capacity_section(capacity: pd.DataFrame | None) -> list[str]:
    if capacity is None or capacity.empty:
        return []
    table = capacity_ratios(capacity)
    parts = ["## Capacity at SLO", "",
             "Each policy's own knee: the largest Poisson rate at which every session completes and the "
             "mean slowdown stays within --knee-slowdown (the FCFS base-rate search, run for every policy); "
             "× best baseline = capacity / the highest baseline capacity. '–': no stable rate was found.", ""]
    rows = [[f"{r['label']} ({tag})" if (tag := reference_tag(str(r.get("policy")))) else r["label"],
             f"FAILED: {r['error']}" if isinstance(r.get("error"), str) and r["error"]
             else _fmt(r["capacity_per_s"], 4),
             f"{_fmt(r['vs_best_baseline'])}×",
             "yes" if r["is_bracketed"] else "no (budget spent before a bracket)", str(int(r["num_probes"]))]
            for _, r in table.sort_values("capacity_per_s", ascending=False, na_position="last").iterrows()]
    parts += [_md_table(["run", "capacity (sessions/s)", "× best baseline", "bracketed", "probes"], rows), ""]
    return parts


def _gpu_sections(results: pd.DataFrame, meta: Mapping[str, Any], is_absolute: bool,
                  capacity: pd.DataFrame | None) -> list[str]:
    parts = _absolute_section(results, is_absolute)
    if (results["status"] == "ok").any():
        parts += _best_section(results, is_absolute)
        parts += _headroom_section(results, is_absolute)
        parts += _ratio_section(results, "fcfs", "Ratio vs FCFS")
        parts += _ratio_section(results, "best_baseline", "Ratio vs the best baseline (per metric)")
        parts += _paper_section(results, meta.get("admission"))
        parts += _ablation_section(results, capacity)
    parts += _capacity_section(capacity)
    parts += _replica_section(results)
    return parts


_UNLISTED = frozenset({"interrupted", "is_absolute_rates", "scope"})
"""``meta`` keys that are not printed as bullets."""


def render_summary(results: pd.DataFrame, meta: Mapping[str, Any], capacity: pd.DataFrame | None = None) -> str:
    """The ``summary.md`` text. Pure.

    Args:
        results: results table (:data:`RESULT_COLUMNS`); failed runs appear as ``FAILED`` rows
            and in a "Failed runs" list with their error's last line. With several values in its
            ``gpu`` column every section is repeated per GPU under ``# GPU <name>``.
        meta: ordered ``name -> value`` facts printed first as a bullet list (workload, profile,
            base rate and how it was found, ...); ``is_absolute_rates`` (bool) switches the load
            headers from multipliers to rates; ``scope`` (str) is printed in bold above them: it
            says whether the workload is the full one or ``TRIMMED`` and how; ``interrupted``
            (str), what finished of a sweep that Ctrl-C or SIGTERM stopped, goes first, after
            ``INTERRUPTED``.
        capacity: the capacity table of ``compare --capacity`` (``gpu``, ``label``, ``policy``,
            ``is_baseline``, ``capacity_per_s``, ``is_bracketed``, ``num_probes``), or ``None``.
    """
    is_absolute = bool(meta.get("is_absolute_rates", False))
    results = results.reindex(columns=[*RESULT_COLUMNS, *(c for c in results.columns if c not in RESULT_COLUMNS)])
    parts = ["# mars-openhands compare", ""]
    if meta.get("interrupted"):
        parts += [f"**INTERRUPTED**: {meta['interrupted']}.", ""]
    if meta.get("scope"):
        parts += [f"**{meta['scope']}**", ""]
    parts += [f"- **{k}**: {v}" for k, v in meta.items() if k not in _UNLISTED]
    parts += [""]
    has_capacity = capacity is not None and not capacity.empty
    gpus = [g for g in dict.fromkeys([*(results["gpu"] if "gpu" in results else []),
                                      *(capacity["gpu"] if has_capacity else [])]) if isinstance(g, str)]
    if len(gpus) > 1:
        for gpu in gpus:
            cap = capacity.loc[capacity["gpu"] == gpu] if has_capacity else None
            parts += [f"# GPU {gpu}", ""]
            parts += _gpu_sections(results.loc[results["gpu"] == gpu], meta, is_absolute, cap)
    else:
        parts += _gpu_sections(results, meta, is_absolute, capacity)
    parts += _failures_section(results)
    return "\n".join(parts).rstrip() + "\n"


def write_summary(out_dir: str | Path, results: pd.DataFrame, meta: Mapping[str, Any],
                  capacity: pd.DataFrame | None = None) -> Path:
    """Write ``summary.md``, ``results.parquet`` (the results table) and ``run.json`` (``meta``, the
    run's facts: commit, date, command, base rates and how they were found, walls) atomically;
    return the .md path. :mod:`eval.result_blocks` reads the last two."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.parquet.tmp"
    results.to_parquet(tmp, index=False)
    tmp.replace(out_dir / "results.parquet")
    tmp_json = out_dir / "run.json.tmp"
    tmp_json.write_text(json.dumps({"facts": dict(meta)}, indent=1, default=str) + "\n", encoding="utf-8")
    tmp_json.replace(out_dir / "run.json")
    path = out_dir / "summary.md"
    tmp_md = out_dir / "summary.md.tmp"
    tmp_md.write_text(render_summary(results, meta, capacity), encoding="utf-8")
    tmp_md.replace(path)
    return path


def _alphas(results: pd.DataFrame) -> list[float]:
    cols = [c for c in results.columns if c.startswith("goodput_a") and c.endswith("_per_s")]
    return sorted(float(c[len("goodput_a"):-len("_per_s")]) for c in cols)


_LINE_STYLES = (("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-."))


def _line_style(index: int) -> dict[str, Any]:
    """Marker, dash pattern and width of the ``index``-th run label: tied policies (e.g. infercept
    and fcfs) draw on top of each other, so each later line is dashed differently and thinner,
    and the ones below stay visible."""
    marker, linestyle = _LINE_STYLES[index % len(_LINE_STYLES)]
    return {"marker": marker, "linestyle": linestyle, "linewidth": max(0.8, 2.4 - 0.25 * index),
            "markersize": max(3.0, 7.0 - 0.6 * index)}


def write_plots(out_dir: str | Path, results: pd.DataFrame, e2e_by_run: Mapping[str, Sequence[float]],
                is_absolute_rates: bool = False, prefix: str = "", title_prefix: str = "") -> list[Path]:
    """Write the PNG plots (matplotlib, Agg backend) and return their paths.

    * ``e2e_vs_load.png``: mean and P95 E2E against load, one line per run label, ticks at the
      loads, one legend under both panels: as the excess over the unbounded-KV reference (%, log
      axis) when it ran at every load, else in seconds on a log axis; the title names the base
      rate (sessions/s) the loads multiply.
    * ``e2e_cdf.png``: CDF of session E2E (s) at the heaviest load, one line per run; titled
      ``load <x>× base (<rate> sessions/s)`` (``rate <rate> sessions/s`` for absolute rates).
    * ``goodput_vs_alpha.png``: goodput (sessions/s) against α at the heaviest load; titled likewise.

    Args:
        out_dir: where to write.
        results: results table; only successful runs are drawn.
        e2e_by_run: ``run_id ->`` E2E seconds of its completed sessions (for the CDF).
        is_absolute_rates: ``load_x`` holds sessions/s rather than multipliers of a base rate.
        prefix: file-name prefix (``"h100_sxm__"`` when a sweep has several GPUs).
        title_prefix: prepended to every title: what ran, ``"h100_sxm, deepseek_chat_test_1-100
            (74 sessions): "``. Each PNG also carries its title as its ``Title`` text chunk.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = results.loc[results["status"] == "ok"]
    paths: list[Path] = []
    if ok.empty:
        return paths
    heaviest = ok.loc[ok["load_x"] == ok["load_x"].max()]
    style = {label: _line_style(i) for i, label in enumerate(ok["label"].unique())}
    fig = _e2e_vs_load_figure(ok, style, is_absolute_rates, plt)
    fig.suptitle(title_prefix + _sweep_title(ok, is_absolute_rates))
    paths.append(_save(fig, out_dir / f"{prefix}e2e_vs_load.png", plt))
    fig, ax = plt.subplots(figsize=(6, 4))
    for _, r in heaviest.iterrows():
        e2e = np.sort(np.asarray(e2e_by_run.get(r["run_id"], []), dtype=float))
        if e2e.size:
            ax.step(e2e, np.arange(1, e2e.size + 1) / e2e.size, where="post", label=r["label"],
                    linestyle=style[r["label"]]["linestyle"], linewidth=style[r["label"]]["linewidth"])
    ax.set_xlabel("session E2E (s)")
    ax.set_ylabel("CDF")
    ax.set_title(title_prefix + _load_title(heaviest, is_absolute_rates))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / f"{prefix}e2e_cdf.png", plt))
    alphas = _alphas(ok)
    fig, ax = plt.subplots(figsize=(6, 4))
    for _, r in heaviest.iterrows():
        ax.plot(alphas, [r[goodput_column(a)] for a in alphas], label=r["label"], **style[r["label"]])
    ax.set_xlabel("α (SLO = α × ideal E2E)")
    ax.set_ylabel("goodput (sessions/s)")
    ax.set_title(title_prefix + _load_title(heaviest, is_absolute_rates))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / f"{prefix}goodput_vs_alpha.png", plt))
    return paths


AT_LIMIT_PCT = 0.1
"""E2E-vs-load plot: a run at (or, by noise, below) the unbounded-KV limit is drawn at this excess
(%), the floor of the log axis (0 has no place on it)."""


def excess_over_limit_pct(ok: pd.DataFrame, column: str) -> pd.Series | None:
    """Per run of ``ok``: ``(value / the unbounded-KV reference's value at the same load − 1) × 100``,
    how far (%) above the limit the run is; ``None`` when a load has no reference run. Pure.

    Args:
        ok: successful runs (``load_x``, ``is_reference``, ``column``).
        column: a lower-is-better metric (E2E).

    Returns:
        A float Series aligned with ``ok``'s index (0 for the reference itself; negative where a run
        is below the limit, by noise or by a policy that beats FCFS-with-unbounded-KV).
    """
    refs = ok.loc[ok["is_reference"].astype(bool)] if "is_reference" in ok else ok.iloc[:0]
    ref = refs.drop_duplicates("load_x").set_index("load_x")[column].astype("float64")
    if ref.empty or not set(ok["load_x"]) <= set(ref.index):
        return None
    return (ok[column].astype("float64") / ok["load_x"].map(ref).replace(0.0, np.nan) - 1.0) * 100.0


def _e2e_vs_load_figure(ok: pd.DataFrame, style: Mapping[str, dict[str, Any]], is_absolute_rates: bool,
                        plt: Any) -> Any:
    """Mean and P95 E2E against load, one line per run label, one legend for both panels.

    With the unbounded-KV reference at every load each run is drawn as its excess over it (%:
    :func:`excess_over_limit_pct`) on a log axis, the limit itself a dotted line at the floor: in
    seconds, FCFS's collapse (10× the limit) squeezed mars, thunderagent and the limit (within
    a few % of each other) into one line, and a ratio on a linear axis still does; on a log axis
    of the excess 4% and 8% sit a third of a decade apart. Without the reference: seconds on a log
    axis. Loads sit at evenly spaced positions ticked with their values (``1×``, ``1.2×`` or the
    rates); each label is shifted a little sideways, so equal values stay visible.
    """
    from matplotlib.ticker import FuncFormatter

    columns = ("e2e_mean_s", "e2e_p95_s")
    excess = {c: excess_over_limit_pct(ok, c) for c in columns}
    is_vs_limit = all(v is not None for v in excess.values())
    references = set(ok.loc[ok["is_reference"].astype(bool), "label"]) if "is_reference" in ok else set()
    labels = [lab for lab in style if not (is_vs_limit and lab in references)]
    loads = sorted(ok["load_x"].unique())
    position = {load: i for i, load in enumerate(loads)}
    width = 0.5 / max(len(labels), 1)  # the labels of one load spread over half a slot
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for i, label in enumerate(labels):
        group = ok.loc[ok["label"] == label].sort_values("load_x")
        x = [position[v] + (i - (len(labels) - 1) / 2) * width for v in group["load_x"]]
        for ax, column in zip(axes, columns, strict=True):
            y = excess[column].loc[group.index].clip(lower=AT_LIMIT_PCT) if is_vs_limit else group[column]
            ax.plot(x, y, label=label, **style[label])
    rates = ok.groupby("load_x")["rate_per_s"].first()
    ticks = [f"{rates[v]:.3g}/s" if is_absolute_rates else f"{v:g}×" for v in loads]
    for ax, name in zip(axes, ("mean E2E", "P95 E2E"), strict=True):
        ax.set_yscale("log")
        if is_vs_limit:
            ax.axhline(AT_LIMIT_PCT, color="0.35", linestyle=":", linewidth=1.2,
                       label=f"{'/'.join(sorted(references))}: the limit (runs at or below it on this line)")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
            ax.set_ylabel(f"{name} above the unbounded-KV\nlimit (%, log scale)")
        else:
            ax.set_ylabel(f"{name} (s, log)")
        ax.set_xticks(range(len(loads)), ticks)
        ax.set_xlim(-0.5, len(loads) - 0.5)
        ax.set_xlabel("arrival rate (sessions/s)" if is_absolute_rates else "load (× base rate)")
        ax.grid(alpha=0.3, which="both")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=7, frameon=False)
    fig.subplots_adjust(bottom=0.18 + 0.05 * ((len(names) - 1) // 6), wspace=0.3)
    return fig


def _load_title(runs: pd.DataFrame, is_absolute_rates: bool) -> str:
    """``"load 1.2× base (0.183 sessions/s)"`` (or ``"rate 0.05 sessions/s"``) of runs at one load. Pure."""
    return _load_header(float(runs["load_x"].iloc[0]), float(runs["rate_per_s"].iloc[0]),
                        is_absolute_rates).removeprefix("### ")


def _sweep_title(runs: pd.DataFrame, is_absolute_rates: bool) -> str:
    """Title of the E2E-vs-load plot: the base rate the loads multiply (or that rates are absolute). Pure."""
    if is_absolute_rates:
        return "E2E vs arrival rate (absolute rates, no base rate)"
    base = (runs["rate_per_s"].astype(float) / runs["load_x"].astype(float)).median()
    return f"E2E vs load (base rate {base:.4g} sessions/s)"


def _save(fig: Any, path: Path, plt: Any) -> Path:
    """Save ``fig`` as PNG with its title in the file's ``Title`` text chunk (what a viewer lists,
    and what the tests read back), then close it."""
    title = fig._suptitle.get_text() if fig._suptitle is not None else fig.axes[0].get_title()
    if not fig.legends:  # a figure-level legend sits below the axes; tight_layout would overlap it
        fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Title": title})
    plt.close(fig)
    return path
