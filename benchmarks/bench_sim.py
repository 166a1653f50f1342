"""Simulator speed per policy: simulated seconds per CPU second on the full bundled workload (issue 12 §5).

Scenario: every bundled mini-swe-agent session (``compare``'s default trace folder, 74
sessions, full length: no turn or context cap, no KV scaling) arriving as a Poisson process at
1.2x FCFS's knee on one H100 SXM (Qwen3-30B-A3B, the profile's whole KV: 7,396 blocks), replayed by
:mod:`eval.sim` for each policy of ``DEFAULT_POLICIES`` (any ``compare`` policy with
``--policies``) exactly as the main job runs it (``eval.policies.POLICIES``: scheduler,
``additional_config``, engine settings, and the admission window for the policies that come with
the control plane), with events going to an in-memory sink that keeps the kinds the metrics read,
as in ``compare`` (``--all-events``: every kind, as before 2026-12-03). At this
load FCFS is past its knee: requests wait for KV most of the run (the KV-blocked regime).

Target: >= 150x simulated seconds per CPU second for every policy. CPU seconds
(``time.process_time``) rather than wall seconds, because the 2-core dev box is shared.

Measured 2026-12-02, side by side: each policy's old (2f11b5f) and new (e8c9b96) code run at the
same time, one process each, on the 2-core box (load 1.5-3.1: CPU seconds of the same code vary by
up to ~40% between calls here, so only the pairs compare). Results (makespan, preemptions) are
equal both ways.

=============  ==========================  ==========================  =======
policy         old: CPU s, sim/CPU, calls  new: CPU s, sim/CPU, calls  speedup
=============  ==========================  ==========================  =======
fcfs           62.9, 127x, 34,462          62.8, 127x, 29,087          1.00x
continuum      86.8,  80x, 102,890         70.5,  99x, 36,630          1.23x
autellix       243.6, 50x, 202,546         156.1, 79x, 193,990         1.56x
mars-preview   215.6, 52x, 329,651         147.7, 76x, 213,947         1.46x
vllm-tuned     147.0, 75x, 127,669         120.5, 91x, 61,971          1.22x
=============  ==========================  ==========================  =======

Unpaired at e8c9b96 (two benches at once, load ~2): infercept 56-71 s (111-143x), thunderagent
46-55 s (119-142x), mars 52 s (126x); on a quiet box earlier fcfs/infercept/mars ran at 215-237x.
After e8c9b96, the KV pool's per-block bookkeeping runs inline
(``fast_paths.install_fused_block_allocation``): get_new_blocks 1.68 -> 0.98 s and cache_full_blocks
1.64 -> 1.13 s under cProfile on 20 sessions x 40 turns (fcfs); unprofiled the gain is within the
noise (``farm-bench`` A/B CPU 0.94-1.01 over 3 pairs of fcfs + autellix on that workload).

What changed (all exact: 12 policies x 2 KV-bound workloads give bit-identical per-request times
and events, and ``tests/unit/eval/test_sim_fast_paths.py`` compares every policy with the fast
paths off): a request's block count is O(1) (autellix and mars-preview counted every running
request's blocks each step: 10^9 generator steps per run); the watched prefix-cache map calls back
only for keys the memo read; PLAS state is updated by constructor; mars-preview's blocked decode
runs are certified (its aging clocks take the run's last step start, ``run_last_step_s``); a
blocked run may evict the waiting head's prefix hit from its *end* (stock vLLM, infercept,
continuum, autellix: the head's need drops by at most the blocks the run took, so it stays
blocked), which halved fcfs's and vllm-tuned's ``schedule()`` calls.

Measured again 2026-12-02 evening, side by side the same way (old 2f35bef, new 966f950: the
prefix-cache map's inserts and pops inline in the fused allocation, and a coalesced decode run's
tokens appended in one call, ``fast_paths.install_batched_token_append``), load 1.6-2.7:

=============  ==================  ==================  =======
policy         old: CPU s, sim/CPU  new: CPU s, sim/CPU  speedup
=============  ==================  ==================  =======
fcfs           51.8, 154x          40.3, 198x          1.29x
autellix       183.4, 67x          159.7, 77x          1.15x
mars-preview   270.1, 42x          252.3, 45x          1.07x
=============  ==================  ==================  =======

(mars-preview's old figure here is 1.8x the earlier 147.7 s of nearly the same code: this box's CPU
seconds differ between sessions as well; e8c9b96 and 2f35bef side by side on 20 sessions x 40
turns: 27.0 vs 22.5 s, so no regression in between.) 8350953 then walks the prefix-cache map
inline on lookups (``fast_paths.install_fused_prefix_lookup``): the ideal times, where every turn
re-reads its whole context, 7.97 -> 3.37 CPU s for 16 sessions side by side (2.4x). b3090ef: our
schedulers' KV bookkeeping (``kv_block_counts`` built a set over every pinned block each step):
thunderagent 56.4 -> 44.9 CPU s (1.26x, 146x), continuum 64.4 -> 54.4 (1.18x, 128x), side by side
with 2f35bef at load ~4. 4f6bd99 fuses vLLM's ``touch``/``free_blocks`` (every turn touches and
frees its whole context); not benchmarked separately.

Measured 2026-12-03, side by side the same way (old 70022ca, new 294d39d: blocked chunked-prefill
runs for our schedulers that certify them, ``InprocEngine.max_blocked_prefill_run``), load ~2:

=============  ==========================  ==========================  =======
policy         old: CPU s, sim/CPU, calls  new: CPU s, sim/CPU, calls  speedup
=============  ==========================  ==========================  =======
autellix       178.5, 69x, 193,990         125.5, 98x, 74,508          1.42x
mars-preview   285.3, 39x, 213,947         316.0, 36x, 194,355         0.90x
=============  ==========================  ==========================  =======

Same makespan, engine steps and preemptions both ways. Autellix's long calls sit at its last
level, whose 256-token quantum is the same every step, so their re-prefills merge. The preview's
merge rarely: with chunk shrinking a blocked head stays blocked only until the run would evict a
block of its prefix hit, which a run of 256-token chunks reaches at once (its pair above is
within this box's noise: profiled on 20 sessions x 40 turns the two take 43.3 and 44.4 CPU s).

Measured 2026-12-03 (later), side by side the same way (old f594893, new 9038120), load ~2. New:
compare's sinks take only the kinds its metrics read and the simulator builds no others (no
``engine_step`` snapshot, with its KV count, and no ``admission_update`` per tick; the old code
kept every kind, as this script did then); the prefix-hit memo is built at a request's second
lookup (our schedulers' look at arrival not counted); the prefix walk, ``cached_blocks`` and the
retained-only count run as C-level passes:

=============  ==================  ==================  =======
policy         old: CPU s, sim/CPU  new: CPU s, sim/CPU  speedup
=============  ==================  ==================  =======
thunderagent   51.4, 127x          44.3, 148x          1.16x
mars           66.5,  98x          60.2, 109x          1.10x
fcfs           59.2, 134x          56.9, 140x          1.04x
vllm-tuned     171.3, 64x          166.3, 66x          1.03x
autellix       175.7, 70x          171.7, 72x          1.02x
continuum      67.9, 102x          68.7, 101x          0.99x
=============  ==================  ==================  =======

Same makespan, ``schedule()`` calls, engine steps and preemptions both ways (golden runs with
every event kind bit-identical). vllm-tuned's pair ran on an intermediate version (memo at the
third lookup, peeks counted); the others on 9038120's code. The box's own speed moved ~25%
since yesterday's figures (continuum's same code: 54.4 then, 67.9 now).

Measured 2026-12-03 (third session), side by side the same way (old 888fdfc; new: mars's
output-length tail sums by a C-level accumulate, the prefix walk as one lazy pass that stops at
the first miss, the blocked run's eviction check and the retained pool's pinned-once test in C
passes), one pair at a time: new 9d44434 with a clean-clone CI run alongside (load ~5), mars's
pair on 2682edc (the same plus a pool-key memo, since dropped) at load ~2:

=============  ==================  ==================  =======
policy         old: CPU s, sim/CPU  new: CPU s, sim/CPU  speedup
=============  ==================  ==================  =======
fcfs           65.9, 121x          61.2, 130x          1.08x
continuum      96.3,  72x          92.1,  75x          1.05x
mars           53.9, 122x          53.7, 122x          1.00x
=============  ==================  ==================  =======

Within this box's noise: continuum's pair on 2682edc gave 0.89x, and A/B runs of one 30-session
workload varied 23-34 CPU s for the same code. Two tries that measured slower were dropped: the
pool-key memo (block caching took a miss on every new block) and ``free_blocks`` with its loop as
C-level ``setattr`` passes (2.5x slower than the loop on 3,000 blocks, by ``timeit`` on vLLM's
``BlockPool``).

Measured 2026-12-03 (fourth session), old 96a8d85 and new 4d74f6a side by side. New: a finishing
turn's pin takes over the request's references on its cached prefix
(``seams.blocks.pin_finishing_request_blocks``) instead of touching the whole prefix and then freeing it
with the rest; the retained pool keeps its pinned block ids through ``add``/``pop`` (one C-level
pass over the one entry) instead of rebuilding a set over every entry after each add; and the
retention hit count runs in C passes. Under cProfile (mars, full workload at 1.2x, both at once):
112.0 -> 94.4 profiled CPU s, 33.6 M -> 25.8 M function calls; ``free_blocks`` 6.4 -> 3.0 s,
``touch`` 4.1 -> 1.8 s, the reuse measurement 5.7 -> 2.2 s. Unprofiled, within the noise: mars
55.0 -> 53.8 and 53.8 -> 59.9 CPU s (the two cores swapped between the pairs), thunderagent 45.5 ->
45.8, continuum 64.1 -> 68.0; ``compare --quick --no-cache``, old and new at once: 672 and 678 s,
the same tables. Tried and dropped: the knee guard also counting each session's tool calls not
yet started (valid, but paired probes stopped no sooner: 25.7 / 17.2 / 24.6 s against 25.2 / 16.2
/ 24.4 s; tools are ~27% of an ideal E2E), and vLLM's free queue as an ``OrderedDict`` (a
touch-and-free cycle of 3,000 blocks took 0.40-0.60 us per block against the linked list's 0.31).

Measured 2026-12-03 (fifth session), after profiling fcfs, vllm-tuned and mars-preview on the
full workload (cProfile, tottime): a blocked run's check of the waiting head's prefix hit built
the head's pool keys through ``make_block_hash_with_group_id`` per block (fcfs: 4.8 M calls, 7.4 of
101 profiled s), listed the run's blocks with a ``len()`` per block (mars-preview: 45 M calls) and,
under the stock rule, looped in Python over every evicted block of the head's past its hit
(vllm-tuned: 600 us per call); the prefix-hit memo copied its blocks and keys at every evicted hit
block (mars-preview: 2.9 M callbacks, 26 s); ``popleft_n`` and our eviction loop were two passes;
``cache_full_blocks`` copied the request's remaining hashes for every chunk. Now: C-level key and
position passes, one walk that stops at the first unsafe block, a memo cut that records its
length, one pop-and-evict pass. Golden runs bit-identical. Side by side (old on one core, new on
the other, at once; the cores differ by up to ~10%):

=============  ============================  ================  =======
policy         old                           old -> new CPU s  speedup
=============  ============================  ================  =======
fcfs           f2bfa39 (session start)       48.3 -> 43.5      1.11x
vllm-tuned     f2bfa39 (session start)       115.3 -> 106.6    1.08x
mars-preview   fd018b6 (first change only)   283.0 -> 256.1    1.11x
=============  ============================  ================  =======

Then every policy at 4c4a706, two benches at once (load ~2), quiet box:

=============  ======  =======  ========  =========  ========
policy         CPU s   sim/CPU  sched     steps      preempt
=============  ======  =======  ========  =========  ========
thunderagent   31.3    209x     24,525    550,483    14
fcfs           42.8    186x     29,087    396,328    50
infercept      51.0    156x     35,604    396,444    54
mars           43.9    149x     21,948    545,752    0
continuum      48.7    143x     36,630    397,797    42
autellix       105.2   117x     76,508    487,472    2,051
vllm-tuned     106.7   103x     61,971    431,371    11,394
mars-preview   191.5    59x     194,355   469,545    2,784
=============  ======  =======  ========  =========  ========

Below 150x, and why: what is left is vLLM's own per-block work: past the knee every turn
re-prefills its context (fcfs: 6.0 M blocks allocated, evicted from and inserted into the prefix
cache per run; autellix 8.1 M), plus ``update_from_output``'s per-token handling; vllm-tuned's
11,394 preemptions (each frees and later re-prefills a context in 512-token chunks); and the
preview's single steps (above: 194 k ``schedule()`` calls).

Measured 2026-12-04 (sixth session, another machine of the same kind: at 79e7812, two benches
at once on a quiet box, vllm-tuned 227x, continuum 267x, mars 320x, autellix 217x, thunderagent
359x, fcfs 412x, infercept 338x, and mars-preview 125x, the only one below). The preview's single
steps, classified: most were blocked runs cut short because the run would evict a block of the
waiting head's hit (the rule for chunks shrunk to fit), then admission ticks, then its periodic
re-sort. Now (all exact: golden runs bit-identical, every event kind, 8 policies): under vLLM's
full-sequence gate (``scheduler_reserve_full_isl``, its default) a blocked head stays blocked
whatever the run evicts (``InprocEngine._keep_head_blocked``); a run spans admission ticks while no
session waits for admission, each tick inside it reading the KV its single steps would have left;
the preview's runs span its periodic re-sort (``resort_keeps_order``); the simulator's time bound
comes before the head check. Side by side (old on one core, new on the other, at once):

=============  ==================  ==================  =======
policy         old: CPU s, calls   new: CPU s, calls   speedup
=============  ==================  ==================  =======
mars-preview   112.2, 194,355      73.2, 103,478       1.53x
=============  ==================  ==================  =======

(new: 7bed588; the re-sort change then took the preview to 91,024 calls). Every policy at
aa22117, two benches at once with a review's fuzzer running too (load 1.6-2.9):

=============  ======  =======  ========  =========  ========
policy         CPU s   sim/CPU  sched     steps      preempt
=============  ======  =======  ========  =========  ========
fcfs           22.7    351x     29,087    396,328    50
thunderagent   21.5    305x     22,028    550,483    14
mars           25.4    258x     21,948    545,752    0
infercept      31.2    255x     35,604    396,444    54
continuum      31.9    218x     36,630    397,797    42
vllm-tuned     55.9    196x     61,971    431,371    11,394
autellix       64.8    189x     76,508    487,472    2,051
mars-preview   72.2    156x     91,024    469,545    2,784
=============  ======  =======  ========  =========  ========

Measured 2026-12-05, mars-offload (MarsScheduler over vLLM's host KV tier, 256 GiB) before and
after its merged runs were certified (old 4e51397; new 0e4ec90, then 2f53129: an unsorted running
list bounds a run instead of refusing it; one at a time, load ~2), on the first 15 sessions x 40
turns (``--policies mars-offload --sessions 15 --max-turns 40``): 14.8 -> 6.2 -> 4.2 CPU s,
86,686 -> 14,961 -> 3,689 ``schedule()`` calls for the same 86,409 steps; every event but the
``engine_step`` snapshots, every turn's times and the makespan the same (sha256 of the runs).

Prints one row per policy (simulated s, wall s, CPU s, simulated s per CPU s, ``schedule()``
calls, engine steps, preemptions) and appends the rows to
``benchmarks/results/bench_sim.parquet`` (git sha, vLLM version, machine, parameters).

    python benchmarks/bench_sim.py                         # DEFAULT_POLICIES, ~1-4 min each
    python benchmarks/bench_sim.py --policies fcfs,mars    # a subset
    python benchmarks/bench_sim.py --profile 25            # + cProfile's top 25 per policy
    MARS_SIM_FAST_PATHS=0 python benchmarks/bench_sim.py   # fast paths off (the reference)
    python benchmarks/bench_sim.py --smoke                 # CI: 4 sessions x 10 turns
    python benchmarks/bench_sim.py --policies mars-offload --sessions 15 --max-turns 40
                                      # a host-tier policy, 256 GiB (--host-kv-gib), trimmed
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.compare_setup import default_traces_dir  # noqa: E402 - after the path
from eval.policies import DEFAULT_HOST_KV_GIB, POLICIES  # noqa: E402
from eval.runs import METRIC_KINDS  # noqa: E402

KNEE_H100_PER_S = 0.010
"""FCFS's knee on the full bundled workload, one H100 SXM, seed 0 (issue 12's measurement with
``compare --sessions 0 --max-turns 0 --max-context-tokens 0 --kv-scale 1``: mean slowdown 6.5 at
0.010/s, 10.1 at 0.012/s)."""
TARGET_PER_CPU_X = 150.0
"""Issue 12 §5: simulated seconds per CPU second, every policy."""
DEFAULT_POLICIES: tuple[str, ...] = ("fcfs", "vllm-tuned", "autellix", "infercept", "continuum",
                                     "thunderagent", "mars-preview", "mars")
"""The policies the target is for: the baselines of issue 12 (continuum-dy, the ablations and the
``unbounded-kv`` reference are ``compare`` policies too; pass them with ``--policies``)."""


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default=None, help="trace folder (default: compare's bundled traces)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated compare policy names (default: {','.join(DEFAULT_POLICIES)}; "
                        f"any of {', '.join(POLICIES)})")
    p.add_argument("--gpu", default="h100_sxm", help="GPU profile key (default h100_sxm)")
    p.add_argument("--model", default="qwen3-30b-a3b", help="model profile key")
    p.add_argument("--base-rate", type=float, default=KNEE_H100_PER_S,
                   help=f"FCFS knee, sessions/s (default {KNEE_H100_PER_S}: H100, full workload)")
    p.add_argument("--load", type=float, default=1.2, help="multiple of --base-rate (default 1.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-events", action="store_true", help="run without an event sink")
    p.add_argument("--all-events", action="store_true",
                   help="keep every event kind (compare keeps only the kinds its metrics read)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile each run and print its top N functions by cumulative time")
    p.add_argument("--smoke", action="store_true", help="tiny size for CI (4 sessions x 10 turns)")
    p.add_argument("--sessions", type=int, default=0, help="keep the first N sessions (0: all)")
    p.add_argument("--max-turns", type=int, default=0, help="keep each session's first N turns (0: all)")
    p.add_argument("--host-kv-gib", type=float, default=None,
                   help="host KV tier of the policies that have one (mars-offload, vllm-offload-*), GiB, "
                        "as compare --host-kv-gib (default 256); the others run without")
    p.add_argument("--no-record", action="store_true", help="do not append the Parquet rows")
    return p.parse_args(argv)


def _workload(args: argparse.Namespace) -> Any:
    from eval.workloads import PoissonArrivals, load_trace_dir, trim_workload, with_arrivals

    traces = args.traces or default_traces_dir(os.environ, Path.cwd())
    workload = load_trace_dir(traces, on_error="skip")
    if args.smoke:
        workload = trim_workload(workload, num_sessions=4, max_turns=10)
    elif args.sessions or args.max_turns:
        workload = trim_workload(workload, num_sessions=args.sessions or None,
                                 max_turns=args.max_turns or None)
    return with_arrivals(workload, PoissonArrivals(rate_per_s=args.base_rate * args.load),
                         seed=args.seed)


def _config(policy: str, num_gpu_blocks: int, seed: int, host_kv: tuple[float, int] | None = None) -> Any:
    """``SimConfig`` of one compare policy (as ``compare --admission auto`` builds it); ``host_kv``:
    (GiB, KV bytes per block) of the tier of a policy that has one (else it runs without)."""
    from eval.sim import SimConfig
    from mars_openhands.engine.harness.inproc_engine import InprocEngineParams
    from mars_openhands.engine.harness.offload.params import HostKvParams

    spec = POLICIES[policy]
    tier = None
    if spec.host_kv is not None and host_kv is not None:
        tier = HostKvParams(size_gib=host_kv[0], kv_bytes_per_block=host_kv[1], **spec.host_kv)
    engine = InprocEngineParams(num_gpu_blocks=num_gpu_blocks, host_kv=tier,
                                additional_config=dict(spec.additional_config), **spec.engine)
    return SimConfig(policy=spec.scheduler, engine=engine, seed=seed,
                     is_admission_enabled=spec.has_control_plane)


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _record(rows: list[dict[str, Any]]) -> None:
    try:
        import pandas as pd
    except ImportError:
        return
    out = Path(__file__).parent / "results" / "bench_sim.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    if out.exists():
        frame = pd.concat([pd.read_parquet(out), frame], ignore_index=True)
    frame.to_parquet(out, index=False)


def _run_one(policy: str, workload: Any, timer: Any, num_blocks: int,
             args: argparse.Namespace) -> dict[str, Any]:
    from eval.sim import Simulator, fast_paths_enabled
    from mars_openhands.stream.transport import ListSink

    config = _config(policy, num_blocks, args.seed, args.host_kv)
    # compare's runs keep the kinds the metrics read; the simulator builds no others.
    sink = None if args.no_events else ListSink(kinds=None if args.all_events else METRIC_KINDS)
    sim = Simulator(workload, config, timer, sink)
    profiler = cProfile.Profile() if args.profile else None
    cpu0 = time.process_time()
    if profiler is not None:
        profiler.enable()
    result = sim.run()
    if profiler is not None:
        profiler.disable()
    cpu_s = time.process_time() - cpu0
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.profile)
        print(f"# profile of {policy}\n{text.getvalue()}", file=sys.stderr)
    return {
        "policy": policy, "admission": config.is_admission_enabled,
        "fast_paths": fast_paths_enabled(), "simulated_s": result.makespan_s,
        "wall_s": result.wall_s, "cpu_s": cpu_s, "speed_per_cpu_x": result.makespan_s / cpu_s,
        "schedule_calls": result.num_schedule_calls, "engine_steps": result.num_engine_steps,
        "preemptions": result.num_preemptions, "num_events": result.num_events,
        "unfinished": sum(s.end_s is None for s in result.sessions.values()),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every policy once (after a warm-up); print and return one row per policy."""
    args = _args(argv)
    import vllm

    from eval.sim import Simulator
    from eval.workloads import trim_workload
    from mars_openhands.engine.harness.executor.profiles import GpuProfile, estimate_kv_capacity
    from mars_openhands.engine.harness.executor.timing import StepTimeModel
    from mars_openhands.stream.transport import ListSink

    profile = GpuProfile(gpu=args.gpu, model=args.model)
    timer, num_blocks = StepTimeModel(profile), estimate_kv_capacity(profile).num_gpu_blocks
    args.host_kv = (DEFAULT_HOST_KV_GIB if args.host_kv_gib is None else args.host_kv_gib,
                    profile.kv_bytes_per_token * 16)  # compare's: the deployment's bytes per block
    workload = _workload(args)
    rate = args.base_rate * args.load
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    common = {
        "bench": "bench_sim", "git_sha": _git_sha(), "vllm": vllm.__version__,
        "machine": f"{platform.node()} {platform.machine()} cpus={os.cpu_count()}",
        "gpu": args.gpu, "model": args.model, "num_gpu_blocks": num_blocks, "rate_per_s": rate,
        "host_kv_gib": args.host_kv[0],
        "load_x": args.load, "num_sessions": len(workload.sessions), "num_turns": workload.num_turns,
        "events": "none" if args.no_events else "all" if args.all_events else "metric kinds",
    }
    length = ("trimmed to 4 sessions x 10 turns (--smoke)" if args.smoke
              else "trimmed (--sessions/--max-turns)" if args.sessions or args.max_turns else "full length")
    print(f"bench_sim: {common['num_sessions']} sessions / {common['num_turns']} turns, {length}, "
          f"{args.gpu} x {args.model}, {num_blocks} KV blocks, Poisson {rate:.4g}/s "
          f"({args.load}x knee {args.base_rate}/s), seed {args.seed}, target >= {TARGET_PER_CPU_X:g}x")
    print(f"{'policy':<13} {'adm':>3} {'sim s':>8} {'wall s':>7} {'cpu s':>7} {'sim/cpu':>8} "
          f"{'sched':>7} {'steps':>8} {'preempt':>7} {'load1':>5}")
    rows = []
    for policy in policies:
        # Warm-up: engine construction and first-call costs, on a 2-session slice.
        warm = trim_workload(workload, num_sessions=2, max_turns=3)
        Simulator(warm, _config(policy, num_blocks, args.seed, args.host_kv), timer, ListSink()).run()
        row = {**common, **_run_one(policy, workload, timer, num_blocks, args),
               "load_avg_1m": os.getloadavg()[0]}
        rows.append(row)
        flag = "" if row["speed_per_cpu_x"] >= TARGET_PER_CPU_X else "  < target"
        print(f"{policy:<13} {'on' if row['admission'] else 'off':>3} {row['simulated_s']:8.0f} "
              f"{row['wall_s']:7.1f} {row['cpu_s']:7.1f} {row['speed_per_cpu_x']:7.0f}x "
              f"{row['schedule_calls']:7d} {row['engine_steps']:8d} {row['preemptions']:7d} "
              f"{row['load_avg_1m']:5.1f}{flag}" + (f"  unfinished={row['unfinished']}"
                                                    if row["unfinished"] else ""), flush=True)
    if not args.no_record and not args.smoke:
        _record(rows)
    return rows


if __name__ == "__main__":
    main()
