"""The reclaim-order and request-added hooks: a policy orders reclaim and acts on a new request
through ``PolicyHooks`` (``reclaim_key``, ``on_request_added``) instead of overriding the base's
``_reclaim_for`` / ``add_request``."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from mars_openhands.engine.schedulers.base import MarsBaseScheduler  # noqa: E402
from mars_openhands.engine.schedulers.continuum import ContinuumScheduler  # noqa: E402
from mars_openhands.engine.schedulers.hooks import PolicyHooks  # noqa: E402
from mars_openhands.engine.schedulers.kv_retention import KvRetention  # noqa: E402
from mars_openhands.engine.schedulers.retained import RetainedKv, RetainedKvPool  # noqa: E402
from mars_openhands.engine.schedulers.thunderagent import ThunderAgentScheduler  # noqa: E402


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 1


def _entry(sid: str, num_blocks: int, *, retained_s: float, value_s: float) -> RetainedKv:
    first = 100 * (ord(sid[-1]) - ord("a"))
    return RetainedKv(sid, f"{sid}-r", 0, [_Block(first + i) for i in range(num_blocks)],
                      16 * num_blocks, retained_s, 100.0, value_s, "test")


class _Host(KvRetention, PolicyHooks):
    """Just the state ``KvRetention._reclaim_for`` reads; ``reclaim`` records the victim."""

    def __init__(self, entries: list[RetainedKv]) -> None:
        self.retained = RetainedKvPool()
        for e in entries:
            self.retained.add(e)
        self.req_state = {"r": SimpleNamespace(session_id="own")}
        self.running = [object()]
        self.kv_pool_peers = [self]
        self.reclaimed: list[str] = []

    def clock(self) -> float:
        return 5.0

    def reclaim(self, session_id: str, now_s: float | None = None) -> int:
        self.reclaimed.append(session_id)
        return self.retained[session_id].num_blocks


# a: big and cheap, b: small and valuable, c: the middle; own: the requester's own entry
_ENTRIES = [_entry("sa", 8, retained_s=1.0, value_s=0.1), _entry("sb", 2, retained_s=3.0, value_s=9.0),
            _entry("sc", 4, retained_s=2.0, value_s=1.0), _entry("own", 1, retained_s=0.0, value_s=0.0)]


def _victim(host_cls: type[_Host]) -> str:
    host = host_cls(list(_ENTRIES))
    assert host._reclaim_for(SimpleNamespace(request_id="r", session_id="own"))
    return host.reclaimed[0]


def test_default_reclaim_order_is_lowest_value_per_block() -> None:
    assert _victim(_Host) == "sa"


def test_the_policys_reclaim_key_picks_the_victim() -> None:
    class Smallest(_Host):
        def reclaim_key(self, entry: RetainedKv, request: Any, now_s: float) -> Any:
            return ThunderAgentScheduler.reclaim_key(self, entry, request, now_s)  # type: ignore[arg-type]

    class LatestArrival(_Host):
        arrivals = {"sa": 1.0, "sb": 3.0, "sc": 2.0}

        def _program_arrival_s(self, session_id: str | None, request_id: str, default_s: float) -> float:
            return self.arrivals[session_id] if session_id else default_s

        def reclaim_key(self, entry: RetainedKv, request: Any, now_s: float) -> Any:
            return ContinuumScheduler.reclaim_key(self, entry, request, now_s)  # type: ignore[arg-type]

    assert _victim(Smallest) == "sb"  # ThunderAgent: the smallest program's KV first
    assert _victim(LatestArrival) == "sb"  # Continuum: the latest program arrival first
    LatestArrival.arrivals = {"sa": 4.0, "sb": 3.0, "sc": 2.0}
    assert _victim(LatestArrival) == "sa"


def test_can_reclaim_for_still_filters_before_the_order() -> None:
    class NotA(_Host):
        def can_reclaim_for(self, entry: RetainedKv, request: Any, now_s: float) -> bool:
            return entry.session_id != "sa"

    assert _victim(NotA) == "sc"  # the next lowest value per block


def test_no_policy_class_overrides_the_base_machinery() -> None:
    """The hooks replaced the overrides: no class redefines ``add_request``, ``_reclaim_for``,
    ``_free_blocks`` or ``_cached_at_arrival``."""
    from mars_openhands.engine.schedulers.autellix import AutellixScheduler
    from mars_openhands.engine.schedulers.mars import MarsScheduler

    for cls in (AutellixScheduler, ContinuumScheduler, ThunderAgentScheduler, MarsScheduler):
        overrides = {"add_request", "_reclaim_for", "_free_blocks", "_cached_at_arrival"} & set(vars(cls))
        assert not overrides, f"{cls.__name__} overrides {overrides}"
        assert "on_request_added" in vars(cls), cls.__name__
    assert {"on_request_finishing", "cached_tokens_at_arrival"} <= set(vars(MarsScheduler))
    assert MarsBaseScheduler.on_request_added is PolicyHooks.on_request_added
