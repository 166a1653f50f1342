"""scripts/gpu_check.py (issue 31 item 4): the parsing of a ``measure`` file, vLLM's prefill packing,
the comparison with the step-time model and the calibration fit, on a recorded sample constructed
for these tests (tests/fixtures/gpu_check/; its meta line says how) and on synthetic ones."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.load_file import ROOT, load_file

SAMPLE = ROOT / "tests" / "fixtures" / "gpu_check" / "h100_sxm_qwen3_coder_constructed.jsonl"
needs_aic = pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                               reason="needs aiconfigurator-core (the emulated-GPU extra)")


def _load_script():
    return load_file(ROOT / "scripts" / "gpu_check.py")  # dataclasses resolve their module by name


gc = _load_script()


class LinearModel:
    """A step model with round numbers: 1 µs per prefill token, 0.1 µs per decode-context token,
    2 ms per decode request, under ``scale`` and ``overhead_ms``."""

    def __init__(self, scale: float = 1.0, overhead_ms: float = 0.0) -> None:
        self.scale, self.overhead_s = scale, overhead_ms / 1000

    def _estimate_s(self, prefill, decode) -> float:
        return sum(n for n, _ in prefill) * 1e-6 + sum(decode) * 1e-7 + len(decode) * 2e-3

    def step_time_s(self, prefill=(), decode_context_tokens=()) -> float:
        return self.scale * self._estimate_s(list(prefill), list(decode_context_tokens)) + self.overhead_s

    def decode_step_time_s(self, num_decode_requests: int, decode_context_tokens: int) -> float:
        return self.scale * (decode_context_tokens * 1e-7 + num_decode_requests * 2e-3) + self.overhead_s


def _write(path: Path, model: LinearModel, points=((1, 8192), (4, 16384)), decode_steps: int = 4) -> Path:
    """A measure file whose every step is exactly ``model``'s time for it."""
    meta = {"kind": "meta", "schema": 1, "device": "test", "vllm": "0.33.0", "model": "qwen3-coder-30b-a3b-instruct",
            "kv_cache_dtype": "bf16", "gpu_memory_utilization": 0.9, "max_num_batched_tokens": 8192,
            "num_gpu_blocks": 7396}
    lines = [meta]
    for batch, context in points:
        for i, (p, d) in enumerate(gc.prefill_steps(batch, context, 8192)):
            lines.append({"kind": "step", "batch": batch, "context_tokens": context, "phase": "prefill", "index": i,
                          "wall_s": model.step_time_s(p, d)})
        for k in range(decode_steps):
            lines.append({"kind": "step", "batch": batch, "context_tokens": context, "phase": "decode", "index": k,
                          "wall_s": model.decode_step_time_s(batch, batch * (context + 1 + k))})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_prefill_packing_follows_vllms_budget_and_order() -> None:
    steps = gc.prefill_steps(2, 12288, 8192)  # the module docstring's diagram
    assert steps == [([(8192, 0)], []), ([(4096, 8192), (4096, 0)], []), ([(8191, 4096)], [12289]),
                     ([(1, 12287)], [12290])]
    big = gc.prefill_steps(8, 65536, 8192)
    assert sum(n for p, _ in big for n, _ in p) == 8 * 65536
    assert all(sum(n for n, _ in p) + len(d) <= 8192 for p, d in big)
    with pytest.raises(ValueError, match="must be >= 1"):
        gc.prefill_steps(0, 8192)


