"""vLLM's async-scheduling engine loop over a real scheduler, without a model (issue 33).

:class:`AsyncEngineLoop` is ``EngineCore.step_with_batch_queue`` of vllm 0.32
(``vllm/v1/engine/core.py``) with ``batch_queue_size == 2`` (async scheduling, no pipeline
parallelism), driven by hand so a test can put frontend work between any two scheduler calls:

* :meth:`AsyncEngineLoop.step` is one call of ``step_with_batch_queue``: if the scheduler
  ``has_requests()`` it schedules step ``N+1`` and queues it; it returns at once while the
  queue has room and there is work (so step ``N+1`` is scheduled before step ``N``'s output is
  applied); otherwise it pops the oldest step, applies the aborts that arrived while it ran
  (``_process_aborts_queue``) and calls ``update_from_output``.
* :meth:`AsyncEngineLoop.add_request` / :meth:`AsyncEngineLoop.abort` are the input queue,
  applied between two steps (``_process_input_queue``); ``abort(..., during_next_step=True)``
  is an abort that arrives while the next step waits for the model, after its ``schedule()``:
  vLLM puts it on *both* queues, so it is applied before that step's ``update_from_output``
  and again from the input queue (aborting is idempotent).
* The model runner samples one token for every scheduled request that is not inside its prompt
  (``is_prefill_chunk`` right after ``schedule()``), at schedule time, as the GPU does; its
  output is delivered whatever happened to the request since (finished, aborted, preempted:
  then vLLM marks it stale), which is exactly the output vLLM receives.

Mental model of the race this reproduces: a request scheduled in step ``N`` and preempted by
KV pressure in step ``N+1`` has its step-``N`` token in flight; when it arrives, vLLM appends
it to the *preempted* request and may stop it (``max_tokens``, a stop token): the request then
finishes while it is out of ``running``, and vLLM removes it only from its own waiting queues.

Recorded for property checks: how each request finished (``finished``: request id -> "stop" /
"length" / "abort" / "error" ...), any violation of "finishes exactly once" (a second finish,
an output after the finish) in ``violations``, and how often the race happened
(``num_finished_preempted``, ``finished_while_held``).

Not modelled: speculative decoding, structured output (its deferred sampling), pipeline
parallelism, KV connectors and streaming-input sessions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

__all__ = ["BATCH_QUEUE_SIZE", "AsyncEngineLoop"]

BATCH_QUEUE_SIZE = 2
"""vLLM's ``max_concurrent_batches`` with async scheduling and no pipeline parallelism."""


