"""The sweep of ``mars-openhands compare``: ideal times, knee searches, capacity and the runs of
every policy at every load on every GPU, written into one results directory (design.md §7).

:func:`run_sweep` drives the phases on a :class:`eval.pool.Pool` (``jobs`` worker processes, or
in-process): each session's ideal E2E (alone under FCFS), FCFS's knee on each GPU (the base rate,
:mod:`eval.knee`; several searches interleaved, speculative probes on idle workers), optionally
every policy's own knee (capacity at SLO), then the runs (:mod:`eval.runs`). After every finished
run it rewrites ``results.parquet`` and ``summary.md`` (:mod:`eval.report`), so a crash or Ctrl-C
keeps what finished; the plots come last. Ideal times and knees are cached by content
(:mod:`eval.cache`). The files are listed in :mod:`eval.compare`'s docstring.
"""

from __future__ import annotations

import contextlib
import copy
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from eval.backends import order_for_servers
from eval.cache import ResultCache, content_key
from eval.knee import BaseRateSearch, KneeSearch
from eval.policies import POLICIES, parse_policies, unbounded_kv_blocks
from eval.pool import Pool, Probes
from eval.report import write_plots, write_summary
from eval.runs import (
    Run,
    ideal_task,
    live_execute,
    one_run,
    plan,
    probe_run_task,
    probe_task,
    results_frame,
    run_task,
    slowdown_text,
)
from eval.sweep_options import CompareOptions, GpuSetup
from eval.workloads import Workload
from mars_openhands.cli_signals import EXIT_TERMINATED, Terminated

__all__ = ["EXIT_INTERRUPTED", "CompareInterrupted", "run_compare", "run_sweep"]


def run_compare(workload: Workload, options: CompareOptions, step_timer: Any, out_dir: str | Path, *,
                ideal_s: Mapping[str, float] | None = None, meta: Mapping[str, Any] | None = None,
                simulate_fn: Callable[..., Any] | None = None, progress: Any = None,
                live: Any = None, jobs: int = 1, cache: ResultCache | None = None,
                gpu: str = "") -> pd.DataFrame:
    """Run the sweep on one GPU and write the results directory (see :mod:`eval.compare`).

    :func:`run_sweep` with one :class:`GpuSetup` (``gpu``, ``step_timer``, ``options.num_gpu_blocks``);
    run ids and file names carry no GPU prefix.
    """
    setup = GpuSetup(gpu, step_timer, options.num_gpu_blocks)
    return run_sweep(workload, options, (setup,), out_dir, ideal_s=ideal_s, meta=meta,
                     simulate_fn=simulate_fn, progress=progress, live=live, jobs=jobs, cache=cache)


def run_sweep(workload: Workload, options: CompareOptions, gpus: Sequence[GpuSetup], out_dir: str | Path, *,
              ideal_s: Mapping[str, float] | None = None, meta: Mapping[str, Any] | None = None,
              simulate_fn: Callable[..., Any] | None = None, progress: Any = None,
              live: Any = None, jobs: int = 1, cache: ResultCache | None = None) -> pd.DataFrame:
    """Run the sweep on every GPU of ``gpus`` and write one results directory.

    Without ``live`` every run is simulated (``sim``), on ``jobs`` worker processes (the ideal times,
    the knee searches of all GPUs interleaved, then every run; ``jobs=1`` or an injected
    ``simulate_fn`` runs in this process). With a :class:`eval.backends.LiveBackend` (one GPU only)
    every run is replayed on it (one server per policy, runs grouped by policy, in this process);
    the base-rate search still runs in the simulator (``emulated`` models the same GPU; ``cpu``/URL
    need a given base rate); ideal times are the simulator's for ``emulated`` and isolated replays
    on the backend otherwise (on FCFS if it is among the policies, else on the first one). ``live``
    is closed (its server stopped) on return.

    Args:
        workload: sessions (their arrival times are replaced by Poisson arrivals per load).
        options: policies, loads, admission, search parameters (``num_gpu_blocks`` is per GPU here).
        gpus: the GPUs (>= 1); several get GPU-prefixed run ids, plots and summary sections.
        out_dir: results directory (created).
        ideal_s: session id -> ideal E2E s for every GPU (default: :func:`eval.sim.ideal_times_s`
            under FCFS, per GPU).
        meta: extra facts for ``summary.md`` (workload, profile, ...), printed first.
        simulate_fn: ``eval.sim.simulate`` (tests inject failures here; forces ``jobs=1``).
        progress: a ``rich.progress.Progress`` to report on, or ``None``.
        live: a :class:`eval.backends.LiveBackend`, or ``None`` for ``sim``.
        jobs: worker processes (>= 1).
        cache: ideal times and knees by content hash (:mod:`eval.cache`); ``None``: no cache.

    Returns:
        The results table (:data:`eval.report.RESULT_COLUMNS`), one row per run.

    Raises:
        ValueError: an unknown policy name (the message lists the supported ones); no GPU, or a
            live backend with several.
    """
    parse_policies(options.policies)
    if not gpus or (live is not None and len(gpus) != 1):
        raise ValueError(f"need one GPU for a live backend and at least one for sim, got {len(gpus)}")
    if simulate_fn is not None or live is not None:
        jobs = 1
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = _Sweep(workload, options, tuple(gpus), out_dir, simulate_fn, progress, live,
                   cache or ResultCache(None), dict(meta or {}))
    try:
        with Pool(jobs) as pool:
            return sweep.run(pool, ideal_s)
    finally:
        if live is not None:
            live.close()


class CompareInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM during :func:`run_sweep`; the workers have ended and everything
    finished before it is on disk, under a summary marked INTERRUPTED.

    Attributes:
        num_finished: runs whose Parquet and ``results.parquet``/``summary.md`` rows were written.
        num_runs: runs planned.
        is_terminated: SIGTERM (exit status 143) rather than SIGINT (130).
        has_results: whether a summary was written (a run finished, or the capacity table).
    """

    def __init__(self, num_finished: int, num_runs: int, *, is_terminated: bool = False,
                 has_results: bool | None = None) -> None:
        super().__init__(f"{num_finished} of {num_runs} runs finished")
        self.num_finished, self.num_runs, self.is_terminated = num_finished, num_runs, is_terminated
        self.has_results = num_finished > 0 if has_results is None else has_results

    @property
    def exit_status(self) -> int:
        """130 after SIGINT, 143 after SIGTERM (``128 +`` the signal, as a shell reports it)."""
        return EXIT_TERMINATED if self.is_terminated else EXIT_INTERRUPTED


EXIT_INTERRUPTED = 128 + int(signal.SIGINT)
"""Exit status after Ctrl-C (130)."""


_WALL_KEY = "wall (s) of the ideal times, knee search and runs (excl. workload loading)"


def _hashable_sessions(workload: Workload) -> list[Any]:
    """The sessions as the cache key sees them: arrivals dropped (each run draws its own)."""
    return [s.model_dump(mode="json", exclude={"arrival_s"}) for s in workload.sessions]


class _Sweep:
    """The state of one :func:`run_sweep`: ideal times, knees, capacity, runs and the files.

    Mutates: itself, ``out_dir`` and the cache folder.
    """

    def __init__(self, workload: Workload, options: CompareOptions, gpus: tuple[GpuSetup, ...], out_dir: Path,
                 simulate_fn: Callable[..., Any] | None, progress: Any, live: Any, cache: ResultCache,
                 meta: dict[str, Any]) -> None:
        self.workload, self.options, self.gpus, self.out_dir = workload, options, gpus, out_dir
        self.simulate_fn, self.progress, self.live, self.cache = simulate_fn, progress, live, cache
        self.is_multi_gpu = len(gpus) > 1
        self.t0 = time.monotonic()
        self.info: dict[str, Any] = {**meta, "sessions": len(workload.sessions), "turns": workload.num_turns}
        self.ideal: dict[str, dict[str, float]] = {}
        self.base: dict[str, float | None] = {}
        self.capacity: pd.DataFrame | None = None
        self._sessions_key: list[Any] | None = None
        self._phase_s: dict[str, float] = {}
        self._phase_t0 = self.t0
        self._fcfs_knee: dict[tuple[str, str], BaseRateSearch] = {}
        """FCFS's knee search per GPU (reused as FCFS's capacity if it bracketed the knee)."""
        self._probe_wall_s: dict[tuple[tuple[str, str], float], float] = {}
        """Wall seconds of each knee probe, by ((gpu, label), rate)."""
        self._probe_streams: dict[tuple[tuple[str, str], float], pd.DataFrame] = {}
        """Metric events of the FCFS knee search's stable probes, by ((gpu, label), rate): the run
        at the same rate (load 1.0 x the knee) is that probe, so ``_runs`` does not simulate it again."""
        self._rows: list[dict[str, Any]] = []
        """The finished runs' rows, in plan order (kept for an interrupted sweep's summary)."""
        self._e2e_by_run: dict[str, list[float]] = {}
        self._num_runs = sum(len(plan(options, None, g.gpu, self.is_multi_gpu)) for g in gpus)

    # -- helpers ----------------------------------------------------------------------------
    def _key(self, kind: str, setup: GpuSetup, *extra: Any) -> str | None:
        """Cache key of ``kind`` on ``setup`` (None when the timer cannot be hashed: no caching)."""
        if self.cache.directory is None:
            return None
        if self._sessions_key is None:
            self._sessions_key = _hashable_sessions(self.workload)
        o = self.options
        try:
            return content_key(kind, self._sessions_key, setup.gpu, setup.step_timer, setup.num_gpu_blocks,
                               o.num_tool_workers, o.seed, o.max_virtual_s, *o.host_kv_key(),
                               *(o.mars_config_key() if kind != "ideal" else ()), *extra,
                               # an ideal time is one session alone on one replica
                               *((o.num_replicas, o.router, o.lose_replica)
                                 if o.num_replicas > 1 and kind != "ideal" else ()),
                               *(o.kv_transfer_key() if kind != "ideal" else ()))
        except TypeError:
            return None

    def _num_blocks(self, setup: GpuSetup, policy: str) -> int:
        """KV blocks of ``policy``'s runs on ``setup``: the GPU's, or the reference's unbounded KV."""
        if POLICIES[policy].is_kv_unbounded:
            return max(setup.num_gpu_blocks, unbounded_kv_blocks(self.workload))
        return setup.num_gpu_blocks

    def _fact(self, name: str, setup: GpuSetup) -> str:
        return f"{name} ({setup.gpu})" if self.is_multi_gpu else name

    def _task(self, description: str, total: int) -> Any:
        return self.progress.add_task(description, total=total) if self.progress is not None else None

    def _advance(self, task: Any, **fields: Any) -> None:
        if self.progress is not None and task is not None:
            self.progress.update(task, advance=1, **fields)

    # -- the phases -------------------------------------------------------------------------
    def run(self, pool: Pool, ideal_s: Mapping[str, float] | None) -> pd.DataFrame:
        """Ideal times, knees, optional capacity, then the runs (see :func:`run_sweep`).

        Raises:
            CompareInterrupted: Ctrl-C or SIGTERM (:class:`~mars_openhands.cli_signals.Terminated`)
                in any phase, once the workers have ended and what finished is written
                (:meth:`_interrupted`).
        """
        try:
            return self._phases(pool, ideal_s)
        except (KeyboardInterrupt, Terminated) as e:
            is_terminated = isinstance(e, Terminated) or getattr(e, "is_terminated", False)
            with _sigint_held():  # a second Ctrl-C must not cut the teardown short
                pool.stop()  # before the summary: no worker writes a file after it
                for partial in self.out_dir.glob("*.parquet.tmp"):  # a run stopped mid-write
                    partial.unlink(missing_ok=True)
                raise self._interrupted(is_terminated) from None

    def _interrupted(self, is_terminated: bool) -> CompareInterrupted:
        """Write the plots and a summary marked INTERRUPTED at its top for the runs that finished
        (or the capacity table); nothing when neither exists. Returns the exception to raise."""
        rows, o = self._rows, self.options
        has_capacity = self.capacity is not None and not self.capacity.empty
        if rows or has_capacity:
            done = ", ".join(r["run_id"] for r in rows) or "none"
            how = "SIGTERM" if is_terminated else "Ctrl-C (SIGINT)"
            self.info = {"interrupted": (f"stopped by {how}: {len(rows)} of {self._num_runs} runs finished "
                                         f"({done}); the tables hold only those; rerun the command for "
                                         "the whole sweep"), **self.info}
            table = results_frame(rows, o.alphas)
            if rows:
                self._plots(table, self._e2e_by_run)
            write_summary(self.out_dir, table, self.info, self.capacity)
        return CompareInterrupted(len(rows), self._num_runs, is_terminated=is_terminated,
                                  has_results=bool(rows or has_capacity))

    def _phases(self, pool: Pool, ideal_s: Mapping[str, float] | None) -> pd.DataFrame:
        self._ideal_times(pool, ideal_s)
        self._phase_done("ideal")
        for setup in self.gpus:
            ideal = self.ideal[setup.gpu]
            self.info[self._fact("KV blocks", setup)] = setup.num_gpu_blocks
            self.info[self._fact("mean ideal E2E (s)", setup)] = f"{sum(ideal.values()) / len(ideal):.1f}"
        self.info["is_absolute_rates"] = self.options.is_absolute_rates
        self._base_rates(pool)
        self._phase_done("knee")
        if self.options.is_capacity:
            self.capacity = self._capacities(pool)
            self._phase_done("capacity")
        return self._runs(pool)

    def _ideal_times(self, pool: Pool, given: Mapping[str, float] | None) -> None:
        if given is not None:
            self.ideal = {g.gpu: dict(given) for g in self.gpus}
            return
        if self.live is not None and self.live.spec.kind != "emulated":
            self.ideal[self.gpus[0].gpu] = self._live_ideal()
            return
        calls, owners, todo = [], [], []
        order = [s.session_id for s in self.workload.sessions]
        # Sessions drawn with replacement (--replicas) are copies: one ideal per original.
        representative: dict[str, str] = {}
        alone = []
        for s in self.workload.sessions:
            original = s.session_id.rpartition("~")[0] if self.options.num_replicas > 1 else s.session_id
            if original not in representative:
                representative[original] = s.session_id
                alone.append(s)
        rep_of = {sid: representative[sid.rpartition("~")[0] if self.options.num_replicas > 1 else sid]
                  for sid in order}
        for setup in self.gpus:
            key = self._key("ideal", setup, POLICIES["fcfs"].engine)
            cached = self.cache.get("ideal", key) if key else None
            if isinstance(cached, dict) and set(cached) == set(order):
                self.ideal[setup.gpu] = {sid: float(cached[sid]) for sid in order}
                continue
            self.ideal[setup.gpu] = {}
            todo.append((setup, key))
            size = max(1, -(-len(alone) // (4 * pool.jobs)))  # ~4 chunks per worker
            for i in range(0, len(alone), size):
                chunk = self.workload.model_copy(update={"sessions": tuple(alone[i:i + size])})
                calls.append((ideal_task, (chunk, self.options, setup.num_gpu_blocks, setup.step_timer)))
                owners.append(setup.gpu)
        if self.live is not None:
            self.info["ideal E2E from"] = ("simulator, each session alone under FCFS on the same GPU model "
                                           "(the emulated server models the same step times)")
        task = self._task("ideal E2E (each session alone)", len(calls)) if calls else None
        for index, value in pool.run(calls):
            if isinstance(value, BaseException):
                raise value
            self.ideal[owners[index]].update(value)
            self._advance(task)
        for setup, key in todo:
            # Workload order, not the chunks' finishing order: sums over the ideal times (the knee
            # search's start rate) then round the same in every run, so results are bit-identical.
            chunks = self.ideal[setup.gpu]
            self.ideal[setup.gpu] = {sid: chunks[rep_of[sid]] for sid in order}
            if key:
                self.cache.put("ideal", key, self.ideal[setup.gpu])

    def _live_ideal(self) -> dict[str, float]:
        options, live = self.options, self.live
        policy = "fcfs" if "fcfs" in options.policies else options.policies[0]
        repeats = live.options.ideal_repeats
        task = self._task("ideal (isolated replays)", len(self.workload.sessions) * repeats)
        ideal = live.measure_ideal_s(self.workload, policy, options.seed + 1,
                                     on_session=(lambda: self._advance(task)) if task is not None else None)
        rounds = f"the minimum of {repeats} rounds" if repeats > 1 else "one round"
        self.info["ideal E2E from"] = (f"measured on {live.spec.label}: each session replayed alone ({policy}, "
                                       f"no admission), E2E from its recorded stream, {rounds}")
        return ideal

    def _search_key(self, setup: GpuSetup, label: str, start_rate_per_s: float) -> str | None:
        # The start rate is part of the search: FCFS's knee search and its capacity search (when
        # the knee search did not bracket, see _capacities) differ only there.
        o = self.options
        return self._key("knee", setup, label, POLICIES[label.removesuffix("+adm")].engine,
                         POLICIES[label.removesuffix("+adm")].additional_config, o.knee_slowdown,
                         o.search_max_runs, o.knee_tolerance, start_rate_per_s,
                         *(() if o.knee_step == 2.0 else (o.knee_step,)))

    def _searches(self, pool: Pool, wanted: Sequence[tuple[GpuSetup, str, float]],
                  description: str, is_keeping_streams: bool = False,
                  stream_keys: Collection[tuple[tuple[str, str], float]] | None = None,
                  ) -> dict[tuple[str, str], BaseRateSearch]:
        """Knee searches of ``(gpu, run label, start rate)``, interleaved on ``pool``; cached by content.

        Each round gives every open search ``max(1, jobs // open searches)`` parallel probes.
        ``is_keeping_streams``: keep stable probes' metric events in ``_probe_streams`` (only those
        of ``stream_keys``, ``((gpu, label), rate)``, when given: the planned runs' rates).
        """
        o = self.options
        done: dict[tuple[str, str], BaseRateSearch] = {}
        open_: dict[tuple[str, str], tuple[GpuSetup, KneeSearch, str | None]] = {}
        for setup, label, start in wanted:
            key = self._search_key(setup, label, start)
            cached = self.cache.get("knee", key) if key else None
            if isinstance(cached, dict):
                done[(setup.gpu, label)] = BaseRateSearch(float(cached["rate_per_s"]),
                                                          tuple(tuple(p) for p in cached["probes"]),
                                                          str(cached["how"]) + " (cached)")
                continue
            name = "FCFS" if label == "fcfs" else label
            open_[(setup.gpu, label)] = (setup, KneeSearch(start, o.knee_slowdown, o.search_max_runs,
                                                           o.knee_tolerance, name, o.knee_step), key)
        task = self._task(description, o.search_max_runs * len(open_)) if open_ else None

        def make_call(ident: tuple[str, str], rate: float, cancel_path: str | None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
            setup, policy = open_[ident][0], ident[1].removesuffix("+adm")
            is_keeping = is_keeping_streams and (stream_keys is None or (ident, rate) in stream_keys)
            return probe_task, (self.workload, o, policy, ident[1].endswith("+adm"), rate, setup.step_timer,
                                 self._num_blocks(setup, policy), self.ideal[setup.gpu], self.simulate_fn,
                                 is_keeping, cancel_path)

        probes = Probes(pool, make_call)
        rounds: dict[tuple[str, str], list[float]] = {}  # each open search's round in progress
        width = 1
        try:
            while open_:
                if not rounds:  # every search's round closed: the next ones (widths as in a barrier)
                    width = max(1, pool.jobs // len(open_))
                    for ident, (_, search, _) in open_.items():
                        rounds[ident] = search.next_rates(width)
                        for rate in rounds[ident]:
                            probes.start((ident, rate))
                wanted = {(ident, rate) for ident, rates in rounds.items() for rate in rates}
                if pool.jobs > 1:
                    wanted |= self._speculate(probes, open_, rounds, width)
                probes.cancel_except(wanted)
                probes.wait()
                for ident in [i for i, rates in rounds.items() if all((i, r) in probes.results for r in rates)]:
                    search = open_[ident][1]
                    for rate in rounds.pop(ident):  # the round's order: results do not depend on timing
                        value = probes.results.pop((ident, rate))
                        if search.error is not None:  # an earlier probe of the round failed
                            continue
                        if isinstance(value, Exception):  # a fault (a stall), not a load effect:
                            search.fail(rate, f"{type(value).__name__}: {value}")  # this search ends
                            print(f"error: {ident[1]}'s {search.error}", file=sys.stderr)
                            continue
                        if isinstance(value, BaseException):
                            raise value
                        slowdown, wall_s, stream = value
                        search.record(rate, slowdown)
                        self._probe_wall_s[(ident, rate)] = wall_s
                        if stream is not None:
                            self._probe_streams[(ident, rate)] = stream
                        self._advance(task, description=f"{description}: {ident[1]} @ {rate:.3g}/s")
                    if search.is_done:
                        setup, search, key = open_.pop(ident)
                        done[ident] = result = search.result()
                        if self.progress is not None and task is not None:  # the budget not spent
                            self.progress.update(task, advance=o.search_max_runs - len(search.probes))
                        if key and result.error is None:
                            self.cache.put("knee", key, {"rate_per_s": result.rate_per_s,
                                                         "probes": [list(p) for p in result.probes],
                                                         "how": result.how})
        finally:
            probes.close()
        return done

    @staticmethod
    def _speculate(probes: Probes, open_: Mapping[tuple[str, str], tuple[GpuSetup, KneeSearch, str | None]],
                   rounds: Mapping[tuple[str, str], list[float]], width: int) -> set[tuple[tuple[str, str], float]]:
        """Start, on idle workers, the probes each search's next round would ask for if its
        running probes end as guessed; returns every such probe (running ones stay wanted).

        Exact: the searches still record only their own rounds, in order, and a new round starts
        when every search's round has closed (its width, ``jobs // open searches``, as before);
        a guess only decides what runs early. The guess: unstable if a probe at a rate no higher
        was unstable, else stable (unstable probes are stopped early, so one still running is
        likely stable); a search whose round closed before the others' gets its next round at
        the current width.
        Mutates ``probes``.
        """
        speculative: set[tuple[tuple[str, str], float]] = set()
        for ident, (_, search, _) in open_.items():
            rates = rounds.get(ident, [])  # none: its round closed, the others' still run
            if rates and all((ident, r) in probes.results for r in rates):
                continue
            values = [(r, probes.results[(ident, r)]) for r in rates if (ident, r) in probes.results]
            if any(isinstance(v, BaseException) for _, v in values):
                continue  # the round raises when it closes
            clone = copy.deepcopy(search)
            known = [(r, v[0]) for r, v in values]
            for rate, slowdown in known:
                clone.record(rate, slowdown)
            unstable = [r for r, _, is_stable in clone.probes if not is_stable]
            for rate in rates:
                if (ident, rate) not in probes.results:
                    clone.record(rate, math.inf if any(u <= rate for u in unstable) else 0.0)
            for rate in clone.next_rates(width):  # the width if every search stays open
                key = (ident, rate)
                speculative.add(key)
                if not probes.is_known(key) and probes.num_running < probes.jobs:
                    probes.start(key)
        return speculative

    def _base_rates(self, pool: Pool) -> None:
        o = self.options
        if o.is_absolute_rates:
            self.info["loads"] = "absolute rates (sessions/s) as given; no base rate"
            self.base = {g.gpu: None for g in self.gpus}
            return
        if o.base_rate_per_s is not None:
            self.info["base rate"] = f"{o.base_rate_per_s:.4g} sessions/s (given with --base-rate)"
            self.base = {g.gpu: o.base_rate_per_s for g in self.gpus}
            return
        wanted = [(g, "fcfs", 1.0 / (sum(self.ideal[g.gpu].values()) / len(self.ideal[g.gpu]))) for g in self.gpus]
        found = self._searches(pool, wanted, "FCFS knee search", is_keeping_streams=self.live is None)
        for setup in self.gpus:
            search = found[(setup.gpu, "fcfs")]
            if search.error is not None:  # no base rate, no loads: nothing else can run
                raise RuntimeError(f"the FCFS knee search{' on ' + setup.gpu if setup.gpu else ''} "
                                   f"failed: {search.error}")
            self.base[setup.gpu] = search.rate_per_s
            self.info[self._fact("base rate", setup)] = f"{search.rate_per_s:.4g} sessions/s"
            if not search.is_bracketed:
                print(f"warning: the FCFS knee search{' on ' + setup.gpu if setup.gpu else ''} did not bracket "
                      f"the knee in {len(search.probes)} runs; loads are multiples of {search.rate_per_s:.4g} "
                      "sessions/s (raise --search-runs, or give the base rate: compare --base-rate, plan --rate)", file=sys.stderr)
            prefix = "in the simulator (same GPU model): " if self.live is not None else ""
            walls = [self._probe_wall_s.get(((setup.gpu, "fcfs"), r)) for r, _, _ in search.probes]
            self.info[self._fact("base rate search", setup)] = prefix + search.how + " (probes: " + ", ".join(
                f"{r:.4g}/s→{slowdown_text(s, self.options.knee_slowdown)}" + (f" in {w:.0f} s" if w is not None else "")
                for (r, s, _), w in zip(search.probes, walls, strict=True)) + ")"
        self._fcfs_knee = found
        planned = {((r.gpu, r.label), r.rate_per_s) for g in self.gpus for r in plan(o, self.base[g.gpu], g.gpu)}
        self._probe_streams = {k: v for k, v in self._probe_streams.items() if k in planned}

    def _capacities(self, pool: Pool) -> pd.DataFrame:
        """Capacity at SLO of every run label on every GPU (the knee search run for each policy).

        Every search but a reused FCFS knee starts at the GPU's base rate with ``search_max_runs``
        probes. FCFS's knee search (from one session at a time) stands for FCFS's capacity only if
        it bracketed the knee: an unbracketed one spent its budget getting to the base rate, where
        the others' searches only start, so its lower bound would sit far below theirs for the same
        runs. FCFS then searches again from the base rate, like the others: identical runs get
        identical probes and the same lower bound.
        """
        labels = list(dict.fromkeys(r.label for r in plan(self.options, 1.0)))
        known = {k: v for k, v in self._fcfs_knee.items() if v.is_bracketed}
        wanted = []
        for setup in self.gpus:
            ideal = self.ideal[setup.gpu]
            start = self.base.get(setup.gpu) or 1.0 / (sum(ideal.values()) / len(ideal))
            wanted += [(setup, label, start) for label in labels if (setup.gpu, label) not in known]
        # A search starts at the FCFS knee: its first probe is the run at load 1.0 (same label, rate
        # and seed), so a stable one's stream stands for that run, as FCFS's own probe does
        planned = {((r.gpu, r.label), r.rate_per_s) for g in self.gpus
                   for r in plan(self.options, self.base[g.gpu], g.gpu)}
        searched = self._searches(pool, wanted, "capacity", is_keeping_streams=self.live is None,
                                  stream_keys=planned)
        found = {**{k: v for k, v in known.items() if k[1] in labels}, **searched}
        rows = []
        for (gpu, label), search in found.items():
            policy = label.removesuffix("+adm")
            rows.append({"gpu": gpu, "label": label, "policy": policy, "is_baseline": POLICIES[policy].is_baseline,
                         "capacity_per_s": (search.rate_per_s if search.has_stable and search.error is None
                                            else math.nan),
                         "is_bracketed": search.is_bracketed,
                         "first_unstable_per_s": min((r for r, _, is_stable in search.probes
                                                      if not is_stable and r > search.rate_per_s), default=math.nan),
                         "num_probes": len(search.probes), "how": search.how,
                         "error": search.error or ""})
        table = pd.DataFrame(rows)
        table.to_parquet(self.out_dir / "capacity.parquet", index=False)
        return table

    def _runs(self, pool: Pool) -> pd.DataFrame:
        o = self.options
        runs: list[Run] = []
        for setup in self.gpus:
            runs += plan(o, self.base[setup.gpu], setup.gpu, self.is_multi_gpu)
        if self.live is not None:
            runs = order_for_servers(runs, o.policies)
        elif pool.jobs > 1:  # heaviest first: the long overloaded runs do not finish last alone
            runs = sorted(runs, key=lambda r: -r.load_x)
        setups = {g.gpu: g for g in self.gpus}
        task = self._task("runs", len(runs))
        rows, e2e_by_run = self._rows, self._e2e_by_run
        calls = [] if self.live is not None else [self._run_call(run, setups[run.gpu]) for run in runs]
        results = (self._live_results(runs) if self.live is not None else pool.run(calls))
        order = {id(run): i for i, run in enumerate(sorted(runs, key=self._plan_rank))}
        by_rank: dict[int, dict[str, Any]] = {}
        for index, value in results:
            run = runs[index]
            if isinstance(value, BaseException):
                value = {"status": "failed", "error": f"{type(value).__name__}: {value}", "wall_s": math.nan}
            e2e = value.pop("_e2e", None)
            if e2e is not None:
                e2e_by_run[run.run_id] = e2e
            by_rank[order[id(run)]] = {**self._row_head(run), **value}
            rows[:] = [by_rank[k] for k in sorted(by_rank)]  # plan order, whatever finished first
            self._phase_done("runs", len(rows) == len(runs))
            write_summary(self.out_dir, results_frame(rows, o.alphas), self.info, self.capacity)
            self._advance(task, description=f"runs: {run.run_id} done")
        table = results_frame(rows, o.alphas)
        self._plots(table, e2e_by_run)
        return table

    def _run_call(self, run: Run, setup: GpuSetup) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """The pool call of one simulated run: the simulation, or the stable knee probe that was it."""
        o = self.options
        stream = self._probe_streams.pop(((run.gpu, run.label), run.rate_per_s), None)
        if stream is not None:
            wall_s = self._probe_wall_s[((run.gpu, run.label), run.rate_per_s)]
            key = "runs taken from the knee search (its stable probe at the same rate and seed)"
            self.info[key] = ", ".join(filter(None, (self.info.get(key, ""), run.run_id)))
            return probe_run_task, (run, self.workload, stream, wall_s, o, self.ideal[run.gpu], self.out_dir)
        return run_task, (run, self.workload, o, setup.step_timer, self._num_blocks(setup, run.policy),
                           self.ideal[run.gpu], self.out_dir, self.simulate_fn)

    def _live_results(self, runs: Sequence[Run]) -> Iterator[tuple[int, dict[str, Any]]]:
        for index, run in enumerate(runs):
            execute = live_execute(self.live, run, self.options.seed + 1000 * (index + 1))
            yield index, one_run(run, self.workload, self.options, self.ideal[run.gpu], execute, self.out_dir)

    def _plan_rank(self, run: Run) -> tuple[int, float, int, bool]:
        """Where a run sits in the tables: GPU, load, policy order, admission."""
        gpus = [g.gpu for g in self.gpus]
        return (gpus.index(run.gpu), run.load_x, self.options.policies.index(run.policy), run.is_admission_enabled)

    def _phase_done(self, phase: str, is_final: bool = True) -> None:
        """Record the wall time since the previous phase (and the total) in the summary's facts."""
        now = time.monotonic()
        self.info[_WALL_KEY] = f"{now - self.t0:.0f}"
        if is_final:
            self._phase_s[phase] = now - self._phase_t0
            self._phase_t0 = now
            self.info["wall (s) per phase"] = ", ".join(f"{k} {v:.0f}" for k, v in self._phase_s.items())

    def _row_head(self, run: Run) -> dict[str, Any]:
        return {"run_id": run.run_id, "gpu": run.gpu, "label": run.label, "policy": run.policy,
                "is_admission_enabled": run.is_admission_enabled,
                "is_baseline": POLICIES[run.policy].is_baseline,
                "is_reference": POLICIES[run.policy].is_kv_unbounded, "load_x": run.load_x,
                "rate_per_s": run.rate_per_s, "status": "ok", "error": ""}

    def _plots(self, results: pd.DataFrame, e2e_by_run: Mapping[str, Sequence[float]]) -> None:
        """The plots: one set, or one per GPU prefixed ``<gpu>__``; titles name the GPU and workload."""
        for gpu, group in results.groupby("gpu", sort=False):
            write_plots(self.out_dir, group, e2e_by_run, self.options.is_absolute_rates,
                        prefix=f"{gpu}__" if self.is_multi_gpu else "", title_prefix=self._plot_title(str(gpu)))

    def _plot_title(self, gpu: str) -> str:
        """``"h100_sxm, deepseek_chat_test_1-100 (74 sessions): "``: what a plot shows, for its title."""
        source = self.info.get("workload")
        name = Path(str(source)).name if source else "workload"
        what = f"{name} ({len(self.workload.sessions)} sessions{', TRIMMED' if 'TRIMMED' in str(self.info.get('scope', '')) else ''})"
        return ", ".join(p for p in (gpu, what) if p) + ": "


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Within the block, Ctrl-C is ignored (main thread only: elsewhere nothing changes).

    Mutates: the process's SIGINT handler, restored on leaving.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
