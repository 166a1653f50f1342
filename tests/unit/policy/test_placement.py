"""The routing policies (mars_openhands/policy/placement.py): each one's decision on a constructed
state where the other policies decide differently, so a policy swapped for another fails here."""

from __future__ import annotations

import dataclasses

import pytest

from mars_openhands.policy.placement import (
    ROUTING_POLICIES,
    NoHealthyReplicaError,
    ReplicaLoad,
    RouteRequest,
    _stable_hash,
    choose_replica,
    live_routing_policies,
    routing_policy,
)

KV = 100_000
"""KV tokens of every replica in these states."""


def _decisions(request: RouteRequest, loads: list[ReplicaLoad]) -> dict[str, int]:
    """Every router's decision (not the simulator's pooled-KV bound: it places compute only)."""
    return {name: choose_replica(request, loads, name) for name in live_routing_policies()}


def _unique(decisions: dict[str, int], name: str) -> None:
    others = {n: i for n, i in decisions.items() if n != name}
    assert decisions[name] not in others.values(), decisions


def test_least_sessions_takes_the_fewest_sessions_then_kv_then_in_flight():
    loads = [ReplicaLoad(0, num_sessions=3, kv_usage=0.1),
             ReplicaLoad(1, num_sessions=2, kv_usage=0.5, num_in_flight=1),
             ReplicaLoad(2, num_sessions=2, kv_usage=0.5, num_in_flight=0),
             ReplicaLoad(3, num_sessions=2, kv_usage=0.9)]
    assert choose_replica(RouteRequest("s"), loads) == 2
    # Sticky: a bound session stays while its replica is healthy, however loaded.
    assert choose_replica(RouteRequest("s", replica=0), loads) == 0
    down = [ReplicaLoad(0, is_healthy=False)] + loads[1:]
    assert choose_replica(RouteRequest("s", replica=0), down) == 2


def test_sticky_hash_is_the_session_ids_hash_mod_n_and_walks_the_ring_when_down():
    session = next(f"s{i}" for i in range(100) if _stable_hash(f"s{i}") % 4 == 3)
    loads = [ReplicaLoad(i, num_sessions=9 if i == 3 else 0) for i in range(4)]
    decisions = _decisions(RouteRequest(session, num_prompt_tokens=1000), loads)
    assert decisions["sticky-hash"] == 3
    _unique(decisions, "sticky-hash")
    down = loads[:3] + [ReplicaLoad(3, is_healthy=False)]
    assert choose_replica(RouteRequest(session, replica=3), down, "sticky-hash") == 0  # wraps


def test_llm_d_weighs_prefix_3_against_queue_2_every_turn():
    # Replica 1 holds 60% of the prompt's blocks but the longest queue: 3*0.6 = 1.8 < 2 + 0.
    # Replica 2 holds 100%: 3*1 + 2*0.5 = 4 beats replica 0's 0 + 2*1; replica 3 is the empty one.
    request = RouteRequest("s", replica=1, num_prompt_tokens=1600,
                           cached_tokens={1: 960, 2: 1600}, block_size_tokens=16)
    loads = [ReplicaLoad(0, num_sessions=5, num_waiting=0, num_kv_tokens=KV),
             ReplicaLoad(1, num_sessions=1, num_waiting=4, num_kv_tokens=KV),
             ReplicaLoad(2, num_sessions=5, num_waiting=2, num_kv_tokens=KV),
             ReplicaLoad(3, num_sessions=0, num_waiting=4, num_kv_tokens=KV,
                         num_prefix_tokens=0)]
    decisions = _decisions(request, loads)
    assert decisions["llm-d"] == 2
    assert decisions["least-sessions"] == 1  # sticky
    # With the prefix on replica 1 only: 3*0.6 + 0 = 1.8 < replica 0's 2.0 (queue only).
    only_1 = RouteRequest("s", num_prompt_tokens=1600, cached_tokens={1: 960})
    assert choose_replica(only_1, loads, "llm-d") == 0