class AsyncEngineLoop:
    """``EngineCore.step_with_batch_queue`` over ``scheduler`` (see the module docstring).

    Args:
        scheduler: a real vLLM ``AsyncScheduler`` (stock or one of ours).
        sample: the token the model samples for a request at schedule time.
    """

    def __init__(self, scheduler: Scheduler, sample: Callable[[Request], int]) -> None:
        self.scheduler = scheduler
        self.sample = sample
        self.batch_queue: deque[tuple[Any, ModelRunnerOutput]] = deque()
        self._during_step_aborts: list[str] = []
        self.finished: dict[str, str] = {}
        """Request id -> how it finished (an ``EngineCoreOutput.finish_reason`` or "abort")."""
        self.violations: list[str] = []
        """Breaches of "every request finishes exactly once", in the order seen."""
        self.num_steps = 0
        self.num_preemptions = 0
        self.finished_while_held: list[str] = []
        """Requests that finished while held outside vLLM's queues (``held_requests()``): by an
        in-flight token (held as read right after the step's ``schedule()``: the race of issue
        33) or by an abort."""
        self.num_finished_preempted = 0
        """Requests stopped by a token that was in flight when they were preempted."""
        self._held_ids: set[str] = set()

    # ------------------------------------------------------------------ frontend
    def add_request(self, request: Request) -> None:
        """The input queue: ``scheduler.add_request`` between two steps."""
        self.scheduler.add_request(request)

    def abort(self, request_ids: Iterable[str], *, during_next_step: bool = False) -> None:
        """A frontend abort (client gone, stop string seen by the detokenizer), applied now
        (the input queue, between two steps); ``during_next_step``: it arrives while the next
        :meth:`step` waits for the model, after that step's ``schedule()``: applied before the
        output it then applies, and again from the input queue (vLLM puts aborts on both)."""
        if during_next_step:
            self._during_step_aborts.extend(request_ids)
        else:
            self._abort_now(list(request_ids))

    def _abort_now(self, ids: list[str]) -> None:
        if not ids:
            return
        held = getattr(self.scheduler, "held_requests", None)
        held_ids = {r.request_id for r in held()} if held is not None else set()
        for request in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
            self._record_finish(request.request_id, "abort")
            if request.request_id in held_ids:
                self.finished_while_held.append(request.request_id)

    # ------------------------------------------------------------------ engine core
    def has_work(self) -> bool:
        """vLLM ``EngineCore.has_work``: the busy loop steps while this is true."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self) -> None:
        """One ``step_with_batch_queue`` (call only while :meth:`has_work`)."""
        s = self.scheduler
        assert len(self.batch_queue) < BATCH_QUEUE_SIZE, "batch queue overfull"
        aborts, self._during_step_aborts = self._during_step_aborts, []
        if s.has_requests():
            out = s.schedule()
            self.num_steps += 1
            self.num_preemptions += len(out.preempted_req_ids or ())
            model_executed = out.total_num_scheduled_tokens > 0
            self.batch_queue.appendleft((out, self._run_model(out)))
            held = getattr(s, "held_requests", None)
            self._held_ids = {r.request_id for r in held()} if held is not None else set()
            if len(self.batch_queue) < BATCH_QUEUE_SIZE and (model_executed or s.has_requests()):
                self._abort_now(aborts)  # nothing to wait for: the input queue has them next
                return
        elif not self.batch_queue:
            self._abort_now(aborts)
            return
        out, runner_output = self.batch_queue.pop()
        self._abort_now(aborts)  # _process_aborts_queue, before the step's output
        preempted = [r for rid in out.num_scheduled_tokens
                     if (r := s.requests.get(rid)) is not None and r.status == RequestStatus.PREEMPTED]
        self._record_outputs(s.update_from_output(out, runner_output))
        self.num_finished_preempted += sum(r.is_finished() for r in preempted)
        self._abort_now(aborts)  # the same aborts from the input queue (a no-op)

    def drain(self, max_steps: int, on_step: Callable[[], None] | None = None) -> None:
        """Step until nothing is left (``has_work()`` false).

        Raises:
            RuntimeError: still busy after ``max_steps`` steps (a stall), naming the counts.
        """
        for _ in range(max_steps):
            if not self.has_work():
                return
            if on_step is not None:
                on_step()
            self.step()
        running, waiting = self.scheduler.get_request_counts()
        raise RuntimeError(f"engine did not drain in {max_steps} steps: running={running}, "
                           f"waiting={waiting}, in flight={len(self.batch_queue)}")

    # ------------------------------------------------------------------ model runner
    def _run_model(self, out: Any) -> ModelRunnerOutput:
        """The model's output for ``out``: one token per scheduled request past its prompt."""
        req_ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[] if requests[rid].is_prefill_chunk else [self.sample(requests[rid])]
                   for rid in req_ids]
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    # ------------------------------------------------------------------ bookkeeping
    def _record_outputs(self, engine_outputs: dict[int, Any]) -> None:
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.request_id in self.finished:
                    self.violations.append(
                        f"{o.request_id}: output after it finished ({self.finished[o.request_id]}): "
                        f"tokens {o.new_token_ids}, finish_reason {o.finish_reason}")
                    continue
                if o.finish_reason is not None:
                    self._record_finish(o.request_id, str(o.finish_reason))
                    if o.request_id in self._held_ids:
                        self.finished_while_held.append(o.request_id)

    def _record_finish(self, request_id: str, how: str) -> None:
        if request_id in self.finished:
            self.violations.append(f"{request_id}: finished twice ({self.finished[request_id]}, "
                                   f"then {how})")
            return
        self.finished[request_id] = how
