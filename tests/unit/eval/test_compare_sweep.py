"""The main job's sweep (eval/sweep.py, eval/runs.py, eval/pool.py, eval/compare.py, eval/knee.py,
eval/cache.py, eval/report.py): defaults and the TRIMMED label, the knee search, the early-stop
guard, several GPUs, worker processes, the cache, capacity at SLO and the ablation variants. Tiny
workloads and the linear step-time model."""

from __future__ import annotations

import argparse
import math

import pandas as pd
import pytest
from compare_helpers import small_workload

import eval.compare as compare
import eval.runs as runs
import eval.sweep as sweep_module
from eval.backends import parse_backend
from eval.cache import ResultCache, content_key
from eval.compare import DEFAULT_GPUS, add_compare_subcommand
from eval.compare_setup import clear_previous_results, trim_note
from eval.knee import KneeSearch
from eval.policies import (
    ABLATIONS,
    DEFAULT_POLICIES,
    POLICIES,
    QUICK_POLICIES,
    REFERENCE,
    admission_modes,
    parse_policies,
)
from eval.pool import Pool
from eval.report import ablation_table, best_baselines, capacity_ratios, render_summary
from eval.sweep import run_compare, run_sweep
from eval.sweep_options import CompareOptions, GpuSetup
from eval.workloads import trim_workload


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    return parser.parse_args(["compare", *argv])


# ----------------------------------------------------------------------------- defaults, TRIMMED
def test_no_flags_is_the_real_regime_and_quick_is_a_smaller_grid_of_the_same_workload() -> None:
    args = _args([])
    assert (args.sessions, args.max_turns, args.max_context_tokens, args.kv_scale, args.kv_blocks) == (
        0, 0, 0, "1", None)
    compare._apply_defaults(args, parse_backend("sim"))
    assert args.gpu == DEFAULT_GPUS == ("h100_sxm", "h200_sxm")
    assert parse_policies(args.policies) == DEFAULT_POLICIES
    assert {"thunderagent", "vllm-tuned", "continuum", "autellix", "infercept", "fcfs", "mars-preview",
            "mars"} <= set(DEFAULT_POLICIES) and not set(ABLATIONS) & set(DEFAULT_POLICIES)
    assert args.loads == (0.5, 0.8, 1.0, 1.2)
    quick = _args(["--quick"])
    compare._apply_defaults(quick, parse_backend("sim"))
    assert (quick.gpu, quick.loads, parse_policies(quick.policies)) == (
        ("h100_sxm",), (1.0, 1.2), QUICK_POLICIES)
    assert (quick.sessions, quick.max_turns, quick.max_context_tokens, quick.kv_scale) == (0, 0, 0, "1")
    sim = parse_backend("sim")
    assert compare.with_reference(DEFAULT_POLICIES, args, sim)[-1] == REFERENCE
    assert compare.with_reference(QUICK_POLICIES, quick, sim) == QUICK_POLICIES  # the grid only
    asked = _args(["--quick", "--policies", f"fcfs,{REFERENCE}"])
    compare._apply_defaults(asked, sim)
    assert compare.with_reference(parse_policies(asked.policies), asked, sim) == ("fcfs", REFERENCE)
    assert compare.with_reference(DEFAULT_POLICIES, _args(["--no-reference"]), sim) == DEFAULT_POLICIES
    live = _args(["--backend", "emulated"])
    compare._apply_defaults(live, parse_backend("emulated"))
    assert live.gpu == ("h100_sxm",)
    with pytest.raises(ValueError, match="a live backend models one GPU"):
        compare._apply_defaults(_args(["--backend", "cpu", "--gpu", "h100_sxm,h200_sxm"]), parse_backend("cpu"))


def test_trim_note_names_every_cut_and_says_full_otherwise() -> None:
    full = small_workload(4, 5)
    assert trim_note(full, full).startswith("Full workload: all 4 sessions at full length (20 turns)")
    fewer = trim_workload(full, num_sessions=2)
    shorter = trim_workload(full, max_turns=3)
    note = trim_note(full, fewer)
    assert note.startswith("TRIMMED: 2 of 4 sessions") and "turns" not in note.split(".")[0]
    assert trim_note(full, shorter).startswith("TRIMMED: 12 of 20 turns")
    assert "KV × 0.500" in trim_note(full, full, kv_scale=0.5)
    assert "KV 64 blocks of the profile's 100" in trim_note(full, full, kv_blocks=64, profile_blocks=100)
    assert trim_note(full, full, kv_blocks=100, profile_blocks=100).startswith("Full workload")
    assert "tool times × 2" in trim_note(full, full, tool_time_factor=2.0)


