"""``mars-openhands compare --backend emulated`` end to end for the two newest baselines.

Run with ``pytest -m integration tests/integration/test_compare_emulated.py -s``. One emulated-GPU
vLLM server per policy (no weights: ~15 s to start here) behind the real gateway: ``thunderagent``
(``ThunderAgentScheduler``) and ``vllm-tuned`` (``FcfsScheduler`` with
``--long-prefill-token-threshold 512``). KV is 140 blocks of 16 tokens (compare serves
``--max-model-len`` 2048 on the emulated backend, which vLLM needs to fit next to its null block),
so ThunderAgent's capacity (2240 tokens) admits the first two sessions and holds the third until
its periodic check; every first prompt is longer than vllm-tuned's 512-token cap. Ideal times come
from the simulator.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import pandas as pd
import pytest

from eval.compare import add_compare_subcommand
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta, save_workload

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                       reason="needs aiconfigurator-core==0.12.0 (emulated-GPU extra)"),
]

POLICIES = ("thunderagent", "vllm-tuned")


def _workload() -> Workload:
    sessions = []
    for i, first_prompt in enumerate((1200, 700, 600)):
        turns = (Turn(prompt_tokens_appended=first_prompt, output_tokens=12, tool_name="bash",
                      tool_duration_s=0.3),
                 Turn(prompt_tokens_appended=40, output_tokens=10, tool_name="bash", tool_duration_s=0.2),
                 Turn(prompt_tokens_appended=30, output_tokens=8))
        sessions.append(Session(session_id=f"emu-{i}", arrival_s=0.0, turns=turns))
    return Workload(meta=WorkloadMeta(source="test:compare-emulated"), sessions=tuple(sessions))


def test_thunderagent_and_vllm_tuned_on_the_emulated_gpu(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm", reason="needs the engine env")
    workload_path = save_workload(_workload(), tmp_path / "workload.json")
    out = tmp_path / "results"
    parser = argparse.ArgumentParser()
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "compare", "--backend", "emulated", "--policies", ",".join(POLICIES),
        "--workload", str(workload_path), "--absolute-rates", "--loads", "10", "--kv-blocks", "140",
        "--tool-workers", "2", "--run-timeout", "120", "--no-cache", "--out", str(out)])
    t0 = time.monotonic()
    code = args.func(args)
    print(f"\n  compare on emulated ({', '.join(POLICIES)}): {time.monotonic() - t0:.0f} s")
    assert code == 0, capsys.readouterr()

    results = pd.read_parquet(out / "results.parquet")
    assert list(results["label"]) == list(POLICIES)  # baselines: no admission window (auto)
    assert (results["status"] == "ok").all(), results["error"].tolist()
    assert (results["num_completed"] == 3).all()
    assert (results["e2e_mean_s"] > 0.5).all()  # two tool calls of 0.3 + 0.2 s
    for policy in POLICIES:
        table = pd.read_parquet(out / f"{policy}__load10.parquet")
        assert len(table) == 3 and table["is_complete"].all()
        assert (table["num_turns"] == 3).all()  # the engine's 'finished' event of every turn
    logs = out / "server-logs"
    assert "ThunderAgentScheduler" in (logs / "server-thunderagent.log").read_text()
    tuned = (logs / "server-vllm-tuned.log").read_text()
    assert "long_prefill_token_threshold" in tuned and "512" in tuned  # vLLM's non-default args
