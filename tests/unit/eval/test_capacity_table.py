"""benchmarks/capacity_table.py: issue 31's capacity table from plan folders on disk (the plans
themselves are not run here)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from compare_helpers import benchmark_module


@pytest.fixture(scope="module")
def ct():
    yield from benchmark_module("capacity_table")


def _plan(folder: Path, caps: dict[str, tuple[float, float]], scope: str = "Full workload.", **facts) -> Path:
    folder.mkdir(parents=True)
    rows = [{"label": label, "is_limit": label == "unbounded-kv", "capacity_per_s": cap,
             "first_unstable_per_s": unstable} for label, (cap, unstable) in caps.items()]
    pd.DataFrame(rows).to_parquet(folder / "plan.parquet")
    base = {"scope": scope, "timing": "h100_sxm × qwen", "model": "qwen/bf16", "kv cache dtype": "bf16",
            "seed": 0, "workload": "/x/deepseek_chat_test_1-100"}
    (folder / "run.json").write_text(json.dumps({"facts": {**base, **facts}}))
    return folder


def test_mars_against_the_best_baseline_and_the_limit(ct, tmp_path):
    folder = _plan(tmp_path / "a", {"fcfs": (0.008, 0.009), "thunderagent": (0.012, 0.013),
                                    "mars+adm": (0.0132, 0.014), "unbounded-kv": (0.02, 0.021)})
    row = ct.row_of(folder)
    assert row["best baseline"] == "thunderagent"
    assert row["mars ÷ best"] == pytest.approx(1.1)
    assert row["mars × limit"] == pytest.approx(0.66)
    assert row["same bracket"] is False
    assert row["GPU"] == "h100_sxm" and row["host tier"] == "none" and row["workload"] == "deepseek_chat_test_1-100"


def test_offload_variants_share_their_policys_column_and_the_tier_is_read_from_the_scope(ct, tmp_path):
    folder = _plan(tmp_path / "t", {"vllm-offload-lru": (0.010, 0.011), "vllm-offload-arc": (0.011, 0.012),
                                    "thunderagent-offload": (0.015, 0.016), "mars+adm-offload": (0.015, 0.016),
                                    "unbounded-kv": (0.02, 0.021)},
                   scope="Full workload. Host KV tier: 256 GiB for vllm-offload-lru (vLLM native offload).")
    row = ct.row_of(folder)
    assert row["vllm-offload"] == 0.011 and row["vllm-offload label"] == "vllm-offload-arc"
    assert row["host tier"] == "256 GiB"
    assert row["same bracket"] is True
    assert "(same bracket)" in ct.render([row]) and "(thunderagent-offload)" in ct.render([row])


def test_a_folder_without_a_finished_plan_is_a_one_line_error(ct, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert ct.main([str(tmp_path / "empty")]) == 2
    assert "not a finished plan" in capsys.readouterr().err


def test_missing_policies_render_as_dashes(ct, tmp_path):
    folder = _plan(tmp_path / "b", {"fcfs": (0.008, 0.009), "unbounded-kv": (0.02, 0.021)})
    row = ct.row_of(folder)
    assert "mars ÷ best" not in row
    line = ct.render([row]).splitlines()[-1]
    assert line.count("–") >= 5 and not math.isnan(row["limit"])


def test_an_unbracketed_search_is_a_lower_bound_not_a_capacity(ct, tmp_path):
    folder = _plan(tmp_path / "u", {"fcfs": (23.96, math.nan), "mars+adm": (3067.0, math.nan),
                                    "thunderagent": (0.012, 0.013), "unbounded-kv": (3067.0, math.nan)})
    table = pd.read_parquet(folder / "plan.parquet")
    table["is_bracketed"] = table["label"] == "thunderagent"
    table.to_parquet(folder / "plan.parquet")
    row = ct.row_of(folder)
    assert math.isnan(row["mars"]) and math.isnan(row["limit"]) and math.isnan(row["fcfs"])
    assert row["best baseline"] == "thunderagent" and math.isnan(row["mars ÷ best"])
    assert "only a lower bound" in ct.render([row])


def test_a_missing_folder_or_a_file_is_named_as_such(ct, tmp_path, capsys):
    (tmp_path / "f.md").write_text("x")
    assert ct.main([str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert ct.main([str(tmp_path / "f.md")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_folders_of_one_deployment_make_one_row_the_later_policies_replacing(ct, tmp_path, capsys):
    # the baselines' plan, then a plan of mars alone after a change to it: one row, the new mars
    # judged against the first plan's thunderagent; another seed stays its own row
    before = _plan(tmp_path / "b", {"fcfs": (0.008, 0.009), "thunderagent": (0.012, 0.013),
                                    "mars+adm": (0.010, 0.011), "unbounded-kv": (0.02, 0.021)})
    after = _plan(tmp_path / "m", {"fcfs": (0.008, 0.009), "mars+adm": (0.013, 0.014), "unbounded-kv": (0.02, 0.021)})
    other = _plan(tmp_path / "s", {"thunderagent": (0.011, 0.012), "mars+adm": (0.011, 0.012),
                                   "unbounded-kv": (0.02, 0.021)}, seed=1)
    assert ct.main([str(before), str(after), str(other)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| h100_sxm")]
    assert len(lines) == 2
    assert "| 0.012 | – | 0.013 | 0.02 | thunderagent | 1.083 |" in lines[0]
    assert "1 (same bracket)" in lines[1]
    assert ct.main([str(after), str(before)]) == 0  # the other order: the old mars wins
    assert "| 0.012 | – | 0.01 | 0.02 | thunderagent | 0.8333 |" in capsys.readouterr().out