def test_summary_puts_the_scope_line_first(tmp_path, sim) -> None:
    options = CompareOptions(policies=("fcfs",), loads=(1.0,), num_gpu_blocks=512, base_rate_per_s=1.0)
    run_sweep(small_workload(2, 2), options, (GpuSetup("g", sim.LinearStepTimeModel(), 512),), tmp_path,
              meta={"scope": "TRIMMED: 2 of 74 sessions"})
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[2] == "**TRIMMED: 2 of 74 sessions**"


# ----------------------------------------------------------------------------- knee search
def test_parallel_knee_search_brackets_in_fewer_rounds_and_stops_at_the_tolerance() -> None:
    knee = 0.37

    def rounds(width: int) -> tuple[int, KneeSearch]:
        search, num_rounds = KneeSearch(0.01, bound=2.0, max_runs=40, tolerance=1.1), 0
        while rates := search.next_rates(width):
            num_rounds += 1
            assert search.next_rates(width) == []  # nothing more until this round is recorded
            for rate in rates:
                search.record(rate, 1.2 if rate <= knee else 5.0)
        return num_rounds, search

    serial, one = rounds(1)
    parallel, two = rounds(3)
    for search in (one, two):
        result = search.result()
        assert knee / 1.1 <= result.rate_per_s <= knee and result.is_bracketed
        lo, hi = result.rate_per_s, min(r for r, _, s in result.probes if not s)
        assert hi / lo <= 1.1  # the early stop: a 10% bracket
    assert parallel < serial and len(one.probes) == 7 + 3  # doublings to 0.64, then 2 -> 1.41 -> 1.19 -> 1.09


def test_a_fine_ladder_near_a_known_knee_brackets_it_without_far_probes() -> None:
    knee = 0.0160

    def search(step: float) -> KneeSearch:
        s = KneeSearch(0.0150, bound=2.0, max_runs=8, tolerance=1.05, step=step)
        while rates := s.next_rates(2):
            for rate in rates:
                s.record(rate, 1.5 if rate <= knee else 3.0)
        return s

    fine, coarse = search(1.05), search(2.0)
    for s in (fine, coarse):
        result = s.result()
        assert knee / 1.05 <= result.rate_per_s <= knee and result.is_bracketed
    assert len(fine.probes) < len(coarse.probes)
    assert max(r for r, _, _ in fine.probes) < 1.1 * knee < max(r for r, _, _ in coarse.probes)
    assert "steps of ×1.05" in fine.result().how and "doubling" in coarse.result().how
    down = KneeSearch(0.0200, bound=2.0, max_runs=8, tolerance=1.05, step=1.05)
    assert down.next_rates(1) == [0.0200]
    down.record(0.0200, 3.0)
    assert down.next_rates(2) == pytest.approx([0.0200 / 1.05, 0.0200 / 1.05 ** 2])
    with pytest.raises(ValueError, match="step > 1"):
        KneeSearch(1.0, 2.0, 3, step=1.0)


def _fake_probe(log: list[tuple[str, float, float]], knee: float):
    """A knee probe of the linear slowdown ``rate / knee + 1``: unstable probes return fast (the
    guard stops them), stable ones slowly; a cancel file stops one at once. A float timer is
    the GPU's knee and speed factor."""
    import os
    import time

    def probe(workload, options, policy, is_admission_enabled, rate, timer, num_blocks, ideal, simulate_fn,
              is_keeping_stream, cancel_path=None):
        log.append(("start", rate, time.monotonic()))
        slowdown = 1.0 + rate / (timer if isinstance(timer, float) else knee)  # a GPU's own knee
        scale = timer if isinstance(timer, float) else 1.0  # a GPU's own speed
        deadline = time.monotonic() + (0.3 if slowdown <= 2.0 else 0.1) * scale
        while time.monotonic() < deadline:
            if cancel_path is not None and os.path.exists(cancel_path):
                log.append(("cancelled", rate, time.monotonic()))
                return math.inf, 0.0, None
            time.sleep(0.005)
        log.append(("end", rate, time.monotonic()))
        return slowdown, 0.1, None

    return probe


