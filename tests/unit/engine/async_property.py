"""Randomized async-scheduling property check of every scheduler we ship (issue 33, item 1).

Property, for each policy of ``eval.policies.POLICIES`` (the live class: ``fcfs`` is
``FcfsScheduler``) and stock vLLM's ``AsyncScheduler`` as the control: under async scheduling
(:class:`~tests.unit.engine.async_engine.AsyncEngineLoop`), with preemption by KV pressure, aborts
between any two scheduler calls (also while a step runs, and after a request's last token), stop
tokens and ``max_tokens`` reached on an in-flight token, invalid MARS extras, session ends,
tool events and prefix-cache resets (``reset_prefix_cache``, also preempting everything) at any
time,

* no scheduler call raises;
* every request finishes exactly once (one finish output or one abort; no output after it);
* after every scheduler call, each request a scheduler holds outside vLLM's queues
  (``held_requests()``: the window's overflow, mars's residency hold, ThunderAgent's paused
  programs) is live (in ``requests``, not finished) and in none of vLLM's queues, and each request
  in vLLM's queues is live;
* at the end (all sessions ended), nothing is left: no request, held request, retained entry,
  per-request policy state or used KV block (``assert_no_leaks``).

One seed is one small random workload (:func:`run_seed`): 2-6 agent sessions of 1-4 turns
(prompt 4-48 tokens, 1-10 output tokens, 1-16 new tokens per turn, tool calls between turns),
some session-less one-shot requests, 4-token blocks and a pool just big enough for the longest
context, so preemption is frequent. ~10-40 ms per seed.
"""

from __future__ import annotations

import functools
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.request import Request

from eval.policies import POLICIES, merge_config
from mars_openhands.stream.events import SessionEnd, ToolEnd, ToolStart, now_stamps
from tests.unit.engine.async_engine import AsyncEngineLoop
from tests.unit.engine.harness import Harness

__all__ = ["SeedResult", "build_case", "check_final", "check_invariants", "policy_names", "run_seed",
           "run_seeds"]

BLOCK_SIZE = 4
STOP_TOKEN_ID = 3
"""Every request stops on this token (``stop_token_ids``); the model samples it now and then."""
_TINY: dict[str, dict[str, Any]] = {
    "mars-preview": {"window": {"size": 3}},
    "thunderagent": {"thunderagent": {"buffer_per_program_tokens": 4}},
}
"""Shipped settings scaled to these workloads, merged into the policy's
``additional_config["mars"]``: a 30-request window never overflows with eight sessions, and
ThunderAgent's 100-token buffer per program is more than these 36-156-token pools (it would
admit nothing: issue 33 item 8)."""
_TINY_LONG_PREFILL_TOKENS = 8
"""``vllm-tuned``'s 512-token prefill cap, scaled to these prompts."""
_PER_REQUEST_STATE = ("req_state", "prefilling", "_rejected", "_calls", "_live", "_evicted_at_s",
                      "_program_of")
"""Per-request bookkeeping of our classes (those a class has): empty once nothing is in."""


def _policies() -> dict[str, Any]:
    return {name: spec for name, spec in POLICIES.items() if not spec.is_kv_unbounded}


_SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mars[order=fifo]": ("mars", {"residency": {"order": "fifo"}}),
    "mars[order=response-ratio]": ("mars", {"residency": {"order": "response-ratio"}}),
}
"""Settings a user may pick besides a policy's own (``compare --mars-config``): name -> (policy,
its ``additional_config["mars"]`` on top). Both residency orders run here, whichever is the default."""


@functools.cache
def policy_names() -> tuple[str, ...]:
    """Every shipped policy name (``eval.policies.POLICIES`` but the unbounded-KV reference), the
    :data:`_SETTINGS` variants, then ``vllm-stock`` (vLLM's own ``AsyncScheduler``, the control)."""
    return (*_policies(), *_SETTINGS, "vllm-stock")



@dataclass(frozen=True)
class Case:
    """How one policy name is built: class, ``additional_config["mars"]``, prefill cap."""

    name: str
    scheduler_cls: type
    mars: dict[str, Any] | None
    long_prefill_token_threshold: int = 0


