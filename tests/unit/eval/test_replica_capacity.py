"""benchmarks/replica_capacity.py: the grid's rows and commands (``--dry-run``; no compare runs),
and its table read from result folders on disk."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
from compare_helpers import benchmark_module


@pytest.fixture(scope="module")
def rc():
    yield from benchmark_module("replica_capacity")


def _commands(rc, monkeypatch, capsys, *argv: str) -> list[str]:
    monkeypatch.setattr(sys, "argv", ["replica_capacity.py", "--dry-run", *argv])
    assert rc.main() == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]


def test_a_kv_transfer_adds_a_row_for_each_router_that_moves_sessions(rc, monkeypatch, capsys) -> None:
    assert rc._rows(["least-sessions", "llm-d", "mars-placement", "pooled-kv", "sticky-hash"], 50.0) == [
        "least-sessions", "llm-d", "mars-placement", "pooled-kv", "sticky-hash", "llm-d+kv", "mars-placement+kv"]
    assert rc._rows(["least-sessions", "mars-placement"], None) == ["least-sessions", "mars-placement"]
    assert [rc._kind(r) for r in ("mars-placement+kv", "llm-d+kv", "pooled-kv")] == ["ours", "anchor", "bound"]
    cmds = _commands(rc, monkeypatch, capsys, "--replicas", "4", "--seeds", "0", "--routers",
                     "least-sessions,mars-placement", "--kv-transfer-gbps", "50", "--no-e2e")
    assert len(cmds) == 3
    plain, moving = cmds[1], cmds[2]
    assert "--router mars-placement" in plain and "--kv-transfer-gbps" not in plain
    assert "--router mars-placement" in moving and moving.endswith("--kv-transfer-gbps 50")
    assert "n4_seed0/mars-placement+kv" in moving


def test_the_best_anchor_may_be_a_router_with_the_transfer(rc, monkeypatch, capsys, tmp_path) -> None:
    base = tmp_path / "n4_seed0"
    for row, cap in (("least-sessions", 0.0159), ("llm-d", 0.0149), ("llm-d+kv", 0.0162),
                     ("mars-placement+kv", 0.0163)):
        (base / row).mkdir(parents=True)
        pd.DataFrame([{"policy": "mars", "capacity_per_s": cap}]).to_parquet(base / row / "capacity.parquet")
    monkeypatch.setattr(sys, "argv", ["replica_capacity.py", "--out", str(tmp_path), "--replicas", "4",
                                      "--seeds", "0", "--routers", "least-sessions,llm-d,mars-placement",
                                      "--kv-transfer-gbps", "50", "--no-e2e", "--skip-done"])
    (base / "mars-placement").mkdir()
    pd.DataFrame([{"policy": "mars", "capacity_per_s": 0.0160}]).to_parquet(base / "mars-placement" / "capacity.parquet")
    assert rc.main() == 0
    table = pd.read_parquet(tmp_path / "replica_capacity.parquet").set_index("router")
    assert set(table["best_anchor"]) == {"llm-d+kv"}
    assert table.loc["mars-placement+kv", "vs_best_anchor"] == pytest.approx(0.0163 / 0.0162)
    assert table.loc["mars-placement+kv", "kind"] == "ours"
