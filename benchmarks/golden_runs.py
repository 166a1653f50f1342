"""Golden runs: every ``compare`` policy on two KV-bound workloads, every event, for bit-identity
checks of simulator and scheduler refactors (issue 29: "golden runs bit-identical").

Workloads: the bundled mini-swe-agent traces (``compare``'s default folder), trimmed and replayed
by :mod:`eval.sim` with Poisson arrivals on one H100 SXM (Qwen3-30B-A3B step times) whose KV cache
is cut so that requests wait for KV (5-1,377 preemptions per run)::

    w1  30 sessions x <= 40 turns, contexts <= 8,000 tokens,  0.10 sessions/s,   600 blocks, seed 0
    w2  24 sessions x <= 60 turns, contexts <= 14,000 tokens, 0.15 sessions/s, 1,000 blocks, seed 1

For each (workload, policy) it writes ``OUT/<w>-<policy>.jsonl`` (every event as sorted JSON, then
one line of makespan, engine steps, preemptions, ``schedule()`` calls and every request's times)
and prints its sha256, then ``ran=`` the sha256 of the same lines less the ``admission_update``
events: the window is observed for every policy but binds only where admission is enforced, so a
change to what it reports moves the first hash of every policy and the second only where the run
itself changed. Two trees compare by their printed hashes (or ``cmp`` of the files)::

    cd /path/to/old && PYTHONPATH=$PWD python /path/to/new/benchmarks/golden_runs.py /tmp/g-old
    cd /path/to/new && PYTHONPATH=$PWD python benchmarks/golden_runs.py /tmp/g-new
    for f in /tmp/g-new/*.jsonl; do cmp -s $f /tmp/g-old/$(basename $f) || echo DIFF $f; done

(``PYTHONPATH`` picks the tree whose code runs; ``--traces DIR`` where the cwd does not find the
bundled traces.) About 1-4 CPU s per run, ~2 minutes in all on a
quiet 2-core box; the engine build dominates.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ORIGIN = datetime(2026, 1, 1, tzinfo=UTC)
"""Fixed wall origin: event timestamps are the virtual clock's, so equal runs give equal bytes."""
WORKLOADS: dict[str, tuple[int, int, float, int, int, int]] = {
    "w1": (30, 40, 0.10, 600, 0, 8000),
    "w2": (24, 60, 0.15, 1000, 1, 14000),
}
"""name -> (sessions, max turns, arrivals per s, KV blocks, seed, max context tokens)."""


def _run(workload: Any, policy: str, blocks: int, seed: int, timer: Any) -> str:
    """One simulator run of ``policy``, as JSON lines (events, then the summary)."""
    from eval.policies import POLICIES
    from eval.sim import SimConfig, Simulator
    from mars_openhands.stream.transport import ListSink

    try:
        from mars_openhands.engine.harness.inproc_engine import InprocEngineParams
    except ImportError:  # a tree from before engine/harness/ (the "old" side of a comparison)
        from mars_openhands.engine.inproc import InprocEngineParams  # type: ignore[no-redef]

    spec = POLICIES[policy]
    engine = InprocEngineParams(num_gpu_blocks=blocks, additional_config=dict(spec.additional_config),
                                **spec.engine)
    config = SimConfig(policy=spec.scheduler, engine=engine, seed=seed,
                       is_admission_enabled=spec.has_control_plane)
    sink = ListSink()
    result = Simulator(workload, config, timer, sink, ORIGIN).run()
    lines = [json.dumps(e.model_dump(mode="json"), sort_keys=True) for e in sink.events]
    turns = [(sid, [(t.request_id, t.submit_s, t.first_scheduled_s, t.first_token_s, t.finish_s,
                     t.num_cached_tokens, t.num_preemptions) for t in s.turns])
             for sid, s in sorted(result.sessions.items())]
    lines.append(json.dumps([result.makespan_s, result.num_engine_steps, result.num_preemptions,
                             result.num_schedule_calls, turns]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run every policy on both workloads; write the files and print one hash per run."""
    from eval.compare_setup import default_traces_dir
    from eval.policies import POLICIES
    from eval.workloads import PoissonArrivals, load_trace_dir, trim_workload, with_arrivals

    try:
        from mars_openhands.engine.harness.executor.profiles import GpuProfile
        from mars_openhands.engine.harness.executor.timing import StepTimeModel
    except ImportError:  # a tree from before engine/harness/
        from mars_openhands.engine.executor.profiles import GpuProfile  # type: ignore[no-redef]
        from mars_openhands.engine.executor.timing import StepTimeModel  # type: ignore[no-redef]

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder for the event files")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all)")
    p.add_argument("--traces", type=Path, default=None,
                   help="trace folder (default: compare's bundled traces, found from the cwd)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    timer = StepTimeModel(GpuProfile(gpu="h100_sxm", model="qwen3-30b-a3b"))
    traces = load_trace_dir(args.traces or default_traces_dir(os.environ, Path.cwd()),
                            on_error="skip")
    for name, (sessions, turns, rate, blocks, seed, context) in WORKLOADS.items():
        workload = with_arrivals(
            trim_workload(traces, num_sessions=sessions, max_turns=turns, max_context_tokens=context),
            PoissonArrivals(rate_per_s=rate), seed=seed)
        for policy in args.policies.split(","):
            cpu0 = time.process_time()
            text = _run(workload, policy, blocks, seed, timer)
            (args.out / f"{name}-{policy}.jsonl").write_text(text)
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            ran = "\n".join(line for line in text.splitlines() if '"kind": "admission_update"' not in line)
            ran_digest = hashlib.sha256(ran.encode()).hexdigest()[:16]
            print(f"{name} {policy:22s} {digest} ran={ran_digest} cpu={time.process_time() - cpu0:.1f}s",
                  flush=True)


if __name__ == "__main__":
    main()