@functools.cache
def build_case(name: str) -> Case:
    """The :class:`Case` of a policy name (see :func:`policy_names`).

    Raises:
        KeyError: unknown name.
    """
    if name == "vllm-stock":
        return Case(name, AsyncScheduler, None)
    from eval.backends import live_scheduler
    from mars_openhands.engine.harness.inproc_engine import resolve_scheduler_cls

    policy, setting = _SETTINGS.get(name, (name, {}))
    spec = _policies()[policy]
    cls = resolve_scheduler_cls(live_scheduler(spec.scheduler))
    mars = merge_config(merge_config(dict(spec.additional_config.get("mars", {})), setting),
                        _TINY.get(policy, {}))
    long_prefill = spec.engine.get("long_prefill_token_threshold", 0)
    return Case(name, cls, mars, min(long_prefill, _TINY_LONG_PREFILL_TOKENS))


# ----------------------------------------------------------------------------- the workload
@dataclass
class _Session:
    sid: str | None
    turns_left: int
    prompt: list[int]
    turn: int = 0
    live: Request | None = None
    next_at_step: int = 0
    tool_end_at_step: int | None = None
    is_ended: bool = False


@dataclass
class SeedResult:
    """One seed's outcome: ``error`` is None when every property held."""

    policy: str
    seed: int
    error: str | None = None
    num_requests: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_aborts: int = 0
    num_finished_preempted: int = 0
    """Requests stopped by a token in flight at their preemption."""
    num_finished_held: int = 0
    """Requests that finished while held outside vLLM's queues (stopped or aborted)."""
    finishes: dict[str, int] = field(default_factory=dict)


