"""benchmarks/bench_tracesets.py: the verdict per (set, seed, load), the report over a grid on disk,
and the compare command lines it runs (issue 30). The grid itself is not run here (``--smoke``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from compare_helpers import benchmark_module


@pytest.fixture(scope="module")
def bt():
    yield from benchmark_module("bench_tracesets")


def _row(label: str, mean: float, p95: float, p99: float, goodput: float, load: float = 1.0,
         done: int = 10, baseline: bool = False) -> dict:
    return dict(label=label, load_x=load, status="ok", is_baseline=baseline, num_sessions=10,
                num_completed=done, e2e_mean_s=mean, e2e_p95_s=p95, e2e_p99_s=p99,
                goodput_a3_per_s=goodput, rate_per_s=0.01 * load)


def _frame(mars: dict, load: float = 1.0) -> pd.DataFrame:
    return pd.DataFrame([
        _row("unbounded-kv", 100.0, 200.0, 300.0, 0.010, load),
        _row("fcfs", 130.0, 260.0, 500.0, 0.008, load, baseline=True),
        _row("thunderagent", 110.0, 240.0, 400.0, 0.0099, load, baseline=True),
        {**_row("mars+adm", 0, 0, 0, 0, load), **mars},
    ])


def test_judge_ratios_against_limit_and_best_baseline(bt):
    v = bt.judge(_frame(dict(e2e_mean_s=104.0, e2e_p95_s=209.0, e2e_p99_s=390.0, goodput_a3_per_s=0.0098)),
                 1.05, 0.98, 1.0)
    assert v.is_ok
    assert v.best_by_goodput == "thunderagent"
    assert v.mean_to_limit == pytest.approx(1.04)
    assert v.p95_to_limit == pytest.approx(1.045)
    assert v.goodput_to_best == pytest.approx(0.0098 / 0.0099)
    assert v.p99_to_best == pytest.approx(390 / 400)  # the lowest P99 of any baseline
    assert v.best_mean_to_limit == pytest.approx(1.10)


@pytest.mark.parametrize("change", [
    dict(e2e_mean_s=106.0),  # mean 1.06× the limit
    dict(e2e_p95_s=212.0),  # P95 1.06×
    dict(goodput_a3_per_s=0.0096),  # 0.97× thunderagent's goodput
    dict(e2e_p99_s=401.0),  # P99 above the best baseline's
    dict(num_completed=9),  # a session left unfinished
])
def test_judge_each_threshold_fails_alone(bt, change):
    ok = dict(e2e_mean_s=104.0, e2e_p95_s=209.0, e2e_p99_s=390.0, goodput_a3_per_s=0.0098)
    assert bt.judge(_frame(ok), 1.05, 0.98, 1.0).is_ok
    assert not bt.judge(_frame({**ok, **change}), 1.05, 0.98, 1.0).is_ok


def test_judge_needs_reference_baseline_and_mars(bt):
    frame = _frame(dict(e2e_mean_s=104.0, e2e_p95_s=209.0, e2e_p99_s=390.0, goodput_a3_per_s=0.0098))
    assert bt.judge(frame[frame["label"] != "unbounded-kv"], 1.05, 0.98, 1.0) is None
    assert bt.judge(frame[frame["label"] != "mars+adm"], 1.05, 0.98, 1.0) is None
    failed = frame.assign(status=["ok", "ok", "ok", "error"])
    assert bt.judge(failed, 1.05, 0.98, 1.0) is None  # a failed mars run is missing, not judged


def test_report_only_over_a_grid_on_disk(bt, tmp_path, capsys):
    good = dict(e2e_mean_s=104.0, e2e_p95_s=209.0, e2e_p99_s=390.0, goodput_a3_per_s=0.0098)
    slow = {**good, "e2e_p95_s": 230.0}
    grid = pd.concat([_frame(good, 1.0), _frame(slow, 1.2)], ignore_index=True)
    (tmp_path / "setA" / "s0").mkdir(parents=True)
    grid.to_parquet(tmp_path / "setA" / "s0" / "results.parquet")
    argv = ["--out", str(tmp_path), "--sets", "setA,setB", "--seeds", "0", "--report-only"]
    assert bt.main(argv) == 1
    out = capsys.readouterr().out
    assert "| 0 | 1× | 1.040 | 1.045 |" in out and "| ok |" in out
    assert "| 0 | 1.2× | 1.040 | 1.150 |" in out and "SHORT" in out
    assert "missing" in out  # setB has no results
    assert "| setA | 1.2× |" in out
    assert "1 of 4 (set, seed, load) points ok" in out


def test_rerun_reuses_base_rate_and_baselines(bt, tmp_path):
    base = tmp_path / "base" / "setA" / "s1"
    base.mkdir(parents=True)
    _frame(dict(e2e_mean_s=104.0, e2e_p95_s=209.0, e2e_p99_s=390.0, goodput_a3_per_s=0.0098)).to_parquet(
        base / "results.parquet")
    assert bt.base_rate(base / "results.parquet") == pytest.approx(0.01)
    args = bt.parse_args(["--baselines-from", str(tmp_path / "base")])
    assert args.policies == "mars"
    cmd = bt.compare_command(args, Path("/t/setA"), 1, tmp_path / "new", bt.base_rate(base / "results.parquet"))
    assert cmd[cmd.index("--base-rate") + 1] == "0.01" and "--no-reference" in cmd
    assert cmd[cmd.index("--seed") + 1] == "1"
    new = tmp_path / "new" / "setA" / "s1"
    new.mkdir(parents=True)
    pd.DataFrame([_row("mars+adm", 101.0, 201.0, 301.0, 0.01)]).to_parquet(new / "results.parquet")
    merged = bt.load_results(tmp_path / "new", "setA", 1, tmp_path / "base")
    assert sorted(merged["label"]) == ["fcfs", "mars+adm", "thunderagent", "unbounded-kv"]
    assert merged.loc[merged["label"] == "mars+adm", "e2e_mean_s"].item() == 101.0  # the new run wins


def test_smoke_trims_and_explicit_flags_win(bt):
    args = bt.parse_args(["--smoke", "--seeds", "2"])
    assert (args.sets, args.seeds, args.sessions, args.max_turns) == ("deepseek_reasoner_dev", "2", 3, 4)
    assert args.out == "runs/tracesets-smoke"
    cmd = bt.compare_command(args, Path("/t/x"), 2, Path("/o"), None)
    assert cmd[cmd.index("--sessions") + 1] == "3" and cmd[cmd.index("--max-turns") + 1] == "4"
    assert "--base-rate" not in cmd
    full = bt.parse_args([])
    assert "--sessions" not in bt.compare_command(full, Path("/t/x"), 0, Path("/o"), None)
    assert full.policies.split(",")[-1] == "mars" and full.seeds == "0,1,2"
