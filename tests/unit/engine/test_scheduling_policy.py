"""``--scheduling-policy priority`` (issue 33): honoured by the classes that keep vLLM's order and
victim, refused at start-up by those that order requests themselves, and never overwritten by the
victim ranks a policy writes for one step."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402

from mars_openhands.engine import (  # noqa: E402
    AutellixScheduler,
    ContinuumScheduler,
    FcfsScheduler,
    InferceptScheduler,
    MarsPreviewScheduler,
    MarsScheduler,
    ThunderAgentScheduler,
)
from tests.unit.engine.harness import Harness  # noqa: E402


@pytest.mark.parametrize("cls", [AsyncScheduler, FcfsScheduler, InferceptScheduler,
                                 ThunderAgentScheduler])
def test_priority_policy_admits_the_highest_priority_first(cls) -> None:
    """One slot, two waiting requests: vLLM's priority policy admits the smaller priority value
    first whatever the arrival order (Fcfs used to admit in arrival order)."""
    h = Harness(cls, num_blocks=128, max_num_seqs=1, scheduling_policy="priority")
    h.add(h.make_request(None, h.tokens(40), 2, request_id="low", priority=5))
    h.add(h.make_request(None, h.tokens(40), 2, request_id="high", priority=0))
    order = []
    for res in h.run_until_done(max_steps=100):
        order += [rid for rid in res.num_scheduled_tokens if rid not in order]
    assert order == ["high", "low"]
    h.assert_no_leaks()


@pytest.mark.parametrize("cls", [MarsScheduler, MarsPreviewScheduler, AutellixScheduler,
                                 ContinuumScheduler])
def test_policy_classes_refuse_the_priority_policy(cls) -> None:
    with pytest.raises(ValueError, match=r"does not support --scheduling-policy priority: .*"
                                         r"(waiting_key|victim_key)"):
        Harness(cls, scheduling_policy="priority")


@pytest.mark.parametrize("cls", [MarsScheduler, MarsPreviewScheduler, AutellixScheduler,
                                 ContinuumScheduler])
def test_victim_ranks_do_not_overwrite_the_users_priority(cls) -> None:
    """A class that ranks preemption victims writes the ranks into ``Request.priority`` for one
    step only: under KV pressure (victims ranked) every request keeps the priority it came with."""
    h = Harness(cls, num_blocks=14, max_num_batched_tokens=128, long_prefill_token_threshold=32)
    given = {"P": 7, "D1": -3, "D2": 2}
    reqs = [h.add(h.make_request(None, h.tokens(n), m, request_id=rid, priority=given[rid]))
            for rid, n, m in (("P", 160, 4), ("D1", 32, 40), ("D2", 32, 40))]
    preempted: set[str] = set()
    for res in h.run_until_done(max_steps=500):
        preempted |= res.preempted_ids
        assert {r.request_id: r.priority for r in reqs} == given
    assert preempted, "the scenario must run out of KV (victims ranked)"
    h.assert_no_leaks()