def test_idle_workers_run_the_next_rounds_probes_early_and_the_knee_is_the_same(tmp_path, monkeypatch) -> None:
    """With two workers, a round's fast (unstable) probe frees a worker while the slow one runs:
    that worker starts a probe the next round asks for if the slow one ends as guessed. The
    search records the same rounds, so its knee and probes equal the search without guessing."""
    from concurrent.futures import ThreadPoolExecutor

    workload = small_workload(2, 2)
    options = CompareOptions(policies=("fcfs",), loads=(1.0,), num_gpu_blocks=64, search_max_runs=8,
                             knee_tolerance=1.05)
    setup = GpuSetup("g", object(), 64)
    searches, logs = {}, {}
    for mode in ("plain", "speculative"):
        logs[mode] = log = []
        monkeypatch.setattr(sweep_module, "probe_task", _fake_probe(log, knee=0.3))
        if mode == "plain":
            monkeypatch.setattr(sweep_module._Sweep, "_speculate", staticmethod(lambda *args: set()))
        else:
            monkeypatch.undo()
            monkeypatch.setattr(sweep_module, "probe_task", _fake_probe(log, knee=0.3))
        sweep = sweep_module._Sweep(workload, options, (setup,), tmp_path, None, None, None, ResultCache(None), {})
        sweep.ideal = {"g": {s.session_id: 1.0 for s in workload.sessions}}
        pool = Pool(2)
        pool._executor = ThreadPoolExecutor(2)
        try:
            searches[mode] = sweep._searches(pool, [(setup, "fcfs", 0.1)], "knee")[("g", "fcfs")]
        finally:
            pool._executor.shutdown(wait=True)
    plain, fast = searches["plain"], searches["speculative"]
    assert len(plain.probes) > 3 and 0.25 < plain.rate_per_s <= 0.3
    assert fast == plain  # the same rounds, recorded in the same order, the same sentence
    # some probe started before the round it belongs to had begun (its predecessor still running)
    starts = {rate: t for kind, rate, t in logs["speculative"] if kind == "start"}
    ends = {rate: t for kind, rate, t in logs["speculative"] if kind == "end"}
    rounds = [[r for r, _, _ in plain.probes[i:i + 2]] for i in range(0, len(plain.probes), 2)]
    early = [r for prev, cur in zip(rounds, rounds[1:], strict=False) for r in cur
             if starts[r] < max(ends[p] for p in prev)]
    assert early, f"no probe ran ahead of its round: {logs['speculative']}"
    assert sum(kind == "start" for kind, _, _ in logs["plain"]) == len(plain.probes)  # no guessing


