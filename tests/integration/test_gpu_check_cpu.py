"""scripts/gpu_check.py's ``measure`` half on vllm-cpu with a tiny model: its engine and step loop
work on the pinned vLLM, and the steps vLLM's scheduler runs before every request has its first
token are the steps ``prefill_steps`` models (the packing the comparison times with the emulator)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.load_file import ROOT, load_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _load_script():
    return load_file(ROOT / "scripts" / "gpu_check.py")


def test_measure_steps_on_vllm_cpu_match_the_modelled_packing(tmp_path, monkeypatch) -> None:
    pytest.importorskip("vllm")
    from mars_openhands.engine.harness.tiny_model import write_tiny_model

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    gc = _load_script()
    model_dir = write_tiny_model(tmp_path / "tiny", max_position_embeddings=4096)
    args = argparse.Namespace(contexts=(600,), decode_steps=4, budget=256, batches=(1, 2))
    deployment = argparse.Namespace(kv_cache_dtype=None, gpu_memory_utilization=0.9)
    engine = gc._engine(args, deployment, Path(model_dir), block_size=32)
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    for batch in (1, 2):
        records = gc._measure_point(engine, batch, 600, 4, vocab, seed=batch)
        phases = [r["phase"] for r in records]
        assert phases.count("prefill") == len(gc.prefill_steps(batch, 600, 256))  # 3, then 5
        assert phases.count("decode") == 4 and phases == sorted(phases, reverse=True)
        assert all(r["wall_s"] > 0 for r in records)
