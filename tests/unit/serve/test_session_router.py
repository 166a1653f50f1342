"""The session router: the gateway's choice (affinity, then least loaded) over Ray Serve replicas."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from mars_openhands.serve.router import SessionRequestRouter, SessionTable

DEPLOYMENT = DeploymentID(name="engine", app_name="test")


class FakeReplica:
    """The attributes a RequestRouter reads of a running replica."""

    def __init__(self, name: str, kv_usage: float | None = None) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict[str, Any] = {} if kv_usage is None else {"kv_usage": kv_usage}
        self.max_ongoing_requests, self.is_cross_language = 8, False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def test_sessions_stick_and_new_ones_go_to_the_least_loaded() -> None:
    table = SessionTable()
    table.set_replicas(("a", "b", "c"))
    first = [table.route(f"s{i}") for i in range(6)]
    assert sorted(first) == [0, 0, 1, 1, 2, 2]  # fewest sessions first
    assert [table.route(f"s{i}") for i in range(6)] == first  # affinity
    table.observe_stats(0, {"kv_usage": 0.9})
    table.observe_stats(1, {"kv_usage": 0.1})
    table.observe_stats(2, {"kv_usage": 0.5})
    assert table.route("new") == 1  # ties on sessions broken by KV usage
    assert table.route(None) == 2 and table.route("") == 2  # one-turn: least loaded, not bound
    assert [r.num_sessions for r in table.router.replicas] == [2, 3, 2]


def test_a_replica_that_leaves_unbinds_only_its_sessions() -> None:
    table = SessionTable()
    table.set_replicas(("a", "b"))
    placed = {sid: table.route(sid) for sid in ("s0", "s1", "s2", "s3")}
    on_b = [sid for sid, i in placed.items() if i == 1]
    table.set_replicas(("a", "c"))  # b died; Ray started c
    for sid, i in placed.items():
        if i == 0:
            assert table.route(sid) == 0, sid
    assert {table.route(sid) for sid in on_b} == {1}  # re-routed to the least loaded: c
    assert [r.num_sessions for r in table.router.replicas] == [2, 2]


def test_the_session_table_is_bounded() -> None:
    table = SessionTable(max_sessions=3)
    table.set_replicas(("a", "b"))
    for i in range(5):
        table.route(f"s{i}")
    assert list(table.sessions) == ["s2", "s3", "s4"]
    assert sum(r.num_sessions for r in table.router.replicas) == 3


def test_request_router_keeps_each_session_on_one_replica() -> None:
    async def run() -> dict[str, set[str]]:
        router = SessionRequestRouter(deployment_id=DEPLOYMENT,
                                      handle_source=DeploymentHandleSource.UNKNOWN,
                                      self_actor_id="test")
        router.initialize_state(max_sessions=100)
        replicas = [FakeReplica("r0", 0.2), FakeReplica("r1", 0.0)]
        router.update_replicas(replicas)
        seen: dict[str, set[str]] = {}
        for turn in range(3):
            for s in range(4):
                meta = RequestMetadata(request_id=f"{s}-{turn}", internal_request_id="x",
                                       session_id=f"s{s}")
                ranks = await router.choose_replicas(replicas, PendingRequest(
                    args=[], kwargs={}, metadata=meta, future=None))
                assert len(ranks) == 1 and len(ranks[0]) == 1
                seen.setdefault(f"s{s}", set()).add(ranks[0][0].replica_id.unique_id)
        assert await router.choose_replicas([], None) == []
        return seen

    seen = asyncio.run(run())
    assert all(len(v) == 1 for v in seen.values()), seen
    assert sorted(next(iter(v)) for v in seen.values()) == ["r0", "r0", "r1", "r1"]


def test_a_replicas_host_tier_sizes_the_windows_kv_pool() -> None:
    table = SessionTable()
    table.set_replicas(("a",))
    table.observe_stats(0, {"kv_usage": 0.8, "num_gpu_blocks": 100, "num_host_blocks": 300})
    assert table.router is not None and abs(table.router.kv_usage() - 0.2) < 1e-12
    table.observe_stats(0, {"kv_usage": 0.8})  # an engine without the fields: GPU usage alone
    assert table.router.kv_usage() == 0.8