def test_two_searches_keep_their_round_widths_while_idle_workers_guess(tmp_path, monkeypatch) -> None:
    """Two GPUs' searches share two workers (one probe each per round, two once one is done): a
    search whose round closed first may only guess ahead; its next round starts with the other's,
    so each knee equals the search without guessing whichever probe ends first."""
    from concurrent.futures import ThreadPoolExecutor

    workload = small_workload(2, 2)
    options = CompareOptions(policies=("fcfs",), loads=(1.0,), num_gpu_blocks=64, search_max_runs=8,
                             knee_tolerance=1.05)
    setups = (GpuSetup("a", 0.3, 64), GpuSetup("b", 0.9, 64))
    found = {}
    for mode in ("plain", "speculative"):
        log: list = []
        monkeypatch.setattr(sweep_module, "probe_task", _fake_probe(log, knee=1.0))
        if mode == "plain":
            monkeypatch.setattr(sweep_module._Sweep, "_speculate", staticmethod(lambda *args: set()))
        sweep = sweep_module._Sweep(workload, options, setups, tmp_path, None, None, None, ResultCache(None), {})
        sweep.ideal = {g.gpu: {s.session_id: 1.0 for s in workload.sessions} for g in setups}
        pool = Pool(2)
        pool._executor = ThreadPoolExecutor(2)
        try:
            found[mode] = sweep._searches(pool, [(g, "fcfs", 0.1) for g in setups], "knee")
        finally:
            pool._executor.shutdown(wait=True)
            monkeypatch.undo()
    assert found["speculative"] == found["plain"]
    # the rounds of a barrier: both searches one probe each until one is done, then two
    replay = {g.gpu: KneeSearch(0.1, 2.0, 8, 1.05) for g in setups}
    while open_ := [g for g in setups if not replay[g.gpu].is_done]:
        rates = {g.gpu: replay[g.gpu].next_rates(max(1, 2 // len(open_))) for g in open_}
        for g in open_:
            for rate in rates[g.gpu]:
                replay[g.gpu].record(rate, 1.0 + rate / g.step_timer)
    for g in setups:
        assert list(found["plain"][(g.gpu, "fcfs")].probes) == replay[g.gpu].probes
    assert 0.25 < found["plain"][("a", "fcfs")].rate_per_s <= 0.3
    assert 0.75 < found["plain"][("b", "fcfs")].rate_per_s <= 0.9


def test_knee_search_budget_counts_pending_probes_and_bad_parameters_are_named() -> None:
    search = KneeSearch(1.0, bound=2.0, max_runs=3)
    assert search.next_rates(8) == [1.0, 2.0, 4.0] and search.is_done
    with pytest.raises(ValueError, match="tolerance > 1"):
        KneeSearch(1.0, 2.0, 3, tolerance=1.0)
    with pytest.raises(ValueError, match="no probe was recorded"):
        KneeSearch(1.0, 2.0, 3).result()


def test_slowdown_guard_stops_a_probe_whose_mean_must_exceed_the_bound() -> None:
    from datetime import UTC, datetime

    from mars_openhands.stream import events as ev

    def at(t_s: float, cls, sid: str):
        return cls(t_mono_ns=int(t_s * 1e9), t_wall=datetime(2026, 1, 1, tzinfo=UTC), session_id=sid, source="t")

    guard = runs._SlowdownGuard({"a": 1.0, "b": 1.0}, bound=2.0)
    guard._CHECK_EVERY = 1
    guard.emit(at(0.0, ev.SessionStart, "a"))
    guard.emit(at(0.0, ev.SessionStart, "b"))
    guard.emit(at(1.5, ev.SessionEnd, "a"))  # a: 1.5; b open >= 1.5: lower bound 3.0 <= 2 x 2
    with pytest.raises(runs._Unstable):
        guard.emit(at(2.6, ev.SessionEnd, "b"))  # b: 2.6, mean 2.05 > 2
    calm = runs._SlowdownGuard({"a": 1.0, "b": 1.0}, bound=2.0)
    calm._CHECK_EVERY = 1
    for event in (at(0.0, ev.SessionStart, "a"), at(0.0, ev.SessionStart, "b"), at(1.2, ev.SessionEnd, "a"),
                  at(2.7, ev.SessionEnd, "b")):
        calm.emit(event)  # mean (1.2 + 2.7) / 2 <= 2: never stopped


def test_probe_of_an_overloaded_run_is_unstable_without_finishing_it(sim, monkeypatch) -> None:
    monkeypatch.setattr(runs._SlowdownGuard, "_CHECK_EVERY", 1)
    workload = small_workload(6, 4)
    options = CompareOptions(num_gpu_blocks=512, knee_slowdown=1.05)
    ideal = {s.session_id: 0.05 for s in workload.sessions}  # far below what they take: unstable early
    calls, results = [], []

    def counting(w, config, timer, sink=None):
        calls.append(sink)
        results.append(sim.simulate(w, config, timer, sink))  # not reached: the guard raises inside
        return results[-1]

    slowdown, wall_s, stream = runs.probe_task(workload, options, "fcfs", False, 100.0,
                                               sim.LinearStepTimeModel(), 512, ideal, counting, True)
    assert slowdown == math.inf and isinstance(calls[0], runs._SlowdownGuard) and not results
    assert wall_s > 0 and stream is None  # an unstable probe's events are not a run's


def test_the_fcfs_run_at_the_knee_is_the_knee_searchs_probe_not_a_second_simulation(tmp_path, sim) -> None:
    # Load 1.0 x the FCFS knee is the rate of the search's largest stable probe (same policy, seed and
    # settings): the sweep takes that probe's stream instead of simulating it again, and the row and
    # per-session Parquet are what a simulated run gives (a sweep with the rate given as --base-rate).
    workload = small_workload()
    runs: list[tuple[str, float]] = []

    def counting(w, config, timer, sink=None):
        runs.append((config.policy, w.sessions[-1].arrival_s))
        return sim.simulate(w, config, timer, sink)

    options = CompareOptions(policies=("fcfs", "continuum"), loads=(1.0, 1.5), num_gpu_blocks=512,
                             search_max_runs=3, knee_slowdown=1.5)
    searched = run_compare(workload, options, sim.LinearStepTimeModel(), tmp_path / "a", simulate_fn=counting)
    num_probes = len(runs) - 3  # the sweep simulated 3 of its 4 runs
    assert num_probes == 3
    base = searched.loc[searched["label"] == "fcfs", "rate_per_s"].iloc[0]
    given = run_compare(workload, options.model_copy(update={"base_rate_per_s": base}), sim.LinearStepTimeModel(),
                        tmp_path / "b", simulate_fn=counting)
    assert len(runs) == num_probes + 3 + 4
    a, b = (f.set_index("run_id").drop(columns=["wall_s"]) for f in (searched, given))
    # Equal up to the metrics' sub-microsecond rounding (times pass through wall-clock stamps of
    # each run's start): relative for the rest, absolute for the millisecond admission waits.
    waits = [c for c in a.columns if c.startswith("admission_wait")]
    pd.testing.assert_frame_equal(a.drop(columns=waits), b.drop(columns=waits), rtol=1e-5)
    pd.testing.assert_frame_equal(a[waits], b[waits], rtol=0, atol=1e-5)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "a" / "fcfs__load1.parquet"),
                                  pd.read_parquet(tmp_path / "b" / "fcfs__load1.parquet"), rtol=1e-5, atol=1e-5)
    assert "fcfs__load1" in (tmp_path / "a" / "summary.md").read_text()


def test_the_guard_stops_a_plugin_policy_at_its_first_raise(sim, monkeypatch) -> None:
    # The guard is also the scheduler's telemetry sink, which drops what its sink raises as an
    # Exception; the first raise must end the probe, not the next one from the simulator's own events.
    monkeypatch.setattr(runs._SlowdownGuard, "_CHECK_EVERY", 1)
    raises: list[str] = []
    emit = runs._SlowdownGuard.emit

    def counting_emit(self, event) -> None:
        try:
            emit(self, event)
        except runs._Unstable:
            raises.append(event.kind)
            raise

    monkeypatch.setattr(runs._SlowdownGuard, "emit", counting_emit)
    workload = small_workload(6, 4)
    options = CompareOptions(num_gpu_blocks=512, knee_slowdown=1.05)
    ideal = {s.session_id: 0.05 for s in workload.sessions}
    slowdown, _, stream = runs.probe_task(workload, options, "mars", False, 100.0, sim.LinearStepTimeModel(),
                                          512, ideal)
    assert slowdown == math.inf and len(raises) == 1 and stream is None, raises


# ----------------------------------------------------------------------------- GPUs, jobs, cache
def _two_gpus(sim) -> tuple[GpuSetup, GpuSetup]:
    fast = sim.LinearStepTimeModel()
    slow = sim.LinearStepTimeModel(overhead_s=0.01, prefill_token_s=4e-5, decode_request_s=4e-4)
    return GpuSetup("fast", fast, 512), GpuSetup("slow", slow, 256)


def test_two_gpus_in_one_report_with_their_own_knees_and_prefixed_files(tmp_path, sim) -> None:
    options = CompareOptions(policies=("fcfs", "mars"), loads=(1.0,), num_gpu_blocks=512, search_max_runs=3)
    results = run_sweep(small_workload(3, 3), options, _two_gpus(sim), tmp_path)
    assert list(results["run_id"]) == ["fast__fcfs__load1", "fast__mars+adm__load1",
                                       "slow__fcfs__load1", "slow__mars+adm__load1"]
    assert (results["status"] == "ok").all()
    rates = results.groupby("gpu")["rate_per_s"].first()
    assert rates["fast"] != rates["slow"]  # each GPU's own FCFS knee
    text = (tmp_path / "summary.md").read_text()
    assert "# GPU fast" in text and "# GPU slow" in text and "base rate search (slow)" in text
    assert "- **wall (s) per phase**: ideal " in text
    assert " s, " in text.split("base rate search (fast)**: ")[1].split("\n")[0]  # each probe's wall
    for name in ("fast__e2e_cdf.png", "slow__goodput_vs_alpha.png", "fast__mars+adm__load1.parquet"):
        assert (tmp_path / name).stat().st_size > 0
    assert clear_previous_results(tmp_path) and not any(tmp_path.iterdir())


def test_cache_reuses_ideals_and_knees_and_a_changed_input_misses(tmp_path, sim) -> None:
    calls = []

    def counting(workload, config, timer, sink=None):
        calls.append(len(workload.sessions))
        return sim.simulate(workload, config, timer, sink)

    options = CompareOptions(policies=("fcfs",), loads=(1.0,), num_gpu_blocks=512, search_max_runs=3)
    setup = (GpuSetup("g", sim.LinearStepTimeModel(), 512),)
    cache = ResultCache(tmp_path / "cache")
    first = run_sweep(small_workload(3, 2), options, setup, tmp_path / "a", simulate_fn=counting, cache=cache)
    num_first = len(calls)
    second = run_sweep(small_workload(3, 2), options, setup, tmp_path / "b", simulate_fn=counting, cache=cache)
    assert len(calls) - num_first == 1 and cache.num_hits == 2  # only the run itself; ideal + knee read
    assert first["rate_per_s"].tolist() == second["rate_per_s"].tolist()
    assert "(cached)" in (tmp_path / "b" / "summary.md").read_text()
    other = options.model_copy(update={"knee_slowdown": 3.0})
    assert content_key("x", other) != content_key("x", options)
    run_sweep(small_workload(3, 2), other, setup, tmp_path / "c", simulate_fn=counting, cache=cache)
    assert cache.num_hits == 3  # the ideal times still match; the knee does not


# ----------------------------------------------------------------------------- capacity
def test_capacity_is_the_knee_search_of_every_policy_with_a_ratio_to_the_best_baseline(tmp_path, sim) -> None:
    options = CompareOptions(policies=("fcfs", "continuum", "mars"), loads=(1.0,), num_gpu_blocks=512,
                             search_max_runs=3, is_capacity=True)
    run_sweep(small_workload(3, 3), options, (GpuSetup("g", sim.LinearStepTimeModel(), 512),), tmp_path)
    capacity = pd.read_parquet(tmp_path / "capacity.parquet")
    assert set(capacity["label"]) == {"fcfs", "continuum", "mars+adm"}
    assert (capacity["num_probes"] <= 3).all()
    text = (tmp_path / "summary.md").read_text()
    assert "## Capacity at SLO" in text and "× best baseline" in text


def test_capacity_ratios_divide_by_the_best_baseline_of_the_same_gpu() -> None:
    table = pd.DataFrame({"gpu": ["a", "a", "a", "b", "b"], "label": ["fcfs", "continuum", "mars+adm", "fcfs", "mars+adm"],
                          "is_baseline": [True, True, False, True, False],
                          "capacity_per_s": [0.01, 0.02, 0.03, 0.05, 0.04]})
    ratios = capacity_ratios(table).set_index(["gpu", "label"])["vs_best_baseline"]
    assert ratios.to_dict() == pytest.approx({("a", "fcfs"): 0.5, ("a", "continuum"): 1.0, ("a", "mars+adm"): 1.5,
                                              ("b", "fcfs"): 1.0, ("b", "mars+adm"): 0.8})


def test_best_baseline_per_load_and_metric_ignores_our_policies() -> None:
    results = pd.DataFrame({
        "status": "ok", "label": ["fcfs", "continuum", "mars+adm"], "policy": ["fcfs", "continuum", "mars"],
        "is_baseline": [True, True, False], "load_x": 1.0, "e2e_mean_s": [10.0, 8.0, 1.0],
        "goodput_a3_per_s": [0.2, 0.1, 9.0]})
    best = best_baselines(results).set_index("column")
    assert best.at["e2e_mean_s", "label"] == "continuum" and best.at["goodput_a3_per_s", "label"] == "fcfs"


# ----------------------------------------------------------------------------- ablations
def test_ablations_are_registered_and_switch_off_what_they_say() -> None:
    from mars_openhands.policy.params import parse_scheduler_params

    assert ABLATIONS == ("mars-mlfq", "mars-no-control-plane", "mars-no-coscheduler")
    assert all(POLICIES[a].scheduler == "MarsScheduler" and not POLICIES[a].is_baseline for a in ABLATIONS)
    assert parse_policies(",".join(ABLATIONS)) == ABLATIONS
    mars = parse_scheduler_params(POLICIES["mars"].additional_config.get("mars", {}))
    with_mlfq = parse_scheduler_params(POLICIES["mars-mlfq"].additional_config["mars"])
    assert not mars.mars.mlfq and with_mlfq.mars.mlfq and with_mlfq.mars.session_fifo
    assert with_mlfq.residency.enabled and with_mlfq.retention.enabled
    assert not POLICIES["mars-no-control-plane"].has_control_plane and POLICIES["mars"].has_control_plane
    no_co = parse_scheduler_params(POLICIES["mars-no-coscheduler"].additional_config["mars"])
    assert not no_co.residency.enabled and not no_co.retention.enabled and no_co.levels.num_levels == 4
    assert admission_modes("auto", "mars-no-control-plane") == (False,)


def test_ablation_variants_run_and_get_their_section_next_to_the_paper(tmp_path, sim) -> None:
    options = CompareOptions(policies=("fcfs", "mars", *ABLATIONS), loads=(1.0,), num_gpu_blocks=256,
                             base_rate_per_s=2.0)
    results = run_sweep(small_workload(4, 3), options, (GpuSetup("g", sim.LinearStepTimeModel(), 256),), tmp_path)
    assert (results["status"] == "ok").all(), results["error"].tolist()
    retained = results.set_index("policy")["kv_hit_ratio"]
    assert math.isnan(retained["mars-no-coscheduler"])  # nothing retained, nothing released
    text = (tmp_path / "summary.md").read_text()
    assert "## Ablations against the paper (MARS §6)" in text
    for variant, paper in (("mars-mlfq", "2–5×"), ("mars-no-control-plane", "1.5–3×"),
                           ("mars-no-coscheduler", "1.5–2×")):
        assert any(line.startswith(f"| {variant}") and line.endswith(f"| {paper} |") for line in text.splitlines())


def test_ablation_table_ratios_are_variant_over_mars_and_mars_over_variant_for_goodput() -> None:
    results = pd.DataFrame({
        "status": "ok", "label": ["mars+adm", "mars-no-control-plane"], "policy": ["mars", "mars-no-control-plane"],
        "is_admission_enabled": [True, False], "load_x": 1.0, "e2e_mean_s": [10.0, 25.0], "e2e_p95_s": [20.0, 30.0],
        "goodput_a3_per_s": [0.3, 0.1], "slowdown_mean": [1.5, 3.0]})
    capacity = pd.DataFrame({"policy": ["mars", "mars-no-control-plane"], "capacity_per_s": [0.06, 0.02]})
    table = ablation_table(results, capacity).set_index("metric")["worse_x"]
    assert table.to_dict() == pytest.approx({"mean E2E": 2.5, "P95 E2E": 1.5, "goodput α=3": 3.0,
                                             "mean slowdown": 2.0, "capacity": 3.0})
    text = render_summary(results.assign(run_id="r", gpu="g", is_baseline=False, rate_per_s=1.0, error="",
                                         wall_s=1.0, num_completed=1, num_sessions=1), {})
    assert "| mars-no-control-plane | external control plane | 1 | 2.50× |" in text


def test_a_variant_that_adds_a_part_is_the_with_side_of_its_ratio() -> None:
    # mars lacks the priority coordinator: "without it" is mars, "with it" is mars-mlfq
    results = pd.DataFrame({
        "status": "ok", "label": ["mars+adm", "mars-mlfq+adm"], "policy": ["mars", "mars-mlfq"],
        "is_admission_enabled": True, "load_x": 1.0, "e2e_mean_s": [25.0, 10.0], "e2e_p95_s": [30.0, 20.0],
        "goodput_a3_per_s": [0.1, 0.3], "slowdown_mean": [3.0, 1.5]})
    capacity = pd.DataFrame({"policy": ["mars", "mars-mlfq"], "capacity_per_s": [0.02, 0.06]})
    table = ablation_table(results, capacity).set_index("metric")["worse_x"]
    assert table.to_dict() == pytest.approx({"mean E2E": 2.5, "P95 E2E": 1.5, "goodput α=3": 3.0,
                                             "mean slowdown": 2.0, "capacity": 3.0})


def test_ideal_times_are_in_workload_order_whatever_order_the_chunks_finish(tmp_path, monkeypatch) -> None:
    # Workers finish chunks in any order; the sweep's sums over the ideal times (the knee search's
    # start rate) must round the same in every run, so the dict is in the workload's order, also
    # when it comes from a cache written in another order.
    workload = small_workload(9, 2)
    order = [s.session_id for s in workload.sessions]
    monkeypatch.setattr(sweep_module, "ideal_task",
                        lambda chunk, *args: {s.session_id: 1.0 + 0.1 * order.index(s.session_id) for s in chunk.sessions})

    class Backwards:
        jobs = 2

        def run(self, calls):
            yield from reversed([(i, fn(*args)) for i, (fn, args) in enumerate(calls)])

    setup = GpuSetup("g", object(), 64)
    cache = ResultCache(tmp_path / "cache")
    sweep = sweep_module._Sweep(workload, CompareOptions(num_gpu_blocks=64), (setup,), tmp_path, None, None, None,
                           ResultCache(None), {})
    sweep._ideal_times(Backwards(), None)
    assert list(sweep.ideal["g"]) == order and len(set(sweep.ideal["g"].values())) == len(order)
    monkeypatch.setattr(sweep_module._Sweep, "_key", lambda self, *args: "k")
    cache.put("ideal", "k", dict(reversed(list(sweep.ideal["g"].items()))))
    cached = sweep_module._Sweep(workload, CompareOptions(num_gpu_blocks=64), (setup,), tmp_path, None, None, None,
                            cache, {})
    cached._ideal_times(Backwards(), None)
    assert cached.ideal["g"] == sweep.ideal["g"] and list(cached.ideal["g"]) == order


def test_a_capacity_searchs_first_probe_is_the_policys_run_at_the_knee(tmp_path, sim) -> None:
    # Every capacity search starts at the FCFS knee, the rate of load 1.0: a stable first probe is
    # that run (same label, rate and seed), so the sweep simulates no run at load 1.0 again, and the
    # rows equal a sweep that simulates them (given the same base rate, no capacity).
    workload = small_workload(3, 3)
    calls: list[tuple[str, float]] = []

    def counting(w, config, timer, sink=None):
        calls.append((config.policy, w.sessions[-1].arrival_s))
        return sim.simulate(w, config, timer, sink)

    options = CompareOptions(policies=("fcfs", "continuum", "unbounded-kv"), loads=(1.0,), num_gpu_blocks=512,
                             search_max_runs=3, knee_slowdown=1.5, is_capacity=True)
    planned = run_compare(workload, options, sim.LinearStepTimeModel(), tmp_path / "a", simulate_fn=counting)
    capacity = pd.read_parquet(tmp_path / "a" / "capacity.parquet")
    assert set(capacity["label"]) == {"fcfs", "continuum", "unbounded-kv"}
    base = planned["rate_per_s"].iloc[0]
    probed = len(calls)
    # FCFS's knee search (3 probes) did not bracket in its 3 runs: FCFS searched again from the knee
    assert not capacity.set_index("label").at["fcfs", "is_bracketed"]
    assert probed == int(capacity["num_probes"].sum()) + 3  # the 3 runs were all probes
    given = run_compare(workload, options.model_copy(update={"base_rate_per_s": base, "is_capacity": False}),
                        sim.LinearStepTimeModel(), tmp_path / "b", simulate_fn=counting)
    assert len(calls) == probed + 3
    a, b = (f.set_index("run_id").drop(columns=["wall_s"]) for f in (planned, given))
    pd.testing.assert_frame_equal(a, b)
    assert "continuum__load1" in (tmp_path / "a" / "summary.md").read_text()
