"""eval.ohbench's pure parts: arrivals, session ids, trace assignment, the per-task phase split,
per-policy summaries, ratios to the best baseline and the written report."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from eval.ohbench import (
    PAPER_TASK_TIME_GAIN,
    BenchOptions,
    admission_for,
    arrival_offsets_s,
    assign_traces,
    find_traces,
    gpu_server_options,
    policy_summary,
    ratio_table,
    session_ids,
    task_rows,
    write_report,
)
from eval.task_sources import BenchTask
from tests.load_file import ROOT, load_file


def _task(task_id: str, trace_id: str | None = None) -> BenchTask:
    return BenchTask(task_id=task_id, source="swebench", problem_statement="p", repo="/r",
                     base_commit="c", trace_id=trace_id)


def test_arrivals_are_fixed_or_seeded_poisson():
    assert arrival_offsets_s(4, 0.5, "fixed", 0) == [0.0, 2.0, 4.0, 6.0]
    a, b = arrival_offsets_s(200, 2.0, "poisson", 1), arrival_offsets_s(200, 2.0, "poisson", 1)
    assert a == b and a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:], strict=False))
    assert a != arrival_offsets_s(200, 2.0, "poisson", 2)
    assert a[-1] / 199 == pytest.approx(0.5, rel=0.25)  # mean gap 1/rps


def test_session_ids_are_stable_uuids_per_seed():
    tasks = [_task("a"), _task("b")]
    first = session_ids(tasks, 0)
    assert first == session_ids(tasks, 0) and first["a"] != first["b"]
    assert session_ids(tasks, 1)["a"] != first["a"]


def test_traces_by_instance_then_from_the_pool(tmp_path: Path):
    for name in ("x__y-2", "x__y-1", "z__w-9"):
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / f"{name}.traj.json.gz").write_bytes(b"")
    (tmp_path / "run" / "preds.json.gz").write_bytes(b"")
    traces = find_traces(tmp_path)
    assert sorted(traces) == ["x__y-1", "x__y-2", "z__w-9"]
    got = assign_traces([_task("t1", "z__w-9"), _task("t2"), _task("t3", "nope"), _task("t4")],
                        traces)
    assert got["t1"].name == "z__w-9.traj.json.gz"
    assert [got[t].name.split(".")[0] for t in ("t2", "t3", "t4")] == ["x__y-1", "x__y-2", "z__w-9"]
    with pytest.raises(ValueError, match="no recorded runs"):
        assign_traces([_task("t")], {})
    with pytest.raises(ValueError, match="--traces .*not a directory"):
        find_traces(tmp_path / "missing")


def _result(task_id: str, session: str, wall_s: float, latencies: list[float],
            tools: list[float], status: str = "finished") -> dict:
    events = []
    for i, d in enumerate(tools):
        events += [{"kind": "tool_start", "queue_wait_s": 0.1, "tool_call_id": str(i)},
                   {"kind": "tool_end", "duration_s": d, "tool_call_id": str(i)}]
    return {"task_id": task_id, "session_id": session, "status": status, "wall_s": wall_s,
            "num_tool_calls": len(tools), "error": None if status == "finished" else "boom",
            "llm_calls": [{"response_id": f"{session}-{i}", "latency_s": s}
                          for i, s in enumerate(latencies)],
            "events": events}


def _engine_events(session: str, turns: int, e2e_s: float, delay_s: float) -> list[dict]:
    out = []
    for turn in range(turns):
        out += [{"kind": "first_scheduled", "session_id": session, "turn": turn,
                 "prefill_start_delay_s": delay_s, "num_cached_tokens": 100 * turn},
                {"kind": "finished", "session_id": session, "turn": turn, "e2e_s": e2e_s,
                 "num_prompt_tokens": 1000 + turn, "num_output_tokens": 50}]
    return out


def test_task_rows_split_task_time_into_phases():
    results = [_result("a", "s-a", 20.0, [5.0, 2.0], [1.0, 3.0])]
    events = _engine_events("s-a", 2, 1.5, 0.25) + [
        {"kind": "preempted", "session_id": "s-a", "turn": 1},
        {"kind": "finished", "session_id": "other", "turn": 0, "e2e_s": 9.0}]
    requests = [{"response_id": "s-a-0", "handle_s": 1.5}, {"response_id": "s-a-1", "handle_s": 1.75}]
    row = task_rows("mars", True, results, events, requests, {"s-a": 3.0, "other": 1.0}).iloc[0]
    assert row["gateway_wait_s"] == pytest.approx(3.5 + 0.25)  # 5.0 seen by the agent - 1.5 behind, ...
    assert row["admission_wait_s"] == pytest.approx(3.0)  # as the gateway measured it
    assert row["call_overhead_s"] == pytest.approx(0.75)
    assert row["engine_queue_s"] == pytest.approx(0.5) and row["engine_s"] == pytest.approx(3.0)
    assert row["queue_s"] == pytest.approx(3.5)
    assert row["llm_s"] == pytest.approx(7.0) and row["llm_compute_s"] == pytest.approx(2.75)
    assert row["tool_s"] == pytest.approx(4.0) and row["tool_queue_s"] == pytest.approx(0.2)
    assert row["framework_s"] == pytest.approx(20.0 - 7.0 - 4.2)
    phases = (row["queue_s"] + row["llm_compute_s"] + row["call_overhead_s"] + row["tool_phase_s"]
              + row["framework_s"])
    assert phases == pytest.approx(row["task_s"])
    assert (row["num_prompt_tokens"], row["num_output_tokens"], row["num_cached_tokens"]) == (2001, 100, 100)
    assert (row["num_preemptions"], row["num_engine_requests"], row["num_llm_calls"]) == (1, 2, 2)
    # Without playback, the engine's e2e of the call's turn is what the backend spent.
    # Without the gateway's measurement the first call's wait stands in for the admission wait.
    direct = task_rows("fcfs", False, results, events, None).iloc[0]
    assert direct["admission_wait_s"] == pytest.approx(3.5)
    assert direct["gateway_wait_s"] == pytest.approx(3.5 + 0.5)
    assert task_rows("fcfs", False, results, events, None, {}).iloc[0]["admission_wait_s"] == 0.0


def _frame() -> pd.DataFrame:
    rows = []
    for policy, scale, admission in (("fcfs", 1.0, False), ("continuum", 0.9, False), ("mars", 0.6, True)):
        results = [_result(f"t{i}", f"{policy}-{i}", scale * (10 + i), [scale * 2.0], [1.0])
                   for i in range(5)]
        results.append(_result("t5", f"{policy}-5", 1.0, [0.5], [], status="timeout"))
        events = [e for i in range(6) for e in _engine_events(f"{policy}-{i}", 1, 1.0, 0.0)]
        rows.append(task_rows(policy, admission, results, events, None))
    return pd.concat(rows, ignore_index=True)


def test_summary_counts_finished_tasks_and_ratios_use_the_best_baseline():
    summary = policy_summary(_frame()).set_index("policy")
    fcfs = summary.loc["fcfs"]
    assert (fcfs["num_tasks"], fcfs["num_finished"]) == (6, 5)  # the timeout has no task time
    assert fcfs["task_mean_s"] == pytest.approx(12.0) and fcfs["task_p50_s"] == pytest.approx(12.0)
    assert fcfs["task_p95_s"] == pytest.approx(13.8)
    assert fcfs["tool_wait_share"] == pytest.approx(5 * 1.1 / 60.0)
    assert fcfs["llm_wait_share"] == pytest.approx(10.0 / 60.0)
    assert fcfs["num_output_tokens"] == 6 * 50  # tokens count every task
    ratios = ratio_table(summary.reset_index(), ["fcfs", "continuum"]).set_index("policy")
    assert set(ratios["best_baseline"]) == {"continuum"}
    assert ratios.loc["mars", "mean"] == pytest.approx(0.9 / 0.6)
    assert ratios.loc["mars", "P95"] == pytest.approx(0.9 / 0.6)
    assert ratios.loc["continuum", "mean"] == pytest.approx(1.0)
    assert ratios.loc["fcfs", "mean"] == pytest.approx(0.9)
    assert ratio_table(summary.reset_index(), ["vllm-tuned"]).empty


def test_report_files_and_summary_text(tmp_path: Path):
    paths = write_report(tmp_path, _frame(), ["fcfs", "continuum"], {"tasks": "6 (swebench)"})
    for name in ("tasks.parquet", "summary.parquet", "ratios.parquet", "summary.md",
                 "task_time_cdf.png", "task_phases.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert len(pd.read_parquet(paths["tasks"])) == 18
    text = paths["summary_md"].read_text()
    low, high = PAPER_TASK_TIME_GAIN
    assert f"{low:.2f}–{high:.2f}×" in text and "Best baseline: continuum" in text
    assert "| mars (+ admission) | 1.5 |" in text  # the mars row of the ratio table
    assert "Tasks that did not finish" in text and "timeout" in text


def test_admission_as_deployed_and_gpu_server_flags(tmp_path: Path):
    assert admission_for("mars", "auto") and not admission_for("fcfs", "auto")
    assert admission_for("fcfs", "on") and not admission_for("mars", "off")
    options = BenchOptions(backend="gpu", real_model="Qwen/Qwen3-Coder-30B-A3B-Instruct",
                           engine_args=("--gpu-memory-utilization", "0.9"))
    server = gpu_server_options("vllm-tuned", options, "/usr/bin/python3", tmp_path, tmp_path)
    assert server.load_format == "auto" and server.scheduler_cls == "mars_openhands.engine.FcfsScheduler"
    args = server.extra_args
    assert args[:3] == ("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")
    assert "--long-prefill-token-threshold" in args and args[-2:] == ("--gpu-memory-utilization", "0.9")
    assert server.additional_config["mars"]["inbox_addr"].startswith(f"ipc://{tmp_path}")
    with pytest.raises(ValueError, match="needs --real-model"):
        gpu_server_options("fcfs", BenchOptions(backend="gpu"), "python", tmp_path, tmp_path)
    assert math.isclose(BenchOptions().rps, 0.2)


@pytest.mark.parametrize(("command", "expected"), [
    ("pip install numpy pandas", True), ("cd /testbed && pip install -e .", True),
    ("python -m pip install -q scipy", True), ("python3.11 -m pip uninstall -y x", True),
    ("sudo apt-get install foo", True), ("uv pip install x", True), ("conda install numpy", True),
    ("npm install", True), ("(cd x; poetry add y)", True),
    ("python -m pytest -q", False), ("grep -rn 'pip install' README.md | head", False),
    ("pip list", False), ("cat requirements.txt", False), ("pipx run x", False),
])
def test_package_installs_are_recognised(command, expected):
    from eval.ohbench import is_install

    assert is_install(command) is expected


def test_the_cpu_bench_script_is_quiet_before_the_bench_imports_the_sdk(tmp_path: Path, monkeypatch):
    """benchmarks/bench_openhands_e2e.py called eval.ohbench_cli directly, past the CLI's quiet
    environment: pasted from the README, it printed the SDK's banner before its own lines."""
    import os

    import eval.ohbench_cli

    bench = load_file(ROOT / "benchmarks" / "bench_openhands_e2e.py", register=False)
    for name in ("OPENHANDS_SUPPRESS_BANNER", "LITELLM_LOCAL_MODEL_COST_MAP"):
        monkeypatch.setenv(name, "")  # restored (unset) after the test, as quiet_environment sets them
        monkeypatch.delenv(name)
    monkeypatch.setattr(bench, "write_swebench_fixture", lambda out, tasks, traces: (out / "rows.jsonl", out))
    seen = {}

    def fake_bench(argv):
        seen.update({n: os.environ.get(n) for n in ("OPENHANDS_SUPPRESS_BANNER", "LITELLM_LOCAL_MODEL_COST_MAP")})
        raise SystemExit(3)

    monkeypatch.setattr(eval.ohbench_cli, "main", fake_bench)
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path)])
    assert seen == {"OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def test_the_emulated_engine_gets_the_kv_cache_dtype_and_memory_flags(tmp_path: Path):
    """`openhands bench --model NAME/DTYPE --kv-cache-dtype fp8 --gpu-memory-utilization F` reach the
    emulated server's LiveOptions, as compare's flags do (they were dropped: fp8 ran as bf16)."""
    from eval.ohbench import emulated_live_options
    from eval.ohbench_cli import _add_flags, options_from_args
    from mars_openhands.cli_style import CliParser

    parser = CliParser(prog="bench")
    _add_flags(parser)
    args = parser.parse_args(["--source", "swebench", "--tasks", str(tmp_path), "--out", str(tmp_path),
                              "--model", "qwen3-30b-a3b", "--kv-cache-dtype", "fp8",
                              "--gpu-memory-utilization", "0.95"])
    options = options_from_args(args)
    assert (options.model, options.dtype, options.kv_cache_dtype) == ("qwen3-30b-a3b", "bf16", "fp8")
    live = emulated_live_options(options, 4096, tmp_path, "python")
    assert (live.model, live.dtype, live.kv_cache_dtype, live.gpu_memory_utilization) == (
        "qwen3-30b-a3b", "bf16", "fp8", 0.95)
    default = emulated_live_options(BenchOptions(), None, tmp_path, "python")
    assert (default.kv_cache_dtype, default.gpu_memory_utilization) == (None, 0.9)
    with pytest.raises(ValueError, match="--model: unknown model 'gpt-5'"):
        options_from_args(parser.parse_args(["--source", "swebench", "--tasks", str(tmp_path), "--out",
                                             str(tmp_path), "--model", "gpt-5"]))


def test_bench_fidelity_serves_the_deployment_it_simulates(tmp_path: Path):
    """benchmarks/bench_fidelity.py: the emulated server's KV dtype and memory are the sim's."""
    bench = load_file(ROOT / "benchmarks" / "bench_fidelity.py", register=False)
    args = bench._args(["--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.8", "--out", str(tmp_path)])
    cargs = bench._compare_args(args)
    assert (cargs.kv_cache_dtype, cargs.gpu_memory_utilization) == ("fp8", 0.8)
    live = bench.live_options(cargs, 2000, 1000, tmp_path)
    assert (live.kv_cache_dtype, live.gpu_memory_utilization, live.gpu) == ("fp8", 0.8, "h100_sxm")