def test_prefix_affinity_follows_the_match_when_balanced_and_the_queue_when_not():
    request = RouteRequest("s", replica=0, num_prompt_tokens=1000, cached_tokens={2: 900})
    loads = [ReplicaLoad(0, num_sessions=1, num_in_flight=3, num_prefix_tokens=50),
             ReplicaLoad(1, num_sessions=4, num_in_flight=2, num_prefix_tokens=10),
             ReplicaLoad(2, num_sessions=4, num_in_flight=5, num_prefix_tokens=900),
             ReplicaLoad(3, num_sessions=4, num_in_flight=4, num_prefix_tokens=40)]
    decisions = _decisions(request, loads)
    assert decisions["prefix-affinity"] == 2
    # No match above 10%: the smallest tenant (replica 1), not the shortest queue overall.
    cold = RouteRequest("t", num_prompt_tokens=1000, cached_tokens={2: 50})
    assert choose_replica(cold, loads, "prefix-affinity") == 1
    # Imbalanced queues (14 - 2 > 10): power of two choices (of two replicas: both), the shorter
    # queue, whatever the match.
    skewed = [ReplicaLoad(1, num_in_flight=2), ReplicaLoad(2, num_in_flight=14, num_prefix_tokens=900)]
    assert choose_replica(request, skewed, "prefix-affinity") == 1
    balanced = [ReplicaLoad(1, num_in_flight=2), ReplicaLoad(2, num_in_flight=12, num_prefix_tokens=900)]
    assert choose_replica(request, balanced, "prefix-affinity") == 2


def test_ties_are_drawn_per_session_not_sent_to_the_lowest_index():
    loads = [ReplicaLoad(i, num_kv_tokens=KV) for i in range(4)]
    for name in ("llm-d", "prefix-affinity"):
        picks = {choose_replica(RouteRequest(f"s{i}", num_prompt_tokens=500), loads, name)
                 for i in range(40)}
        assert picks == {0, 1, 2, 3}, (name, picks)


def test_thunderagent_takes_the_least_active_tokens_with_room():
    # Replica 0 has the least active tokens but no room for 30k + the buffer; replica 2 has room
    # and fewer tokens than replica 1 though more sessions than any.
    request = RouteRequest("s", num_prompt_tokens=30_000)
    loads = [ReplicaLoad(0, num_sessions=1, num_kv_tokens=40_000, num_working_set_tokens=20_000),
             ReplicaLoad(1, num_sessions=1, num_kv_tokens=KV, num_working_set_tokens=50_000),
             ReplicaLoad(2, num_sessions=6, num_kv_tokens=KV, num_working_set_tokens=40_000,
                         kv_usage=0.0, num_prefix_tokens=0),
             ReplicaLoad(3, num_sessions=1, kv_usage=0.0, num_kv_tokens=KV,
                         num_working_set_tokens=69_950, num_prefix_tokens=0)]
    decisions = _decisions(request, loads)
    assert decisions["thunderagent"] == 2
    assert decisions["least-sessions"] == 0


def test_mars_placement_balances_sessions_then_projected_kv_then_prefers_replicas_in_tool_calls():
    session = next(f"s{i}" for i in range(100) if _stable_hash(f"s{i}") % 4 == 3)
    request = RouteRequest(session, num_prompt_tokens=10_000, num_projected_tokens=12_000)
    # Replica 3 has the smallest working set but two sessions (each grows to a whole context);
    # of the one-session replicas, 1 and 2 tie on projected KV and 2's session is in a tool call.
    loads = [ReplicaLoad(0, num_sessions=1, num_kv_tokens=KV, num_working_set_tokens=80_000,
                         num_waiting=5),
             ReplicaLoad(1, num_sessions=1, num_kv_tokens=KV, num_working_set_tokens=30_000,
                         num_acting_sessions=0, num_waiting=5, num_in_flight=1),
             ReplicaLoad(2, num_sessions=1, num_kv_tokens=KV, num_working_set_tokens=30_000,
                         num_acting_sessions=1, num_waiting=5, num_in_flight=20),
             ReplicaLoad(3, num_sessions=2, num_kv_tokens=KV, num_working_set_tokens=10_000)]
    decisions = _decisions(request, loads)
    assert decisions["mars-placement"] == 2
    assert decisions["least-sessions"] == 0  # KV usage unknown: fewest requests in flight
    _unique(decisions, "mars-placement")


