"""The gateway's Router over the routing policies (control/routing.py → policy/placement.py):
prompts feed the prefix index and the working sets, a lost replica's sessions are re-placed, and
nothing the router keeps per session or replica outlives the sessions."""

from __future__ import annotations

import pytest

from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.control.plane import ControlPlane
from mars_openhands.policy.placement import live_routing_policies


def plane(policy: str, num_replicas: int = 4) -> ControlPlane:
    config = GatewayConfig(replicas=tuple(ReplicaConfig(url=f"http://r{i}") for i in range(num_replicas)),
                           routing_policy=policy, num_tool_workers=4)
    cp = ControlPlane(config, clock=lambda: 0.0)
    for i in range(num_replicas):
        cp.router.observe_engine_step(f"engine:{i}", 0, 1000)
    return cp


def test_an_unknown_routing_policy_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: least-sessions, sticky-hash"):
        plane("round-robin")


def test_llm_d_sends_a_turn_where_its_prefix_is_unless_the_queue_outweighs_it() -> None:
    cp = plane("llm-d", 2)
    s = cp.open_session("s")
    first = cp.router.route(s, 1600).index
    assert cp.router.replicas[first].num_prefix_tokens == 1600
    cp.router.replicas[first].num_waiting = 1  # 3 * 1.0 + 2 * 0 = 3 > 0 + 2 * 1
    assert cp.router.route(s, 2000).index == first
    cp.router.replicas[1 - first].num_waiting = 0
    other = cp.open_session("t")
    assert cp.router.route(other, 100).index == 1 - first  # no prefix: the shorter queue
    assert cp.router.num_rehomes == 0


@pytest.mark.parametrize("policy", live_routing_policies())
def test_a_lost_replica_re_places_its_sessions_and_nothing_leaks(policy: str) -> None:
    cp = plane(policy)
    sessions = [cp.open_session(f"s{i}") for i in range(12)]
    for k, s in enumerate(sessions):
        cp.router.route(s, 1000 + 100 * k)
    lost = sessions[0].replica
    assert lost is not None
    on_lost = [s for s in sessions if s.replica == lost]
    assert cp.replica_failed(lost, "killed", immediate=True)
    assert all(s.replica is None for s in on_lost)
    assert cp.router.replicas[lost].num_sessions == 0
    assert cp.router.replicas[lost].num_prefix_tokens == 0
    for s in sessions:
        assert cp.router.route(s, 5000).index != lost
    assert sum(r.num_sessions for r in cp.router.replicas) == len(sessions)
    for s in sessions:
        cp.end_session(s)
    assert [r.num_sessions for r in cp.router.replicas] == [0, 0, 0, 0]
    assert cp.router._placement == {}
    assert all(not bound for bound in cp.router._bound)


def test_working_sets_follow_each_turns_prompt_for_sticky_policies_that_read_them() -> None:
    cp = plane("thunderagent", 2)
    s = cp.open_session("s")
    home = cp.router.route(s, 1000).index
    assert cp.router.route(s, 3000).index == home  # sticky
    assert cp.router.replica_loads()[home].num_working_set_tokens == 5000  # 3000 + 2000 growth


@pytest.mark.parametrize("policy", ["least-sessions", "mars-placement"])
def test_each_snapshot_field_reads_its_own_replica_field(policy: str) -> None:
    """replica_loads builds ReplicaLoad positionally (speed): every field must land in its own
    slot, with values that differ from one field to the next."""
    cp = plane(policy, 2)
    s = cp.open_session("s")
    index = cp.router.route(s, 3000).index
    s.tools_in_flight["call"] = object()
    r = cp.router.replicas[index]
    r.num_in_flight, r.num_waiting, r.num_prefix_tokens = 7, 11, 13
    cp.router.observe_engine_step(f"engine:{index}", 250, 1000)
    r.block_size_tokens = 16
    load = cp.router.replica_loads()[index]
    needs_sets = cp.router.policy.needs_prompt
    assert (load.index, load.is_healthy, load.num_sessions, load.kv_usage, load.num_in_flight,
            load.num_waiting, load.num_kv_tokens, load.num_prefix_tokens) == (
        index, True, 1, 0.25, 7, 11, 16_000, 13)
    assert load.num_working_set_tokens == (cp.router._placement["s"].projected_tokens
                                           if needs_sets else 0)
    assert load.num_acting_sessions == (1 if needs_sets else 0)
    if needs_sets:
        assert load.num_working_set_tokens > 0
