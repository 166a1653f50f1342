"""Worker processes of a sweep (:class:`Pool`) and the knee probes started on them (:class:`Probes`).

Workers start from a forkserver that imported the run tasks and the simulator (vLLM) once
(:func:`start_worker_server`), or by spawn where there is none; never by fork (the parent may hold
threads). With ``jobs == 1`` every call runs in the calling process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, as_completed
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from mars_openhands.cli_signals import end_with_parent

__all__ = ["WORKER_PRELOAD", "Pool", "Probes", "default_jobs", "start_worker_server"]

WORKER_PRELOAD: tuple[str, ...] = ("eval.runs", "eval.sim")
"""Modules the forkserver imports once for every worker: the run tasks the pool calls
(:mod:`eval.runs`) and the simulator they import on first use (:mod:`eval.sim`, vLLM: ~20 s)."""


def default_jobs() -> int:
    """CPUs this process may use (``os.sched_getaffinity``; ``os.cpu_count()`` elsewhere), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _init_worker(owner_pid: int) -> None:
    """Worker initializer: vLLM's per-engine log lines would break the progress bar, and the worker
    ends once the process that owns the pool (``owner_pid``) has exited, even by SIGKILL
    (:func:`~mars_openhands.cli_signals.end_with_parent`). A forkserver's workers are the server's
    children, not the owner's, and each holds the server's "alive" pipe, so without this a killed
    ``compare --jobs 2`` left its workers waiting on their call queue and the forkserver waiting on
    them, for good."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    # Ctrl-C is the owner's to handle: it stops the workers (Pool.stop) before writing what
    # finished. A terminal sends SIGINT to the whole group; a worker that took it returned a
    # KeyboardInterrupt as its call's result and went on to its next queued call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end_with_parent(owner_pid)


def _terminate_workers(executor: ProcessPoolExecutor) -> None:
    """Stop ``executor``'s worker processes now (SIGTERM), the calls they run with them. Python
    3.14's ``terminate_workers``; before it, the executor's process table (no public API)."""
    terminate = getattr(executor, "terminate_workers", None)
    if terminate is not None:  # pragma: no cover - Python >= 3.14
        terminate()
        return
    for process in list(getattr(executor, "_processes", {}).values()):
        process.terminate()


def start_worker_server() -> str:
    """Start the forkserver that sweep workers fork from, importing vLLM once (``eval.sim``), in
    the background: call it early and the ~20 s import overlaps the parent's set-up (the pool
    would start it at its first task). Idempotent; the server exits with this process.

    Returns:
        The start method the pool uses: ``"forkserver"``, or ``"spawn"`` where there is none (then
        nothing is started).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # importable only where forkserver is a start method (not on Windows), so not at module level
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WORKER_PRELOAD))
    # The server imports vLLM, whose import-time warnings ("Triton is installed, but doesn't include
    # CPU backend") would be the sweep's first output line; the workers log nothing a user acts on
    # (a run's failure is its row's error). A level the user set wins; only the server gets it.
    saved = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # The server ignores SIGINT only once its preload is imported: a terminal's Ctrl-C during
    # those ~20 s printed its KeyboardInterrupt traceback under compare's one line. An ignored
    # SIGINT survives the server's exec, so it ignores it from its start (the owner handles it).
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if is_main else None
    try:
        forkserver.ensure_running()
    finally:
        if is_main:
            signal.signal(signal.SIGINT, previous)
        if saved is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
    return "forkserver"


class Pool:
    """``jobs`` worker processes (forkserver where available, else spawn: safe with threads and
    CUDA-free, never fork), or the calling process itself for ``jobs == 1``.

    :meth:`run` yields ``(index, result or exception)`` as calls complete. In-process, a call's
    ``KeyboardInterrupt`` propagates at once; with workers, Ctrl-C reaches this process only (the
    workers ignore SIGINT) and :meth:`stop` (or leaving the ``with`` block on an exception) ends
    them.
    """

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self._executor: Any = None
        self._is_stopped = False

    def __enter__(self) -> Pool:
        if self.jobs > 1:
            context = multiprocessing.get_context(start_worker_server())
            self._executor = ProcessPoolExecutor(self.jobs, mp_context=context, initializer=_init_worker,
                                                 initargs=(os.getpid(),))
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        """Leave the pool: at a normal exit wait for the workers; on an exception (Ctrl-C,
        SIGTERM as :class:`~mars_openhands.cli_signals.Terminated`, an error) cancel what has not
        started and stop the running calls' workers, or the interpreter's exit would wait for
        them (``concurrent.futures`` joins its workers at exit)."""
        if exc_type is not None:
            self.stop()
            return
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the workers now and wait until they have exited: queued calls are cancelled and
        running ones end with their worker (SIGTERM; SIGKILL after ``timeout_s`` seconds), so no
        worker writes a file after this returns. Idempotent; the pool runs nothing afterwards.

        Mutates: the pool (stopped) and its worker processes (ended).
        """
        self._is_stopped = True
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = list((getattr(executor, "_processes", None) or {}).values())
        _terminate_workers(executor)
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout_s)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Start ``fn(*args)`` on a worker; returns its ``concurrent.futures.Future``.

        Raises:
            RuntimeError: the pool runs calls in this process (``jobs == 1``): use :meth:`run`.
        """
        self._check_running()
        if self._executor is None:
            raise RuntimeError("an in-process pool (jobs=1) has no workers to submit to; use run()")
        return self._executor.submit(fn, *args)

    def run(self, calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]]) -> Iterator[tuple[int, Any]]:
        """Run ``fn(*args)`` for each call; yield ``(index, value or Exception)`` as each finishes.

        Raises:
            RuntimeError: the pool was stopped (:meth:`stop`).
        """
        self._check_running()
        if self._executor is None:
            for index, (fn, args) in enumerate(calls):
                try:
                    value = fn(*args)
                except Exception as e:  # noqa: BLE001 - handed to the caller, which records it
                    value = e
                yield index, value
            return
        futures = {self._executor.submit(fn, *args): i for i, (fn, args) in enumerate(calls)}
        for future in as_completed(futures):
            error = future.exception()
            yield futures[future], (error if error is not None else future.result())


    def _check_running(self) -> None:
        if self._is_stopped:
            raise RuntimeError("the pool was stopped (Pool.stop); start a new one")