class _Run:
    """One seed's workload on one policy (see the module docstring)."""

    def __init__(self, case: Case, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.case = case
        num_sessions = rng.randint(3, 8)
        num_blocks = rng.randint(8, 30)
        self.max_out = min(rng.choice((4, 16, 40)), (num_blocks - 2) * BLOCK_SIZE - 16)
        self.max_new = 16
        # The longest request (prompt + output) fits in the pool with nothing else in it; a
        # session whose next turn would not fit ends instead.
        self.max_context = (num_blocks - 2) * BLOCK_SIZE - self.max_out
        max_batched = rng.choice((16, 32, 64))
        self.h = Harness(case.scheduler_cls, num_blocks=num_blocks,
                         block_size=BLOCK_SIZE, max_num_seqs=rng.randint(3, 8),
                         max_num_batched_tokens=max_batched, mars=case.mars, seed=seed,
                         long_prefill_token_threshold=case.long_prefill_token_threshold)
        self.s = self.h.scheduler
        self.is_ours = hasattr(self.s, "post_event")
        self.p_stop = rng.choice((0.0, 0.1, 0.3))
        self.p_abort = rng.choice((0.0, 0.02, 0.06))
        self.p_reset = rng.choice((0.0, 0.0, 0.01))
        """Per step: ``reset_prefix_cache`` (``POST /reset_prefix_cache``, a weight update)."""
        self.loop = AsyncEngineLoop(self.s, self._sample)
        first = min(48, self.max_context)
        self.sessions = [
            _Session(f"s{i}", rng.randint(1, 4), self.h.tokens(rng.randint(4, first)),
                     next_at_step=rng.randint(0, 3))
            for i in range(num_sessions)]
        self.sessions += [_Session(None, 1, self.h.tokens(rng.randint(4, first)),
                                   next_at_step=rng.randint(0, 30))
                          for _ in range(rng.choice((0, 0, 1, 2)))]
        self.requests: dict[str, Request] = {}
        self.num_aborts = 0
        self.step = 0

    def _sample(self, request: Request) -> int:
        return STOP_TOKEN_ID if self.rng.random() < self.p_stop else self.rng.randrange(10, 500)

    # ------------------------------------------------------------------ agents
    def _post(self, event: Any) -> None:
        if self.is_ours:
            self.s.post_event(event)

    def _new_turn(self, sess: _Session) -> None:
        rng = self.rng
        extra: dict[str, Any] | None = None
        if sess.sid is not None:
            extra = {"mars_turn": sess.turn, "mars_last_step": int(sess.turns_left == 1)}
            if sess.turn:
                extra |= {"mars_prev_tool": "bash", "mars_prev_tool_s": 0.5}
        if rng.random() < 0.03:
            extra = {"mars_bogus": 1}  # an invalid MARS extra: finished with an error
        params = SamplingParams(max_tokens=rng.randint(1, self.max_out), ignore_eos=True,
                                stop_token_ids=[STOP_TOKEN_ID])
        params.extra_args = extra
        rid = f"r{len(self.requests)}-{sess.sid}-t{sess.turn}"
        request = Request(rid, list(sess.prompt), params, None, block_hasher=self.h.block_hasher,
                          session_id=sess.sid)
        self.requests[rid] = request
        sess.live = request
        self.loop.add_request(request)

    def _on_finished(self, sess: _Session) -> None:
        request, sess.live = sess.live, None
        assert request is not None
        sess.turn += 1
        sess.turns_left -= 1
        if sess.turns_left <= 0:
            self._end(sess)
            return
        sess.prompt = (list(request.prompt_token_ids or []) + list(request.output_token_ids)
                       + self.h.tokens(self.rng.randint(1, self.max_new)))
        if len(sess.prompt) > self.max_context:
            sess.turns_left = 0  # the next turn would not fit the pool: the agent stops here
            self._end(sess)
            return
        tool_steps = self.rng.choice((0, 1, 3, 8, 20))
        self._post(ToolStart(**now_stamps(), session_id=sess.sid, source="agent",
                             tool_name="bash", tool_call_id=f"{sess.sid}-{sess.turn}"))
        sess.tool_end_at_step = self.step + tool_steps
        sess.next_at_step = self.step + tool_steps + self.rng.choice((0, 0, 1))

    def _end(self, sess: _Session) -> None:
        sess.is_ended = True
        if sess.sid is not None:
            self._post(SessionEnd(**now_stamps(), session_id=sess.sid, source="gateway"))

    def _agents(self) -> None:
        """Arrivals, tool ends, aborts and session kills due at this step."""
        rng = self.rng
        for sess in self.sessions:
            if sess.is_ended:
                continue
            if sess.live is not None:
                if sess.live.request_id in self.loop.finished:
                    self._on_finished(sess)
                elif rng.random() < self.p_abort:
                    self.num_aborts += 1
                    self.loop.abort([sess.live.request_id], during_next_step=rng.random() < 0.5)
                    if rng.random() < 0.3:  # the agent dies with its request: no more turns
                        sess.turns_left = 1
                continue
            if sess.tool_end_at_step is not None and self.step >= sess.tool_end_at_step:
                self._post(ToolEnd(**now_stamps(), session_id=sess.sid, source="agent",
                                   tool_name="bash", tool_call_id=f"{sess.sid}-{sess.turn}",
                                   duration_s=0.5))
                sess.tool_end_at_step = None
            if self.step >= sess.next_at_step:
                self._new_turn(sess)
        if self.p_abort and rng.random() < self.p_abort and self.loop.finished:
            # an abort racing the final token: the request already finished (vLLM ignores it)
            self.loop.abort([rng.choice(list(self.loop.finished))], during_next_step=rng.random() < 0.5)

    def _is_done(self) -> bool:
        return all(s.is_ended for s in self.sessions)

    # ------------------------------------------------------------------ the run
    def run(self, max_steps: int = 4000) -> None:
        dts = (0.001, 0.01, 0.05, 0.5, 3.0)
        weights = (30, 40, 20, 8, 2)
        while not self._is_done():
            if self.step >= max_steps:
                raise RuntimeError(f"workload not done in {max_steps} steps: "
                                   f"{check_state(self.s, self.requests)}")
            self._agents()
            if self.rng.random() < self.p_reset:  # a utility call, between two steps
                self.s.reset_prefix_cache(reset_running_requests=self.rng.random() < 0.5)
                check_invariants(self.s)
            self.h.clock.advance(self.rng.choices(dts, weights)[0])
            if self.loop.has_work():
                self.loop.step()
                check_invariants(self.s)
            self.step += 1
        self.loop.drain(2000, on_step=lambda: self.h.clock.advance(1.0))
        # The sessions' ends (and any retained KV's expiry) apply at the next steps; vLLM steps
        # an idle engine when our scheduler asks (has_requests).
        for _ in range(3):
            self.h.clock.advance(10.0)
            self.loop.drain(2000, on_step=lambda: self.h.clock.advance(1.0))
            if self.is_ours:
                self.s.schedule()
        check_invariants(self.s)
        check_final(self.h, self.loop, self.requests)


def _held(s: Any) -> list[Request]:
    held = getattr(s, "held_requests", None)
    return list(held()) if held is not None else []


def check_invariants(s: Any) -> None:
    """After any scheduler call: vLLM's queues and our holds hold live requests, each once.

    Raises:
        AssertionError: naming the request and where it is.
    """
    running = {r.request_id for r in s.running}
    queued = [r.request_id for q in (s.waiting, s.kv_holding_waiting) for r in q]
    held = [r.request_id for r in _held(s)]
    places = [*running, *queued, *held]
    assert len(places) == len(set(places)), f"a request is in two places: {sorted(places)}"
    for r in [*s.running, *s.waiting, *s.kv_holding_waiting, *_held(s)]:
        assert s.requests.get(r.request_id) is r and not r.is_finished(), (
            f"{r.request_id} ({r.status.name}) is queued or held but not live "
            f"(running {r.request_id in running}, held {r.request_id in held})")


def check_state(s: Any, requests: dict[str, Request]) -> str:
    """What is still in the scheduler, for a failure message."""
    return (f"requests {sorted(s.requests)}, running {[r.request_id for r in s.running]}, "
            f"waiting {[r.request_id for r in s.waiting]}, held {[r.request_id for r in _held(s)]}, "
            f"statuses {{{', '.join(f'{k}: {v.status.name}' for k, v in requests.items() if k in s.requests)}}}")


def check_final(h: Harness, loop: AsyncEngineLoop, requests: dict[str, Request]) -> None:
    """Nothing is left once every session ended: every request finished exactly once; no
    request, held request, retained entry, per-request state or used block remains.

    Raises:
        AssertionError: naming what is left.
    """
    s = h.scheduler
    assert not loop.violations, f"finish violations: {loop.violations[:5]}"
    unfinished = sorted(set(requests) - set(loop.finished))
    assert not unfinished, f"requests that never finished: {unfinished}; {check_state(s, requests)}"
    assert not s.requests and not s.running and not s.waiting and not s.kv_holding_waiting, (
        f"requests left in the scheduler: {check_state(s, requests)}")
    assert not _held(s), f"held requests left: {[r.request_id for r in _held(s)]}"
    assert not s.has_requests(), "the engine would keep stepping with nothing in"
    if hasattr(s, "retained"):
        assert not s.retained, f"retained KV left: {sorted(s.retained)}"
        left = {a: getattr(s, a) for a in _PER_REQUEST_STATE if getattr(s, a, None)}
        assert not left, f"per-request state left: {left}"
        busy = {sid: sorted(st.active_request_ids) for sid, st in s.sessions.items()
                if st.active_request_ids}
        assert not busy, f"sessions with requests left: {busy}"
    counts = h.assert_no_leaks()
    assert counts["used"] == 0, f"blocks still used: {counts}"


def run_seed(name: str, seed: int) -> SeedResult:
    """Run one seed of the property on one policy; never raises (the error is in the result)."""
    result = SeedResult(name, seed)
    run: _Run | None = None
    try:
        run = _Run(build_case(name), seed)
        run.run()
    except Exception as e:  # noqa: BLE001 - a property failure of any kind is this seed's result
        tb = traceback.extract_tb(e.__traceback__)
        where = "; ".join(f"{f.name}:{f.lineno}" for f in tb[-4:])
        result.error = f"{type(e).__name__}: {e} [at {where}]"
    if run is not None:
        result.num_requests = len(run.requests)
        result.num_steps = run.loop.num_steps
        result.num_preemptions = run.loop.num_preemptions
        result.num_aborts = run.num_aborts
        result.num_finished_preempted = run.loop.num_finished_preempted
        result.num_finished_held = len(run.loop.finished_while_held)
        for how in run.loop.finished.values():
            result.finishes[how] = result.finishes.get(how, 0) + 1
    return result


def run_seeds(name: str, seeds: range, on_result: Callable[[SeedResult], None] | None = None
              ) -> list[SeedResult]:
    """:func:`run_seed` over ``seeds``; returns the failures."""
    failures = []
    for seed in seeds:
        res = run_seed(name, seed)
        if on_result is not None:
            on_result(res)
        if res.error is not None:
            failures.append(res)
    return failures
