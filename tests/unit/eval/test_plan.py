"""``mars-openhands plan`` (eval/plan.py): its arguments and their one-line errors, the plan table and
its text, and a whole plan on a tiny trace slice (in process, seconds)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from compare_helpers import small_workload

import eval.sweep as sweep_module
from eval.cache import ResultCache
from eval.cli import main
from eval.plan import DEFAULT_PLAN_POLICIES, plan_table, render_plan
from eval.pool import Pool
from eval.sweep_options import CompareOptions, GpuSetup

TRACE_FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"


def _error(capsys, argv: list[str]) -> str:
    """The one stderr line of ``mars-openhands plan ARGV`` that must fail with exit 2."""
    try:
        code = main(["plan", *argv])
    except SystemExit as e:  # argparse's own errors (choices, types, exclusive flags)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mars-openhands plan: error: "), err
    return err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--gpu", "a100"], "--gpu: unknown GPU 'a100'; choose one of h100_nvl, h100_sxm, h200_nvl, h200_sxm"),
    (["--model", "llama-70b"], "--model: unknown model 'llama-70b'; choose one of gpt-oss-120b"),
    (["--model", "qwen3-coder-30b-a3b-instruct/fp8"], "--model: qwen3-coder-30b-a3b-instruct has no 'fp8' weights"),
    (["--policies", "fcfs,sjf"], "--policies: unknown policy 'sjf'; supported: fcfs,"),
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype: invalid choice: 'fp4'"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: expected a fraction in (0, 1]"),
    (["--synthetic", "chatbot"], "--synthetic: invalid choice: 'chatbot'"),
    (["--load", "1", "--rate", "0.1"], "--rate: not allowed with argument --load"),
    (["--rate", "-0.1"], "--rate: "),
    (["--slo-slowdown", "1"], "--slo-slowdown: must be > 1"),
    (["--tool-workers", "0"], "--tool-workers: "),
    (["--traces", "x", "--synthetic", "swebench"], "--synthetic: not allowed with argument --traces"),
    (["--mars-config", "{\"residency\": {\"order\": \"lifo\"}}"], "--mars-config: invalid --additional-config mars: "
     "mars.residency.order: Input should be 'fifo' or 'response-ratio'"),
    (["--mars-config", "[]"], "--mars-config: expected a JSON object"),
    (["--policies", "fcfs,continuum", "--mars-config", "{\"residency\": {\"order\": \"fifo\"}}",
      "--traces", "no-such-traces"],  # (a missing folder: checked after the flags, so no plan runs)
     "--mars-config: only the mars policies take it"),  # it reached no policy, silently
])
def test_bad_input_is_one_line_naming_the_flag_and_writes_nothing(capsys, tmp_path, argv, expected) -> None:
    out = tmp_path / "out"
    err = _error(capsys, [*argv, "--out", str(out)])
    assert expected in err
    assert not out.exists()


def test_an_empty_or_missing_trace_folder_is_one_line_naming_it(capsys, tmp_path) -> None:
    out = tmp_path / "out"
    err = _error(capsys, ["--traces", str(TRACE_FIXTURES / "empty"), "--out", str(out)])
    assert f"--traces: {TRACE_FIXTURES / 'empty'}: no usable trajectory found" in err
    err = _error(capsys, ["--traces", str(tmp_path / "nowhere"), "--out", str(out)])
    assert "--traces: trace folder" in err and "does not exist" in err
    err = _error(capsys, ["--workload", str(tmp_path / "none.json"), "--out", str(out)])
    assert f"--workload {tmp_path / 'none.json'}: " in err
    assert not out.exists()


def test_help_explains_every_input(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--gpu", "--model", "--kv-cache-dtype", "--gpu-memory-utilization", "--tool-workers", "--traces",
                 "--workload", "--synthetic", "--synthetic-sessions", "--policies", "--load", "--rate",
                 "--slo-slowdown", "--knee-tolerance", "--search-runs", "--seed", "--jobs", "--no-cache",
                 "--cache-dir", "--out", "--sessions", "--max-turns", "--host-kv-gib", "--mars-config"):
        assert f"{flag} " in text, flag
    assert "--host-kv-gib " in text and "mars -> mars-offload" in text  # the host tier, explained
    assert "not modelled yet" not in text.lower()
    assert "capacity at SLO" in text and "unbounded-kv limit" in text
    assert ",".join(DEFAULT_PLAN_POLICIES) in text.replace(", ", ",").replace("vllm- tuned", "vllm-tuned")


def _results_and_capacity() -> tuple[pd.DataFrame, pd.DataFrame]:
    rows = [("fcfs", "fcfs", 400.0, 300.0, 1.8), ("mars+adm", "mars", 220.0, 200.0, 1.2),
            ("unbounded-kv", "unbounded-kv", 200.0, 190.0, 1.1), ("vllm-tuned", "vllm-tuned", math.nan, math.nan, math.nan)]
    results = pd.DataFrame([{"label": lab, "policy": pol, "rate_per_s": 0.01, "e2e_p95_s": p95, "e2e_mean_s": mean,
                             "slowdown_mean": sd, "num_completed": 74 if p95 == p95 else 0, "num_sessions": 74,
                             "status": "ok" if p95 == p95 else "failed"} for lab, pol, p95, mean, sd in rows])
    capacity = pd.DataFrame([
        {"label": "fcfs", "capacity_per_s": 0.01, "is_bracketed": True, "first_unstable_per_s": 0.011, "num_probes": 6},
        {"label": "mars+adm", "capacity_per_s": 0.015, "is_bracketed": True, "first_unstable_per_s": 0.016,
         "num_probes": 5},
        {"label": "unbounded-kv", "capacity_per_s": 0.02, "is_bracketed": True, "first_unstable_per_s": 0.021,
         "num_probes": 8},
        {"label": "vllm-tuned", "capacity_per_s": math.nan, "is_bracketed": False, "first_unstable_per_s": math.nan,
         "num_probes": 8}])
    return results, capacity


def test_plan_table_orders_policies_the_limit_last_and_divides_by_the_limit() -> None:
    results, capacity = _results_and_capacity()
    table = plan_table(results, capacity, ("fcfs", "vllm-tuned", "mars", "unbounded-kv")).set_index("label")
    assert list(table.index) == ["fcfs", "vllm-tuned", "mars+adm", "unbounded-kv"]
    assert table.at["mars+adm", "capacity_vs_limit"] == pytest.approx(0.75)
    assert table.at["fcfs", "p95_vs_limit"] == pytest.approx(2.0)
    assert table.at["mars+adm", "mean_vs_limit"] == pytest.approx(200 / 190)
    assert table.at["fcfs", "capacity_per_h"] == pytest.approx(36.0)
    assert table.at["unbounded-kv", "is_limit"] and not table.at["fcfs", "is_limit"]
    assert math.isnan(table.at["vllm-tuned", "capacity_vs_limit"])
    text = render_plan(table.reset_index(), {"scope": "Full workload: x.", "GPU": "h100_sxm"})
    assert text.startswith("# mars-openhands plan\n\n**Full workload: x.**\n\n- **GPU**: h100_sxm")
    assert "## Capacity at SLO, and E2E at 0.01 sessions/s" in text
    assert "| mars+adm | 0.015 | 54.0 | 0.75× | 0.016 | 220 | 1.10× | 200 | 1.05× | 1.20 | 74/74 |" in text
    assert "| unbounded-kv (limit) | 0.02 | 72.0 | 1.00× | 0.021 |" in text
    assert "| vllm-tuned | none stable | – | – | not found (budget spent) | – | – | – | – | – | FAILED |" in text


def test_an_unbracketed_search_is_shown_as_a_lower_bound_without_a_ratio() -> None:
    results, capacity = _results_and_capacity()
    capacity.loc[capacity["label"] == "fcfs", ["is_bracketed", "first_unstable_per_s"]] = [False, math.nan]
    table = plan_table(results, capacity, ("fcfs", "vllm-tuned", "mars", "unbounded-kv")).set_index("label")
    assert math.isnan(table.at["fcfs", "capacity_vs_limit"]) and table.at["mars+adm", "capacity_vs_limit"] > 0
    assert "| fcfs | ≥ 0.01 | 36.0 | – |" in render_plan(table.reset_index(), {})
    capacity.loc[capacity["label"] == "unbounded-kv", "is_bracketed"] = False  # the limit itself a lower bound
    table = plan_table(results, capacity, ("fcfs", "vllm-tuned", "mars", "unbounded-kv"))
    assert table["capacity_vs_limit"].isna().all()


def test_the_tier_bound_is_tagged_as_a_bound_not_the_limit() -> None:
    results, capacity = _results_and_capacity()
    results = pd.concat([results, results.loc[results["label"] == "mars+adm"].assign(
        label="mars-offload-free+adm", policy="mars-offload-free")], ignore_index=True)
    capacity = pd.concat([capacity, capacity.loc[capacity["label"] == "mars+adm"].assign(
        label="mars-offload-free+adm")], ignore_index=True)
    table = plan_table(results, capacity, ("fcfs", "vllm-tuned", "mars", "mars-offload-free", "unbounded-kv"))
    assert not table.set_index("label").at["mars-offload-free+adm", "is_limit"]
    text = render_plan(table, {})
    assert "| mars-offload-free+adm (free copies (tier bound)) | 0.015 | 54.0 | 0.75× |" in text
    assert "| unbounded-kv (limit) | 0.02 |" in text


def test_a_plan_on_a_tiny_trace_slice_answers_every_policy_next_to_the_limit(sim, tmp_path, capsys) -> None:
    out = tmp_path / "plan"
    code = main(["plan", "--traces", str(TRACE_FIXTURES / "good"), "--max-turns", "2", "--jobs", "1",
                 "--policies", "fcfs,mars", "--search-runs", "2", "--no-cache", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    table = pd.read_parquet(out / "plan.parquet").set_index("label")
    assert list(table.index) == ["fcfs", "mars+adm", "unbounded-kv"]  # the limit always added, last
    assert (table["status"] == "ok").all() and (table["num_completed"] == 2).all()
    assert (table["capacity_per_s"] > 0).all() and (table["num_probes"] <= 2).all()
    limit = table.loc["unbounded-kv"]
    assert table["p95_vs_limit"].tolist() == pytest.approx((table["e2e_p95_s"] / limit["e2e_p95_s"]).tolist())
    if limit["is_bracketed"]:
        ok = table["is_bracketed"].astype(bool)
        assert table.loc[ok, "capacity_vs_limit"].tolist() == pytest.approx(
            (table.loc[ok, "capacity_per_s"] / limit["capacity_per_s"]).tolist())
    assert table.loc[~table["is_bracketed"].astype(bool), "capacity_vs_limit"].isna().all()
    # the chosen rate defaults to 1.0 x FCFS's capacity at SLO; if FCFS's knee search ran out of
    # probes below the knee, 1.0 x its largest stable rate, where FCFS's capacity search started
    rate = table.at["fcfs", "rate_per_s"]
    assert table["rate_per_s"].tolist() == pytest.approx([rate] * 3)
    if table.at["fcfs", "is_bracketed"]:
        assert rate == pytest.approx(table.at["fcfs", "capacity_per_s"])
    else:
        assert rate < table.at["fcfs", "capacity_per_s"]
    text = (out / "plan.md").read_text()
    assert text in printed and text.startswith("# mars-openhands plan\n\n**TRIMMED: ")
    assert "| unbounded-kv (limit) |" in text and "| mars+adm |" in text
    for name in ("capacity.png", "e2e_vs_load.png", "summary.md", "capacity.parquet", "results.parquet"):
        assert (out / name).is_file(), name


def test_a_synthetic_family_is_a_workload_and_trimming_is_labelled() -> None:
    import argparse

    from eval.plan import _workload

    args = argparse.Namespace(synthetic="terminalbench", synthetic_sessions=5, seed=3, workload=None, traces=None,
                              sessions=0, max_turns=0)
    workload, loaded, name, skipped = _workload(args)
    assert len(workload.sessions) == len(loaded.sessions) == 5 and skipped is None
    assert name == "synthetic terminalbench (5 sessions, seed 3)"
    trimmed, _, _, _ = _workload(argparse.Namespace(**{**vars(args), "sessions": 2, "max_turns": 1}))
    assert len(trimmed.sessions) == 2 and trimmed.num_turns == 2


def test_host_kv_gib_adds_each_policys_offload_variant_and_the_scope_names_the_tier(sim, tmp_path, capsys) -> None:
    out = tmp_path / "plan"
    code = main(["plan", "--traces", str(TRACE_FIXTURES / "good"), "--max-turns", "2", "--jobs", "1",
                 "--policies", "fcfs,mars", "--search-runs", "1", "--rate", "0.01", "--host-kv-gib", "64",
                 "--no-cache", "--out", str(out)])
    assert code == 0
    capsys.readouterr()
    table = pd.read_parquet(out / "plan.parquet").set_index("label")
    assert list(table.index) == ["fcfs", "vllm-offload-lru", "mars+adm", "mars-offload+adm", "unbounded-kv"]
    assert (table["num_completed"] == 2).all()
    text = (out / "plan.md").read_text()
    assert "Host KV tier: 64 GiB for vllm-offload-lru, mars-offload" in text


def _capacities_of_identical_policies(tmp_path, monkeypatch, knee_per_s: float, max_runs: int):
    """The sweep's FCFS knee and capacity searches for fcfs, continuum and the limit, with a fake
    probe that is the same for every policy (mean slowdown ``1 + rate / knee_per_s``, no
    simulation; ideal E2E 1 s, so every search starts at 1 session/s). Returns the capacity table
    and the ``(policy, rate)`` of every probe."""
    calls: list[tuple[str, float]] = []

    def probe(workload, options, policy, is_admission_enabled, rate, *args, **kwargs):
        calls.append((policy, rate))
        return 1.0 + rate / knee_per_s, 0.0, None

    monkeypatch.setattr(sweep_module, "probe_task", probe)
    workload = small_workload(2, 2)
    options = CompareOptions(policies=("fcfs", "continuum", "unbounded-kv"), loads=(1.0,), num_gpu_blocks=64,
                             search_max_runs=max_runs, knee_tolerance=1.1, is_capacity=True)
    setup = GpuSetup("g", object(), 64)
    sweep = sweep_module._Sweep(workload, options, (setup,), tmp_path, None, None, None, ResultCache(None), {})
    sweep.ideal = {"g": {s.session_id: 1.0 for s in workload.sessions}}
    with Pool(1) as pool:
        sweep._base_rates(pool)
        capacity = sweep._capacities(pool)
    return capacity, calls


def test_identical_policies_whose_searches_run_out_below_the_knee_show_the_same_lower_bound(
        tmp_path, monkeypatch) -> None:
    # 3 probes from 1/s never reach a knee at 1000/s. FCFS's knee search (1, 2, 4/s) gives the base
    # rate 4/s, where the other searches start (4, 8, 16/s): FCFS's own capacity search must start
    # there too, or its row reads "≥ 4" beside "≥ 16" for the same runs.
    capacity, calls = _capacities_of_identical_policies(tmp_path, monkeypatch, knee_per_s=1000.0, max_runs=3)
    by_label = capacity.set_index("label")
    assert not by_label["is_bracketed"].any()
    assert list(by_label["capacity_per_s"]) == [16.0, 16.0, 16.0]
    assert [r for p, r in calls if p == "fcfs"] == [1.0, 2.0, 4.0, 4.0, 8.0, 16.0]  # knee, then capacity
    results = pd.DataFrame([{"label": lab, "policy": lab, "rate_per_s": 4.0, "e2e_p95_s": 10.0, "e2e_mean_s": 5.0,
                             "slowdown_mean": 1.0, "num_completed": 2, "num_sessions": 2, "status": "ok"}
                            for lab in by_label.index])
    text = render_plan(plan_table(results, capacity, ("fcfs", "continuum", "unbounded-kv")), {})
    assert "| fcfs | ≥ 16.00 |" in text and "| continuum | ≥ 16.00 |" in text, text
    assert "*≥ X* (fcfs, continuum, unbounded-kv): every probe of the search was stable" in text
    assert "they are not ranked against each other" in " ".join(text.split())


def test_a_bracketed_fcfs_knee_search_is_fcfs_capacity_and_is_not_searched_again(tmp_path, monkeypatch) -> None:
    capacity, calls = _capacities_of_identical_policies(tmp_path, monkeypatch, knee_per_s=3.0, max_runs=8)
    by_label = capacity.set_index("label")
    assert by_label["is_bracketed"].all()
    assert sum(p == "fcfs" for p, _ in calls) == by_label.at["fcfs", "num_probes"]  # one search
    assert (by_label["capacity_per_s"] <= 3.0).all() and (by_label["first_unstable_per_s"] > 3.0).all()
    text = render_plan(plan_table(pd.DataFrame([
        {"label": lab, "policy": lab, "rate_per_s": 2.0, "e2e_p95_s": 10.0, "e2e_mean_s": 5.0, "slowdown_mean": 1.0,
         "num_completed": 2, "num_sessions": 2, "status": "ok"} for lab in by_label.index]),
        capacity, ("fcfs", "continuum", "unbounded-kv")), {})
    assert "≥" not in text