class Probes:
    """Knee probes by ``(search, rate)`` on a :class:`Pool`: started once, each result kept.

    A probe is a pure function of its search and rate (same workload, policy, seed), so a round
    may take the result of a probe started earlier on a guess (the sweep's ``_speculate``); a
    started probe that no round will need is cancelled (:meth:`cancel_except`: the worker's
    guard sees a file and stops it). In-process (``jobs == 1``) probes run one at a time in
    :meth:`wait` and none is speculative.
    """

    def __init__(self, pool: Pool, make_call: Callable[[Any, float, str | None], tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
        self._pool, self._make_call = pool, make_call
        self.results: dict[tuple[Any, float], Any] = {}
        """Finished probes' values, by ``(search, rate)``."""
        self._running: dict[tuple[Any, float], Any] = {}  # key -> Future (workers) or None (queued)
        self._cancel_dir: str | None = None
        self._num_started = 0
        self._stopping: list[Any] = []  # cancelled futures still running (close() waits for them)

    @property
    def jobs(self) -> int:
        """Worker processes of the pool (1: in-process)."""
        return self._pool.jobs

    @property
    def num_running(self) -> int:
        """Probes started and not finished."""
        return len(self._running)

    def is_known(self, key: tuple[Any, float]) -> bool:
        """Whether the probe is finished or started."""
        return key in self.results or key in self._running

    def start(self, key: tuple[Any, float]) -> None:
        """Start the probe unless it is finished or running. Mutates."""
        if self.is_known(key):
            return
        if self._pool.jobs <= 1:
            self._running[key] = None
            return
        if self._cancel_dir is None:
            self._cancel_dir = tempfile.mkdtemp(prefix="mars-knee-")
        self._num_started += 1
        path = os.path.join(self._cancel_dir, f"{self._num_started}.cancel")
        fn, args = self._make_call(key[0], key[1], path)
        future = self._pool.submit(fn, *args)
        future.cancel_path = path
        self._running[key] = future

    def cancel_except(self, keep: set[tuple[Any, float]]) -> None:
        """Stop every running probe not in ``keep``. Mutates."""
        for key in [k for k in self._running if k not in keep]:
            future = self._running.pop(key)
            if future is not None and not future.cancel():
                Path(future.cancel_path).touch()
                self._stopping.append(future)

    def wait(self) -> None:
        """Block until at least one running probe finishes and keep its value (or its exception,
        which the caller raises when a round needs that probe). Mutates."""
        if not self._running:
            return
        if self._pool.jobs <= 1:
            key = next(iter(self._running))
            del self._running[key]
            fn, args = self._make_call(key[0], key[1], None)
            try:
                self.results[key] = fn(*args)
            except Exception as e:  # noqa: BLE001 - kept as a worker's is: the search it ends decides
                self.results[key] = e
            return
        finished, _ = wait_futures(list(self._running.values()), return_when=FIRST_COMPLETED)
        for key in [k for k, f in self._running.items() if f in finished]:
            future = self._running.pop(key)
            error = future.exception()  # raised when a round records it: a guess may fail unneeded
            self.results[key] = error if error is not None else future.result()

    def close(self) -> None:
        """Cancel what still runs and remove the cancel files. Mutates."""
        self.cancel_except(set())
        if self._stopping:  # they stop at their guard's next check; the pool is needed next
            wait_futures(self._stopping)
        if self._cancel_dir is not None:
            shutil.rmtree(self._cancel_dir, ignore_errors=True)

