"""Summary tables, ratios and plots of the compare results directory (eval/report.py)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from eval.report import (
    METRICS,
    goodput_column,
    headroom_table,
    paper_comparison,
    ratio_table,
    render_summary,
    write_plots,
    write_summary,
)


def _row(label: str, policy: str, load_x: float, e2e: float, goodput: float, *, adm: bool = False,
         baseline: bool = True, status: str = "ok", reference: bool = False) -> dict:
    row = {"run_id": f"{label}__load{load_x:g}", "label": label, "policy": policy,
           "is_admission_enabled": adm, "is_baseline": baseline, "is_reference": reference, "load_x": load_x,
           "rate_per_s": 0.1 * load_x, "status": status, "error": "" if status == "ok" else "RuntimeError: boom",
           "wall_s": 1.0, "num_sessions": 4, "num_completed": 4, "makespan_s": 10.0}
    for m in METRICS:
        row[m.column] = e2e if not m.is_higher_better else goodput
    row[goodput_column(1.0)] = goodput / 2
    if status != "ok":
        for m in METRICS:
            row[m.column] = math.nan
    return row


@pytest.fixture
def results() -> pd.DataFrame:
    return pd.DataFrame([
        _row("fcfs", "fcfs", 0.5, 10.0, 1.0),
        _row("fcfs+adm", "fcfs", 0.5, 20.0, 0.5, adm=True),
        _row("autellix", "autellix", 0.5, 8.0, 2.0),
        _row("mars", "mars", 0.5, 4.0, 4.0, baseline=False),
        _row("fcfs", "fcfs", 1.0, 40.0, 0.25),
        _row("autellix", "autellix", 1.0, 50.0, 0.5),
        _row("mars", "mars", 1.0, 10.0, 1.0, baseline=False),
        _row("continuum", "continuum", 1.0, 0.0, 0.0, status="failed"),
    ])


def test_ratio_vs_fcfs_uses_fcfs_without_admission_at_the_same_load(results: pd.DataFrame) -> None:
    ratios = ratio_table(results, "fcfs").set_index(["label", "load_x"])
    assert ratios.loc[("mars", 0.5), "e2e_mean_s"] == pytest.approx(0.4)
    assert ratios.loc[("mars", 1.0), "e2e_mean_s"] == pytest.approx(0.25)
    assert ratios.loc[("fcfs+adm", 0.5), "e2e_p95_s"] == pytest.approx(2.0)
    assert ratios.loc[("mars", 0.5), goodput_column(3.0)] == pytest.approx(4.0)
    assert ("continuum", 1.0) not in ratios.index  # failed runs have no ratio


def test_ratio_vs_best_baseline_picks_the_best_per_metric_direction(results: pd.DataFrame) -> None:
    ratios = ratio_table(results, "best_baseline").set_index(["label", "load_x"])
    # load 0.5: best baseline E2E = autellix 8 (lowest), best goodput = autellix 2 (highest)
    assert ratios.loc[("mars", 0.5), "e2e_mean_s"] == pytest.approx(4.0 / 8.0)
    assert ratios.loc[("mars", 0.5), goodput_column(3.0)] == pytest.approx(4.0 / 2.0)
    # load 1.0: fcfs (40) beats autellix (50) on E2E; autellix (0.5) beats fcfs on goodput
    assert ratios.loc[("mars", 1.0), "e2e_mean_s"] == pytest.approx(10.0 / 40.0)
    assert ratios.loc[("mars", 1.0), goodput_column(3.0)] == pytest.approx(1.0 / 0.5)
    assert ratios.loc[("fcfs", 1.0), "e2e_mean_s"] == pytest.approx(1.0)


def test_unknown_reference_is_an_error(results: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match="best_baseline"):
        ratio_table(results, "best")


def test_summary_has_a_row_per_run_and_lists_failures(results: pd.DataFrame) -> None:
    text = render_summary(results, {"base rate": "0.1 sessions/s (given)"})
    assert "- **base rate**: 0.1 sessions/s (given)" in text
    absolute = text.split("## Ratio vs FCFS")[0]
    for _, r in results.iterrows():
        header = f"### load {r['load_x']:g}× base"
        section = absolute.split(header)[1].split("###")[0]
        assert f"| {r['label']} |" in section
    assert "| continuum | FAILED |" in absolute
    assert "## Failed runs" in text and "`continuum__load1`: RuntimeError: boom" in text
    assert "## Ratio vs the best baseline" in text
    # 3 successful runs at load 1 in each ratio table (the failed one is absent)
    best = text.split("## Ratio vs the best baseline")[1].split("### load 1")[1].split("## Against")[0]
    assert best.count("\n| ") == 4  # header + 3 rows
    assert "| mars | 0.25 |" in best


def test_write_summary_and_plots(tmp_path, results: pd.DataFrame) -> None:
    md = write_summary(tmp_path, results, {})
    assert md.read_text().startswith("# mars-openhands compare")
    assert len(pd.read_parquet(tmp_path / "results.parquet")) == len(results)
    e2e = {r: [1.0, 2.0, 3.0] for r in results["run_id"]}
    paths = write_plots(tmp_path, results, e2e)
    assert sorted(p.name for p in paths) == ["e2e_cdf.png", "e2e_vs_load.png", "goodput_vs_alpha.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_no_successful_run_writes_no_plot_but_a_summary(tmp_path, results: pd.DataFrame) -> None:
    failed = results.assign(status="failed", error="ValueError: x")
    assert write_plots(tmp_path, failed, {}) == []
    text = render_summary(failed, {})
    assert "Ratio vs FCFS" not in text and text.count("FAILED") == len(failed)


def test_paper_comparison_gains_at_the_heaviest_load(results: pd.DataFrame) -> None:
    """Load 1.0 (heaviest): baselines fcfs (E2E 40, goodput 0.25) and autellix (50, 0.5); the
    failed continuum run is ignored. mars: E2E 10, goodput 1."""
    table = paper_comparison(results).set_index("metric")
    assert table.loc["mean E2E", "vs_best"] == pytest.approx(4.0)  # fcfs 40 / mars 10
    assert table.loc["mean E2E", "best_baseline"] == "fcfs"
    assert table.loc["mean E2E", "vs_worst"] == pytest.approx(5.0)  # autellix 50 / 10
    assert table.loc["goodput α=3", "vs_best"] == pytest.approx(2.0)  # mars 1 / autellix 0.5
    assert table.loc["goodput α=3", "paper"] == "2–7.56×"
    assert "Against the paper" in render_summary(results, {})


def test_paper_comparison_compares_each_gpu_with_its_own_baselines(results: pd.DataFrame) -> None:
    """A two-GPU table has every label twice; it raised 'The truth value of a Series is ambiguous'.
    On the second GPU every E2E is halved for the baselines only: mars gains twice less there."""
    other = results.assign(gpu="h200_sxm")
    other.loc[other["is_baseline"], "e2e_mean_s"] /= 2
    table = paper_comparison(pd.concat([results.assign(gpu="h100_sxm"), other], ignore_index=True))
    e2e = table.loc[table["metric"] == "mean E2E"].set_index("gpu")
    assert e2e.at["h100_sxm", "vs_best"] == pytest.approx(4.0)  # fcfs 40 / mars 10
    assert e2e.at["h200_sxm", "vs_best"] == pytest.approx(2.0)  # fcfs 20 / mars 10
    assert e2e.at["h200_sxm", "vs_worst"] == pytest.approx(2.5)  # autellix 25 / mars 10
    assert "gpu" not in paper_comparison(results.assign(gpu="h100_sxm"))  # one GPU: as before


def test_paper_comparison_is_empty_without_mars(results: pd.DataFrame) -> None:
    assert paper_comparison(results.loc[results["policy"] != "mars"]).empty


def test_ratio_tables_label_ratios_not_units(results: pd.DataFrame) -> None:
    text = render_summary(results, {})
    absolute, ratios = text.split("## Ratio vs FCFS")
    assert "| mean E2E (s) |" in absolute and "| goodput α=3 (sess/s) |" in absolute
    assert "mean E2E (ratio)" in ratios and "goodput α=3 (ratio)" in ratios
    assert "(s)" not in ratios and "(sess/s)" not in ratios


def test_paper_section_says_which_runs_had_the_admission_window(results: pd.DataFrame) -> None:
    with_window = results.assign(is_admission_enabled=results["policy"] == "mars")
    text = render_summary(with_window, {"admission": "auto"})
    paper = text.split("## Against the paper")[1]
    assert "Gateway admission window under `--admission auto`" in paper
    assert "on for mars; off for fcfs, autellix." in paper
    assert text.count("design.md §") == 1 and "design.md §7 (../shared/docs/design.md)" in text
    off = render_summary(results, {"admission": "off"}).split("## Against the paper")[1]
    assert "`--admission off`" in off and "on for no run; off for fcfs, autellix, mars." in off


def test_plot_titles_name_the_load_and_the_base_rate(tmp_path, results: pd.DataFrame, monkeypatch) -> None:
    import eval.report as report

    titles: dict[str, list[str]] = {}

    def capture(fig, path, plt):
        suptitle = fig._suptitle.get_text() if fig._suptitle is not None else ""
        titles[path.name] = [suptitle, *(ax.get_title() for ax in fig.axes)]
        plt.close(fig)
        return path

    monkeypatch.setattr(report, "_save", capture)
    write_plots(tmp_path, results, {r: [1.0, 2.0] for r in results["run_id"]})
    assert titles["e2e_cdf.png"][1] == "load 1× base (0.1 sessions/s)"
    assert titles["goodput_vs_alpha.png"][1] == "load 1× base (0.1 sessions/s)"
    assert "base rate 0.1 sessions/s" in titles["e2e_vs_load.png"][0]
    write_plots(tmp_path, results, {r: [1.0, 2.0] for r in results["run_id"]}, is_absolute_rates=True)
    assert titles["e2e_cdf.png"][1] == "rate 0.1 sessions/s"
    assert "absolute" in titles["e2e_vs_load.png"][0]


def test_headroom_is_the_best_baseline_and_mars_against_the_unbounded_kv_reference(results) -> None:
    with_ref = pd.concat([results, pd.DataFrame([
        _row("unbounded-kv", "unbounded-kv", 1.0, 32.0, 0.75, baseline=False, reference=True)])])
    table = headroom_table(with_ref).set_index("load_x")
    assert list(table.index) == [1.0]  # only loads with a reference row
    # best baseline at 1.0: fcfs E2E 40 (vs 32: room 1.25x), autellix goodput 0.5 (vs 0.75: 1.5x)
    assert table.at[1.0, "room_e2e_mean_s"] == pytest.approx(40.0 / 32.0)
    assert table.at[1.0, f"room_{goodput_column(3.0)}"] == pytest.approx(0.75 / 0.5)
    # mars (10 s, goodput 1.0) is better than the reference here: below 1 in both directions
    assert table.at[1.0, "policy_e2e_mean_s"] == pytest.approx(10.0 / 32.0)
    assert table.at[1.0, f"policy_{goodput_column(3.0)}"] == pytest.approx(0.75 / 1.0)
    # the reference is not a baseline: the best-baseline ratios ignore it
    assert ratio_table(with_ref, "best_baseline").set_index(["label", "load_x"]).loc[
        ("fcfs", 1.0), "e2e_mean_s"] == pytest.approx(1.0)
    summary = render_summary(with_ref, {})
    assert "## Headroom: the unbounded-KV reference" in summary and "| 1× | 32.0 / 32.0 / 32.0 |" in summary
    assert headroom_table(results).empty and "Headroom" not in render_summary(results, {})


def test_e2e_vs_load_ticks_the_loads_keeps_close_lines_apart_and_has_one_legend(tmp_path, results,
                                                                              monkeypatch) -> None:
    import eval.report as report

    figures = {}

    def capture(fig, path, plt):
        figures[path.name] = fig
        return path

    monkeypatch.setattr(report, "_save", capture)
    ok = results.loc[results["status"] == "ok"]
    write_plots(tmp_path, results, {r: [1.0] for r in results["run_id"]}, title_prefix="h100_sxm, traces (4 sessions): ")
    fig = figures["e2e_vs_load.png"]
    assert fig._suptitle.get_text().startswith("h100_sxm, traces (4 sessions): E2E vs load")
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0.5×", "1×"]  # the loads, no fine ticks
        assert ax.get_legend() is None  # one legend for both panels, on the figure
        xs = [tuple(line.get_xdata()) for line in ax.get_lines()]
        assert len(set(xs)) == len(xs)  # each label at its own offset: equal values cannot hide
    assert len(fig.legends) == 1
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(ok["label"].unique())
    for name in ("e2e_cdf.png", "goodput_vs_alpha.png"):
        assert figures[name].axes[0].get_title().startswith("h100_sxm, traces (4 sessions): load 1× base")


def test_plots_carry_their_title_in_the_png(tmp_path, results) -> None:
    from PIL import Image

    paths = write_plots(tmp_path, results, {r: [1.0] for r in results["run_id"]}, title_prefix="gpu x, w: ")
    titles = {p.name: Image.open(p).text["Title"] for p in paths}
    assert titles["e2e_vs_load.png"].startswith("gpu x, w: E2E vs load (base rate 0.1 sessions/s)")
    assert titles["e2e_cdf.png"] == "gpu x, w: load 1× base (0.1 sessions/s)"


def test_counts_print_with_separators_in_every_table(results) -> None:
    results = results.assign(reprefill_tokens=17_500_000)  # ints, as the runs record them
    text = render_summary(results, {})
    assert "17,500,000" in text and "17500000" not in text


def test_the_paper_table_has_p99(results) -> None:
    table = paper_comparison(results)
    assert "P99 E2E" in set(table["metric"])
    assert "| mars | P99 E2E |" in render_summary(results, {})


def test_e2e_vs_load_draws_the_excess_over_the_unbounded_kv_limit_not_seconds(tmp_path, monkeypatch) -> None:
    """FCFS's collapse (10× the limit) must not squeeze mars (4% above the limit), thunderagent (8%)
    and the limit into one line: each run is drawn as its excess over the limit at that load, on a
    log axis, and the limit is its own line. Fails if the plot draws seconds (or a linear ratio)."""
    import eval.report as report
    from eval.report import AT_LIMIT_PCT, excess_over_limit_pct

    runs = pd.DataFrame([
        _row("fcfs", "fcfs", 1.0, 2170.0, 0.1), _row("fcfs", "fcfs", 1.2, 2260.0, 0.1),
        _row("thunderagent", "thunderagent", 1.0, 234.36, 0.2), _row("thunderagent", "thunderagent", 1.2, 244.08, 0.2),
        _row("mars+adm", "mars", 1.0, 225.68, 0.2, adm=True, baseline=False),
        _row("mars+adm", "mars", 1.2, 226.0, 0.2, adm=True, baseline=False),
        _row("unbounded-kv", "unbounded-kv", 1.0, 217.0, 0.2, baseline=False, reference=True),
        _row("unbounded-kv", "unbounded-kv", 1.2, 226.0, 0.2, baseline=False, reference=True)])
    ok = runs.loc[runs["status"] == "ok"]
    excess = excess_over_limit_pct(ok, "e2e_mean_s")
    assert excess.tolist() == pytest.approx([900.0, 900.0, 8.0, 8.0, 4.0, 0.0, 0.0, 0.0])
    figures = {}
    monkeypatch.setattr(report, "_save", lambda fig, path, plt: figures.setdefault(path.name, fig) and path)
    write_plots(tmp_path, runs, {r: [1.0] for r in runs["run_id"]})
    fig = figures["e2e_vs_load.png"]
    for ax in fig.axes:
        assert ax.get_yscale() == "log" and "above the unbounded-KV" in ax.get_ylabel()
        drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
        assert drawn["fcfs"] == pytest.approx([900.0, 900.0])
        assert drawn["thunderagent"] == pytest.approx([8.0, 8.0])
        assert drawn["mars+adm"] == pytest.approx([4.0, AT_LIMIT_PCT])  # at the limit: on the floor line
        assert "unbounded-kv" not in drawn  # the limit is the dotted floor line, not a run's line
        assert any("the limit" in name for name in drawn)
    assert fig.legends[0].get_texts()[-1].get_text().startswith("unbounded-kv: the limit")
    # without the reference at every load: seconds, on a log axis
    figures.clear()
    write_plots(tmp_path, runs.loc[~runs["is_reference"] | (runs["load_x"] == 1.0)], {r: [1.0] for r in runs["run_id"]})
    ax = figures["e2e_vs_load.png"].axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "mean E2E (s, log)"
    assert {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}["fcfs"] == [2170.0, 2260.0]