def test_mars_placement_rehomes_only_when_the_overflow_pays_for_the_re_prefill():
    loads = [ReplicaLoad(0, num_sessions=4, num_kv_tokens=KV, num_working_set_tokens=125_000),
             ReplicaLoad(1, num_sessions=4, num_kv_tokens=KV, num_working_set_tokens=40_000)]
    small = RouteRequest("s", replica=0, num_prompt_tokens=20_000, num_projected_tokens=22_000)
    assert choose_replica(small, loads, "mars-placement") == 1  # 25k over >= its 22k
    large = RouteRequest("s", replica=0, num_prompt_tokens=28_000, num_projected_tokens=30_000)
    assert choose_replica(large, loads, "mars-placement") == 0  # 25k over < its 30k re-prefill
    full = [loads[0], ReplicaLoad(1, num_kv_tokens=KV, num_working_set_tokens=75_000)]
    assert choose_replica(small, full, "mars-placement") == 0  # 97% > 90% after the move
    for name in ("least-sessions", "sticky-hash", "thunderagent"):
        assert choose_replica(small, loads, name) == 0  # the sticky anchors never move it


def test_mars_placement_moves_on_any_overflow_when_the_kv_goes_along():
    loads = [ReplicaLoad(0, num_sessions=4, num_kv_tokens=KV, num_working_set_tokens=125_000),
             ReplicaLoad(1, num_sessions=4, num_kv_tokens=KV, num_working_set_tokens=40_000)]
    large = RouteRequest("s", replica=0, num_prompt_tokens=28_000, num_projected_tokens=30_000)
    moved = dataclasses.replace(large, moves_kv=True)
    assert choose_replica(large, loads, "mars-placement") == 0  # a re-prefill: 25k over < its 30k
    assert choose_replica(moved, loads, "mars-placement") == 1  # a transfer: any over-commit
    fits = [dataclasses.replace(loads[0], num_working_set_tokens=100_000), loads[1]]
    assert choose_replica(moved, fits, "mars-placement") == 0  # no over-commit: it stays
    full = [loads[0], ReplicaLoad(1, num_kv_tokens=KV, num_working_set_tokens=75_000)]
    assert choose_replica(moved, full, "mars-placement") == 0  # 105% after the move: it stays
    busy = [dataclasses.replace(fits[0], num_in_flight=6), fits[1]]
    assert choose_replica(moved, busy, "mars-placement") == 0  # a queue alone moves nothing
    for name in ("least-sessions", "sticky-hash", "thunderagent"):
        assert choose_replica(moved, loads, name) == 0  # the sticky anchors never move it


def test_pooled_kv_places_compute_only_and_is_no_live_router():
    loads = [ReplicaLoad(0, num_sessions=2, num_in_flight=3, kv_usage=0.1),
             ReplicaLoad(1, num_sessions=3, num_in_flight=1, kv_usage=0.9),
             ReplicaLoad(2, num_sessions=2, num_in_flight=2, kv_usage=0.2)]
    # New: the fewest sessions, ties by requests in flight (KV is one pool: not a criterion).
    assert choose_replica(RouteRequest("s"), loads, "pooled-kv") == 2
    # Bound: moves only when its replica has >= 2 more requests in flight than the idlest.
    assert choose_replica(RouteRequest("s", replica=0), loads, "pooled-kv") == 1
    assert choose_replica(RouteRequest("s", replica=2), loads, "pooled-kv") == 2
    assert routing_policy("pooled-kv").pools_kv
    assert "pooled-kv" in ROUTING_POLICIES and "pooled-kv" not in live_routing_policies()
    assert not any(ROUTING_POLICIES[name].pools_kv for name in live_routing_policies())


def test_a_live_gateway_refuses_the_pooled_kv_bound():
    from mars_openhands.control.config import GatewayConfig, ReplicaConfig

    replicas = [ReplicaConfig(url="http://127.0.0.1:8001")]
    with pytest.raises(ValueError, match="pooled-KV bound.*use one of least-sessions"):
        GatewayConfig(replicas=replicas, routing_policy="pooled-kv")
    assert GatewayConfig(replicas=replicas, routing_policy="mars-placement").routing_policy == "mars-placement"


def test_no_healthy_replica_and_unknown_names_raise():
    with pytest.raises(NoHealthyReplicaError):
        choose_replica(RouteRequest("s"), [ReplicaLoad(0, is_healthy=False)])
    with pytest.raises(ValueError, match="known: least-sessions"):
        routing_policy("round-robin")
