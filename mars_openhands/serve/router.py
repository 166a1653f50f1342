"""Session affinity for Serve-native traffic: a Ray Serve ``RequestRouter`` over the gateway's ``Router``.

Ray Serve routes a request to one replica of a deployment with a ``RequestRouter``
(``ray.serve.request_router``, alpha in ray 2.60: keep this adapter thin). Its default,
``PowerOfTwoChoicesRequestRouter``, samples two replicas and takes the shorter queue, so the turns
of one agent session land anywhere and miss the KV their replica kept for them.
:class:`SessionRequestRouter` makes the gateway's choice instead: the session's replica while it is
up, else the least loaded one (:meth:`mars_openhands.control.routing.Router.route`, the choice the
gateway and the simulator make), with the replicas' KV usage from their routing stats
(:meth:`~mars_openhands.serve.engine.EngineReplica.record_routing_stats`).

Install it on a deployment that receives requests with a session id (HTTP header
``x-session-id``, which Serve puts in ``RequestMetadata.session_id``)::

    serve.deployment(..., request_router_config={
        "request_router_class": "mars_openhands.serve.router:SessionRequestRouter",
        "request_routing_stats_period_s": 1.0})

``mars-openhands serve`` itself routes in its ingress (one deployment per replica, routed by the
gateway's ``ControlPlane``); this router is for a deployment of N identical replicas that Serve
routes, and ``benchmarks/bench_router.py`` measures it against Ray's default.

Mental model: a replica table that follows Serve's set of running replicas (rebuilt when that set
changes: sessions of a replica that left are unbound and re-routed on their next request) and a
bounded table of sessions (the least recently routed are forgotten past ``max_sessions``).
"""

from __future__ import annotations

import collections
import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.control.routing import Router
from mars_openhands.control.sessions import Session

__all__ = ["SessionRequestRouter", "SessionTable"]

STATS_REFRESH_S = 0.5
"""Seconds between two reads of the replicas' routing stats (Serve refreshes them every
``request_routing_stats_period_s``; reading them on every decision costs O(replicas))."""

DEFAULT_MAX_SESSIONS = 100_000
"""Sessions remembered per router (~200 B each: ~20 MB); older ones are routed as new."""


class SessionTable:
    """The gateway's :class:`Router` over a changing set of replica ids, and the sessions' bindings.

    Args:
        max_sessions: sessions remembered; the least recently routed go first.

    Single-threaded (the router's event loop).
    """

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self.replica_ids: tuple[Any, ...] = ()
        self.router: Router | None = None
        self.sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()

    def set_replicas(self, replica_ids: tuple[Any, ...]) -> None:
        """Follow a new set of running replicas: a fresh :class:`Router` with one entry per id;
        each session bound to a replica still there keeps it, the others are unbound. Mutates."""
        if replica_ids == self.replica_ids:
            return
        old = self.replica_ids
        config = GatewayConfig(replicas=[ReplicaConfig(url=f"http://127.0.0.1:{i + 1}")
                                         for i in range(len(replica_ids))])
        self.router = Router(config, time.monotonic)
        index_of = {rid: i for i, rid in enumerate(replica_ids)}
        for session in self.sessions.values():
            kept = index_of.get(old[session.replica]) if session.replica is not None else None
            session.replica = kept
            if kept is not None:
                self.router.replicas[kept].num_sessions += 1
        self.replica_ids = replica_ids

    def observe_stats(self, index: int, stats: dict[str, Any]) -> None:
        """A replica's routing stats (``kv_usage`` 0..1; its GPU and host-tier blocks, which size
        the window's KV pool, ``Router.kv_usage``) as the KV signal. Mutates."""
        assert self.router is not None, "set_replicas() first"
        usage = stats.get("kv_usage")
        if usage is not None:
            replica = self.router.replicas[index]
            replica.kv_usage_polled = float(usage)
            replica.kv_usage_polled_mono_s = time.monotonic()
            replica.num_gpu_blocks = stats.get("num_gpu_blocks") or replica.num_gpu_blocks
            replica.num_host_blocks = int(stats.get("num_host_blocks") or 0)

    def route(self, session_id: str | None) -> int:
        """The replica index for a request of ``session_id`` (``None`` or empty: not bound).

        Raises:
            NoReplicaError: no replica (``set_replicas`` with none).
        """
        assert self.router is not None, "set_replicas() first"
        if not session_id:  # least loaded, bound to nothing
            one_turn = Session("one-turn", 0.0)
            index = self.router.route(one_turn).index
            self.router.detach(one_turn)
            return index
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id, time.monotonic())
            if len(self.sessions) > self.max_sessions:
                _, oldest = self.sessions.popitem(last=False)
                self.router.detach(oldest)
        else:
            self.sessions.move_to_end(session_id)
        return self.router.route(session).index


class SessionRequestRouter(RequestRouter):
    """A ``RequestRouter`` that keeps each session on its replica (module docstring).

    ``request_router_kwargs``: ``max_sessions`` (default :data:`DEFAULT_MAX_SESSIONS`). The replica
    table follows Serve's replica set (``update_replicas``), not each call's candidates, so a
    decision costs O(1) for a session's later turns whatever the fleet size; the chosen replica
    is returned even when Serve finds it full (Serve backs off and asks again: the session waits
    for its KV rather than losing it).
    """

    def initialize_state(self, max_sessions: int = DEFAULT_MAX_SESSIONS, **kwargs: Any) -> None:
        """Ray Serve's hook for ``request_router_kwargs``."""
        self.table = SessionTable(max_sessions)
        self._table_replicas: list[RunningReplica] = []
        self._is_table_stale = True
        self._stats_mono_s = 0.0

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's replica set changed: rebuild the table at the next decision."""
        super().update_replicas(replicas)
        self._is_table_stale = True

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        """One rank: the session's replica, or the least loaded one."""
        if not candidate_replicas:
            return []
        if not hasattr(self, "table"):
            self.initialize_state()
        now = time.monotonic()
        if self._is_table_stale or now - self._stats_mono_s >= STATS_REFRESH_S:
            self._refresh_table(now)
        if not self._table_replicas:
            return [list(candidate_replicas)]
        session_id = pending_request.metadata.session_id if pending_request is not None else None
        return [[self._table_replicas[self.table.route(session_id)]]]

    def _refresh_table(self, now_s: float) -> None:
        """Follow Serve's replicas and read their routing stats. O(replicas). Mutates."""
        replicas = list(self._replicas_list)
        self.table.set_replicas(tuple(r.replica_id for r in replicas))
        for i, replica in enumerate(replicas):
            self.table.observe_stats(i, replica.routing_stats)
        self._table_replicas = replicas
        self._is_table_stale = False
        self._stats_mono_s = now_s
