"""Fit a profile's ``scale`` and ``overhead_ms`` to published runs from emulated step traces.

Each emulated run (``benchmarks/bench_timing.py``) leaves a step trace: per step the modelled
time ``model_s = scale0 × estimate + overhead0``. In a closed-loop benchmark with fixed output
lengths the sequence of steps hardly depends on the step times, so the model-only duration under
another calibration is linear in it::

    T(scale, overhead) = scale × Σ estimate_s + overhead × num_steps

and matching a published throughput means ``T = output_tokens / published_tok_s``. One run fixes
``overhead`` at a given ``scale``; two runs of the same model (e.g. H100 and H200) fix both by
least squares. Pure arithmetic on the traces: no server, no kernel data.

Usage::

    python scripts/calibrate_timing.py --scale0 1.0 --overhead0-ms 1.5 \\
        RUN_DIR:OUTPUT_TOKENS:PUBLISHED_TOK_S [RUN_DIR:...]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

WARMUP_STEPS = 4
"""Steps of the benchmark's warm-up request at the start of each trace."""


@dataclass(frozen=True)
class RunTotals:
    """Sums of one trace: Σ kernel estimate (s), number of steps, target model time (s)."""

    estimate_s: float
    num_steps: int
    target_s: float


def load_totals(run_dir: Path, output_tokens: int, published_tok_s: float, scale0: float,
                overhead0_s: float) -> RunTotals:
    """Recover Σ estimate from a trace written with calibration (scale0, overhead0)."""
    records = [json.loads(line)
               for line in (run_dir / "steps.jsonl").read_text().splitlines()[WARMUP_STEPS:]]
    estimate_s = sum((r["model_s"] - overhead0_s) / scale0 for r in records)
    return RunTotals(estimate_s, len(records), output_tokens / published_tok_s)


def fit(runs: list[RunTotals], scale: float | None = None) -> tuple[float, float]:
    """Least-squares (scale, overhead_s) for ``runs``; with ``scale`` given, fit overhead only.

    Raises:
        ValueError: no runs, or two unknowns with fewer than two runs.
    """
    if not runs:
        raise ValueError("need at least one run to calibrate")
    if scale is not None or len(runs) == 1:
        s = 1.0 if scale is None else scale
        num = sum((r.target_s - s * r.estimate_s) * r.num_steps for r in runs)
        return s, num / sum(r.num_steps ** 2 for r in runs)
    # Normal equations of min Σ (s E_i + o N_i - T_i)^2.
    see = sum(r.estimate_s ** 2 for r in runs)
    sen = sum(r.estimate_s * r.num_steps for r in runs)
    snn = sum(r.num_steps ** 2 for r in runs)
    set_ = sum(r.estimate_s * r.target_s for r in runs)
    snt = sum(r.num_steps * r.target_s for r in runs)
    det = see * snn - sen ** 2
    if abs(det) < 1e-12:
        raise ValueError("runs are collinear; fix scale with --scale")
    return (set_ * snn - snt * sen) / det, (see * snt - sen * set_) / det


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="RUN_DIR:OUTPUT_TOKENS:PUBLISHED_TOK_S")
    parser.add_argument("--scale0", type=float, default=1.0, help="scale the traces used")
    parser.add_argument("--overhead0-ms", type=float, default=1.5,
                        help="overhead_ms the traces used")
    parser.add_argument("--scale", type=float, default=None, help="fix scale, fit overhead")
    args = parser.parse_args(argv)
    totals = []
    for spec in args.runs:
        run_dir, tokens, tok_s = spec.rsplit(":", 2)
        totals.append(load_totals(Path(run_dir), int(tokens), float(tok_s), args.scale0,
                                  args.overhead0_ms / 1000))
    scale, overhead_s = fit(totals, args.scale)
    print(json.dumps({"scale": round(scale, 4), "overhead_ms": round(overhead_s * 1000, 3)}))
    for spec, r in zip(args.runs, totals, strict=True):
        model_s = scale * r.estimate_s + overhead_s * r.num_steps
        print(json.dumps({"run": spec, "model_s": round(model_s, 2),
                          "target_s": round(r.target_s, 2),
                          "error": round(model_s / r.target_s - 1, 4)}))


if __name__ == "__main__":
    main()
