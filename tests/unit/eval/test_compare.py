"""``mars-openhands compare`` on the sim backend (eval/compare.py)."""

from __future__ import annotations

import argparse
import math

import pandas as pd
import pytest

from eval.compare import (
    POLICIES,
    CompareOptions,
    add_compare_subcommand,
    find_base_rate,
    parse_policies,
)
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta


def test_parse_policies_all_and_dedup() -> None:
    assert parse_policies("all") == tuple(POLICIES)
    assert parse_policies("mars, fcfs,mars") == ("mars", "fcfs")


def test_unknown_policy_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError) as info:
        parse_policies("fcfs,marz")
    message = str(info.value)
    assert "'marz'" in message
    for name in POLICIES:
        assert name in message


def test_knee_search_brackets_the_threshold() -> None:
    knee = 0.37
    calls: list[float] = []

    def slowdown(rate: float) -> float:
        calls.append(rate)
        return 1.2 if rate <= knee else 5.0

    search = find_base_rate(slowdown, 0.01, bound=2.0, max_runs=12)
    assert knee / 1.05 <= search.rate_per_s <= knee
    assert len(calls) == len(search.probes) <= 12
    assert all(stable == (r <= knee) for r, _, stable in search.probes)
    assert "largest stable rate" in search.how


def test_knee_search_respects_budget_and_goes_down_when_start_is_unstable() -> None:
    search = find_base_rate(lambda r: math.inf if r > 0.1 else 1.0, 1.0, bound=2.0, max_runs=3)
    assert [p[0] for p in search.probes] == [1.0, 0.5, 0.25]
    assert search.rate_per_s == 0.25 and "no stable rate" in search.how
    search = find_base_rate(lambda r: 1.0, 1.0, bound=2.0, max_runs=3)
    assert search.rate_per_s == 4.0 and "no unstable rate" in search.how


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    return parser


def test_cli_rejects_unsupported_backend_and_unknown_policy(tmp_path, capsys) -> None:
    args = _parser().parse_args(["compare", "--backend", "emulated", "--out", str(tmp_path)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "not yet supported" in err and "sim" in err
    args = _parser().parse_args(["compare", "--policies", "fcfs,nope", "--out", str(tmp_path)])
    assert args.func(args) == 2
    assert "nope" in capsys.readouterr().err


def test_cli_rejects_bad_loads() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["compare", "--loads", "0.5,x"])


# ----------------------------------------------------------------------------- end to end (sim)
def _workload(n: int = 4, turns: int = 3) -> Workload:
    sessions = []
    for i in range(n):
        spec = [Turn(prompt_tokens_appended=200 + 30 * i + 5 * k, output_tokens=12 + i + k,
                     tool_name="bash", tool_duration_s=0.2 + 0.1 * ((i + k) % 3)) for k in range(turns - 1)]
        spec.append(Turn(prompt_tokens_appended=40, output_tokens=8))
        sessions.append(Session(session_id=f"s{i}", arrival_s=0.0, turns=tuple(spec)))
    return Workload(meta=WorkloadMeta(source="test"), sessions=tuple(sessions))


@pytest.fixture(scope="module")
def sim():
    return pytest.importorskip("eval.sim", reason="the sim backend needs vllm")


def test_run_compare_writes_everything_and_survives_a_failing_policy(tmp_path, sim) -> None:
    from eval.compare import run_compare

    def flaky(workload, config, timer, sink=None):
        if config.policy == "MarsScheduler":
            raise RuntimeError("injected failure")
        return sim.simulate(workload, config, timer, sink)

    options = CompareOptions(policies=("fcfs", "mars", "continuum-dy"), loads=(0.5, 2.0),
                             num_gpu_blocks=512, base_rate_per_s=1.0, admission="off")
    results = run_compare(_workload(), options, sim.LinearStepTimeModel(), tmp_path, simulate_fn=flaky)
    assert len(results) == 6
    assert set(zip(results["label"], results["load_x"], strict=True)) == {
        (p, x) for p in ("fcfs", "mars", "continuum-dy") for x in (0.5, 2.0)}
    failed = results.loc[results["status"] == "failed"]
    assert set(failed["label"]) == {"mars"} and failed["error"].str.contains("injected failure").all()
    ok = results.loc[results["status"] == "ok"]
    assert (ok["num_completed"] == 4).all()
    assert (ok["slowdown_mean"] >= 0.99).all() and (ok["e2e_p99_s"] >= ok["e2e_p50_s"]).all()
    assert list(ok["rate_per_s"]) == [0.5, 0.5, 2.0, 2.0]
    for run_id in ok["run_id"]:
        per_session = pd.read_parquet(tmp_path / f"{run_id}.parquet")
        assert len(per_session) == 4 and {"e2e_s", "slowdown", "ideal_s"} <= set(per_session.columns)
    assert not (tmp_path / "mars__load0.5.parquet").exists()
    text = (tmp_path / "summary.md").read_text()
    assert "| mars | FAILED |" in text and "injected failure" in text
    assert "1 sessions/s (given with --base-rate)" in text
    for name in ("e2e_vs_load.png", "e2e_cdf.png", "goodput_vs_alpha.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_run_compare_searches_the_base_rate_and_runs_admission_both(tmp_path, sim) -> None:
    from eval.compare import run_compare

    options = CompareOptions(policies=("fcfs",), loads=(1.0,), num_gpu_blocks=512, admission="both",
                             search_max_runs=3, knee_slowdown=1.5)
    results = run_compare(_workload(), options, sim.LinearStepTimeModel(), tmp_path)
    assert list(results["label"]) == ["fcfs", "fcfs+adm"]
    assert (results["status"] == "ok").all()
    text = (tmp_path / "summary.md").read_text()
    assert "FCFS knee search: 3 runs" in text
    rate = results["rate_per_s"].iloc[0]
    assert f"{rate:.4g} sessions/s" in text


def test_kv_scale_for_trim_is_the_kept_context_share() -> None:
    from eval.compare import kv_scale_for_trim
    from eval.workloads import trim_workload

    full = _workload(n=2, turns=3)
    trimmed = trim_workload(full, max_turns=1)
    kept = sum(s.turns[0].prompt_tokens_appended + s.turns[0].output_tokens for s in full.sessions)
    total = sum(t.prompt_tokens_appended + t.output_tokens for s in full.sessions for t in s.turns)
    assert kv_scale_for_trim(full, trimmed) == pytest.approx(kept / total)
    assert kv_scale_for_trim(full, full) == 1.0
    with pytest.raises(ValueError, match="not in the full workload"):
        kv_scale_for_trim(trim_workload(full, num_sessions=1), full)