def test_a_sample_equal_to_the_model_compares_at_one_and_fits_its_calibration(tmp_path) -> None:
    truth = LinearModel(scale=1.2, overhead_ms=3.0)
    sample = gc.load_sample(_write(tmp_path / "s.jsonl", truth))
    rows = gc.compare_sample(sample, truth)
    assert [(r.batch, r.context_tokens) for r in rows] == [(1, 8192), (4, 16384)]
    assert all(r.prefill_ratio == pytest.approx(1) and r.decode_ratio == pytest.approx(1) for r in rows)
    assert rows[1].num_prefill_steps == len(gc.prefill_steps(4, 16384)) and rows[1].num_decode_steps == 4
    # against the uncalibrated model, the decode fit recovers the sample's calibration
    scale, overhead_ms = gc.fit_decode_calibration(sample, LinearModel())
    assert (scale, overhead_ms) == (pytest.approx(1.2), pytest.approx(3.0))
    slow = gc.compare_sample(sample, LinearModel())
    assert all(r.decode_ratio > 1.2 and r.prefill_ratio > 1.19 for r in slow)
    assert gc.worst_gap(slow) > 0.2


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"s\.jsonl:2: not JSON"),
    ('{"kind": "steps"}', r"s\.jsonl:2: kind must be 'meta' or 'step', got 'steps'"),
    ('{"kind": "step", "batch": 1}', r"s\.jsonl:2: step record lacks \['context_tokens'"),
    ('{"kind": "step", "batch": 1, "context_tokens": 8, "phase": "warmup", "index": 0, "wall_s": 1}',
     r"phase must be 'prefill' or 'decode'"),
    ('{"kind": "step", "batch": 1, "context_tokens": 8, "phase": "decode", "index": 0, "wall_s": 0}',
     r"wall_s > 0"),
    ('{"kind": "meta", "schema": 1}', r"s\.jsonl:2: a second meta record"),
])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, line, message) -> None:
    path = _write(tmp_path / "s.jsonl", LinearModel())
    head, *rest = path.read_text().splitlines()
    path.write_text("\n".join([head, line, *rest]) + "\n")
    with pytest.raises(ValueError, match=message):
        gc.load_sample(path)


def test_a_file_without_meta_or_of_another_schema_is_refused(tmp_path) -> None:
    path = _write(tmp_path / "s.jsonl", LinearModel())
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(ValueError, match="no meta record"):
        gc.load_sample(path)
    path.write_text("\n".join([lines[0].replace('"schema": 1', '"schema": 2'), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="schema 2, this script reads 1"):
        gc.load_sample(path)


def test_the_recorded_sample_parses() -> None:
    sample = gc.load_sample(SAMPLE)
    assert sample.meta["model"] == "qwen3-coder-30b-a3b-instruct/bf16" and "not measured" in sample.meta["note"]
    assert sample.points() == [(b, c) for c in (8192, 16384, 32768, 65536) for b in (1, 2, 4, 8)]
    # 8 × 8 chunks, and one more: the requests decoding meanwhile take a token of the budget each
    assert len(sample.of(8, 65536, "prefill")) == len(gc.prefill_steps(8, 65536)) == 65
    assert len(sample.of(1, 8192, "decode")) == 8


@needs_aic
def test_the_recorded_sample_against_the_h100_model(capsys) -> None:
    """The sample is the H100 model × 1.08 + 1.7 ms (decode) and × 1.05 + 2 ms (prefill), ±1%:
    the comparison must find those gaps and the fit that calibration."""
    assert gc.main(["compare", str(SAMPLE), "--gpu", "h100_sxm"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | 65536 |" in out and "KV blocks: vLLM allocated 7302, the profile's memory model says 7396" in out
    assert "Decode fit (least squares over every decode step): scale 1.08" in out
    assert "within the ±15% tolerance" in out
    assert gc.main(["compare", str(SAMPLE), "--gpu", "h100_sxm", "--tolerance", "0.05"]) == 1
    assert "OUTSIDE the ±5% tolerance" in capsys.readouterr().out
    # with the fitted calibration the decode steps agree to the jitter
    assert gc.main(["compare", str(SAMPLE), "--gpu", "h100_sxm", "--scale", "1.081", "--overhead-ms", "1.695",
                    "--tolerance", "0.07"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 |")]
    assert all(0.985 < float(r.split("|")[-2]) < 1.015 for r in rows)


def test_cli_errors_are_one_line(tmp_path, capsys) -> None:
    assert gc.main(["compare", str(tmp_path / "missing.jsonl"), "--gpu", "h100_sxm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_check.py compare: error: ") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        gc.main(["measure", "--kv-cache-dtype", "fp4"])
    assert capsys.readouterr().err.startswith("gpu_check.py measure: error: --kv-cache-dtype: invalid choice")


def test_measure_without_a_gpu_says_what_it_needs(tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: measure would run")
    assert gc.main(["measure", "--out", str(tmp_path / "steps.jsonl")]) == 2
    assert "measure needs an NVIDIA GPU and the GPU build of vLLM" in capsys.readouterr().err
    assert not (tmp_path / "steps.jsonl").exists()
