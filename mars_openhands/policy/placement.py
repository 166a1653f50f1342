"""Session placement across replicas: the one routing decision the gateway, the simulator and the
Ray router share (design.md §6; issue 32 items 5-6).

Plain data in, a replica index out. The caller (``control/routing.py``'s ``Router``) snapshots
what it knows into a :class:`RouteRequest` (the session's bound replica, its prompt, the prefix of
it each replica was last sent) and one :class:`ReplicaLoad` per replica (health, sessions, KV,
queue, the KV working set of the sessions bound there), and :func:`choose_replica` applies the
policy named in :data:`ROUTING_POLICIES`. Nothing here keeps state, reads a clock or draws a random
number: where the public routers this file follows draw at random (llm-d's max-score picker among
ties, Ray's power of two choices), the draw here is a hash of the session id and the prompt's
size (:func:`_draw`), so a run is reproducible and the draws still spread sessions.

Mental model: a session's KV lives on the replica that served its previous turn. A *sticky* policy
decides once per session (and again only when its replica goes down); a *per-turn* policy scores
every replica for every turn, and keeps a session where its prefix is only as far as its scorer
says so. ``mars-placement`` is sticky but re-homes a session at a turn boundary when its replica's
KV working set no longer fits and moving it costs less re-prefill than the evictions it saves.

Policies (name: source, version):

* ``least-sessions`` (default; ours before this file, unchanged): sticky; a new session goes to the
  replica with the fewest sessions, ties by KV usage, in-flight requests, index.
* ``sticky-hash``: sticky on a hash of the session id: replica ``blake2b(id) mod N``, the next
  healthy one in ring order when it is down (Ray Serve's consistent-hash request routing on a
  session key; llm-d's ``session-affinity-scorer``, llm-d-inference-scheduler v0.3).
* ``llm-d``: per turn, llm-d's default scheduling profile (llm-d-inference-scheduler v0.3,
  ``guides/inference-scheduling``): ``3 * prefix-cache-scorer + 2 * queue-scorer``, max-score
  picker (a draw among ties). The prefix scorer is the matched fraction of the prompt's blocks on the replica (its
  approximate index of the prompts it routed, LRU capacity not modelled); the queue scorer is
  gateway-api-inference-extension's ``QueueScorer`` (``(max - q) / (max - min)`` of the waiting
  queue, 1.0 when all are equal).
* ``prefix-affinity``: per turn, Ray Serve LLM's ``PrefixCacheAffinityRouter`` (ray 2.50,
  ``ray/llm/_internal/serve/request_router/prefix_aware/prefix_aware_router.py``): when the
  replicas' queue lengths differ by at most ``imbalanced_threshold`` = 10, the replicas with the
  longest prefix match if its rate is >= ``match_rate_threshold`` = 0.1, else the smallest tenants
  of its prefix tree; imbalanced: power of two choices (two replicas drawn); the shortest queue
  among those.
* ``thunderagent``: sticky; ThunderAgent's router (``ThunderAgent-org/ThunderAgent`` a7eef77,
  ``scheduler/router.py`` ``_select_backend_for_new_program``): the healthy backend with the least
  active program tokens that has room for the prompt plus ``BUFFER_PER_PROGRAM`` = 100 tokens per
  program (its ``remaining_capacity``); ThunderAgent queues a program none has room for, which here
  is the admission window's job, so it goes to the least active tokens.
* ``mars-placement`` (ours): sticky with re-homing; a new session goes to the replica with the
  fewest sessions (each grows to a whole context: the count predicts KV growth better than today's
  working set, which a young session barely adds to), ties by the smallest projected KV working
  set (its sessions' next-turn contexts, plus this one) as a fraction of its KV, then by sessions
  in the LLM phase (not in a tool call: CPU pressure leaves a replica's compute free), then index. At a turn boundary the session moves when its replica
  is over-committed by at least the session's own context (the re-prefill it is charged is no more
  than the evictions it saves) and another replica takes it below ``rehome_max_fill`` = 0.9. When
  a move sends the session's KV along (``RouteRequest.moves_kv``: a KV transfer, not a
  re-prefill), any over-commit moves it. (Moving also for a queue, as the pooled bound does, was
  measured and left out: docs/compare.md, "Replicas and routers".)
* ``pooled-kv`` (a bound, not a router: ``pools_kv``): the replicas' KV is one pool (the
  simulator shares one vLLM block pool among the engines, so a prefix computed on one replica is a
  hit on every other and no placement can do better on KV); only compute is placed. Sticky with
  re-homing: a new session goes to the fewest sessions, ties fewest requests in flight, index; at a
  turn boundary it moves to the replica with the fewest requests in flight when its own has
  ``POOLED_REHOME_MIN_GAP`` = 2 more (a move costs no re-prefill in a pool). A live gateway
  refuses it (``mars-openhands gateway`` / ``serve`` offer only :func:`live_routing_policies`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_ROUTING_POLICY",
    "ROUTING_POLICIES",
    "NoHealthyReplicaError",
    "ReplicaLoad",
    "RouteRequest",
    "RoutingPolicy",
    "choose_replica",
    "live_routing_policies",
    "routing_policy",
]

DEFAULT_ROUTING_POLICY = "least-sessions"

LLMD_PREFIX_WEIGHT = 3.0
"""llm-d default profile: ``prefix-cache-scorer`` weight (guides/inference-scheduling)."""
LLMD_QUEUE_WEIGHT = 2.0
"""llm-d default profile: ``queue-scorer`` weight."""
RAY_IMBALANCED_THRESHOLD = 10
"""Ray ``PrefixCacheAffinityRouter.initialize_state`` default ``imbalanced_threshold``."""
RAY_MATCH_RATE_THRESHOLD = 0.1
"""Ray ``PrefixCacheAffinityRouter.initialize_state`` default ``match_rate_threshold``."""
THUNDER_BUFFER_TOKENS = 100
"""ThunderAgent ``backend/state.py`` ``BUFFER_PER_PROGRAM``: decode headroom per program, tokens."""
REHOME_MAX_FILL = 0.9
"""``mars-placement``: a re-homed session's new replica stays at or below this projected KV fill
(a margin so that two replicas do not trade the same session back and forth)."""
POOLED_REHOME_MIN_GAP = 2
"""``pooled-kv``: a session moves at a turn boundary when its replica has at least this many more
requests in flight than the least busy one (1 would move sessions back and forth on every
one-request difference; with one KV pool a move costs only the retention pins it drops)."""


class NoHealthyReplicaError(RuntimeError):
    """Every replica is down."""


@dataclass(slots=True)
class ReplicaLoad:
    """What the router knows about one replica at a decision: a snapshot, read-only by contract
    (not ``frozen``: a frozen dataclass costs ~1 µs more to build, and a first route builds one per
    replica).

    Attributes:
        index: the replica's position (0-based; ties go to the lowest).
        is_healthy: marked up.
        num_sessions: sessions bound to it.
        kv_usage: used fraction of its KV, 0..1, ``None`` if it never reported.
        num_in_flight: requests being served by it now (Ray's queue length).
        num_waiting: requests in its engine's waiting queue (llm-d's ``WaitingQueueSize``).
        num_kv_tokens: its KV capacity in tokens (``num_gpu_blocks * block_size``), ``None`` if
            unknown.
        num_working_set_tokens: the projected next-turn contexts of the sessions bound to it,
            tokens (ThunderAgent's active program tokens; ``mars-placement``'s working set).
        num_acting_sessions: of its sessions, those in a tool call now.
        num_prefix_tokens: tokens of the prompts routed to it (the size of Ray's prefix-tree
            tenant).
    """

    index: int
    is_healthy: bool = True
    num_sessions: int = 0
    kv_usage: float | None = None
    num_in_flight: int = 0
    num_waiting: int = 0
    num_kv_tokens: int | None = None
    num_working_set_tokens: int = 0
    num_acting_sessions: int = 0
    num_prefix_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The session's side of a decision. Frozen snapshot.

    Attributes:
        session_id: the session.
        replica: the replica it is bound to (healthy or not), ``None`` if new or detached.
        num_prompt_tokens: this turn's prompt, tokens (0: unknown).
        num_projected_tokens: its projected next-turn context, tokens (0: unknown); included in its
            replica's ``num_working_set_tokens`` when bound.
        cached_tokens: replica index -> tokens of this prompt's prefix the router last sent there
            (its prefix index; absent: none).
        block_size_tokens: KV block size for block-granular prefix scores.
        moves_kv: a move sends the session's cached KV to its new replica (a KV transfer);
            ``False``: the new replica re-prefills it.
    """

    session_id: str
    replica: int | None = None
    num_prompt_tokens: int = 0
    num_projected_tokens: int = 0
    cached_tokens: Mapping[int, int] = field(default_factory=dict)
    block_size_tokens: int = 16
    moves_kv: bool = False


@dataclass(frozen=True)
class RoutingPolicy:
    """One routing policy of the registry.

    Attributes:
        name: the ``--router`` name.
        choose: ``(request, healthy replicas, N) -> index``; pure; the list is non-empty; N
            counts every replica, healthy or not.
        is_sticky: decides once per session (kept while its replica is healthy, except for what
            ``choose`` re-decides when ``rehomes``); per-turn policies decide every turn.
        rehomes: a sticky policy that ``choose`` asks again at every turn.
        needs_prompt: it reads ``num_prompt_tokens`` / ``cached_tokens``.
        pools_kv: a bound, not a router: the simulator gives the replicas one KV pool
            (``compare --router pooled-kv``); a live gateway cannot, and refuses it.
    """

    name: str
    choose: Callable[[RouteRequest, Sequence[ReplicaLoad], int], int]
    is_sticky: bool = True
    rehomes: bool = False
    needs_prompt: bool = False
    pools_kv: bool = False


# ----------------------------------------------------------------------------- the policies
def _least_sessions(request: RouteRequest, healthy: Sequence[ReplicaLoad],
                    num_replicas: int) -> int:
    best = min(healthy, key=lambda r: (r.num_sessions, r.kv_usage or 0.0, r.num_in_flight, r.index))
    return best.index


def _stable_hash(session_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little")


def _sticky_hash(request: RouteRequest, healthy: Sequence[ReplicaLoad], num_replicas: int) -> int:
    # The ring is all N indices: a replica's going down moves only its own sessions, to the next
    # healthy index in ring order.
    start = _stable_hash(request.session_id) % num_replicas
    indices = sorted(r.index for r in healthy)
    return next((i for i in indices if i >= start), indices[0])


def _draw(request: RouteRequest, salt: str) -> int:
    """A reproducible stand-in for a router's random draw for this request."""
    return _stable_hash(f"{request.session_id}/{request.num_prompt_tokens}/{salt}")


def _pick_tie(request: RouteRequest, tied: Sequence[ReplicaLoad]) -> int:
    """One of ``tied`` (a non-empty list), drawn as the public picker draws (uniformly)."""
    ordered = sorted(tied, key=lambda r: r.index)
    return ordered[_draw(request, "tie") % len(ordered)].index


def _matched_blocks(request: RouteRequest, index: int) -> int:
    return request.cached_tokens.get(index, 0) // request.block_size_tokens


def _llm_d(request: RouteRequest, healthy: Sequence[ReplicaLoad],
           num_replicas: int) -> int:
    num_blocks = max(1, -(-request.num_prompt_tokens // request.block_size_tokens))
    queues = [r.num_waiting for r in healthy]
    q_min, q_max = min(queues), max(queues)

    def score(r: ReplicaLoad) -> float:
        prefix = min(1.0, _matched_blocks(request, r.index) / num_blocks)
        queue = 1.0 if q_max == q_min else (q_max - r.num_waiting) / (q_max - q_min)
        return LLMD_PREFIX_WEIGHT * prefix + LLMD_QUEUE_WEIGHT * queue

    scores = {r.index: score(r) for r in healthy}
    best = max(scores.values())
    return _pick_tie(request, [r for r in healthy if scores[r.index] == best])


def _prefix_affinity(request: RouteRequest, healthy: Sequence[ReplicaLoad],
                     num_replicas: int) -> int:
    queues = [r.num_in_flight for r in healthy]
    ordered = sorted(healthy, key=lambda r: r.index)
    first = _draw(request, "pow2") % len(ordered)  # power of two choices: two distinct draws
    second = (first + 1 + _draw(request, "pow2-second") % max(1, len(ordered) - 1)) % len(ordered)
    candidates: Sequence[ReplicaLoad] = [ordered[first], ordered[second]]
    if max(queues) - min(queues) <= RAY_IMBALANCED_THRESHOLD:
        matched = {r.index: request.cached_tokens.get(r.index, 0) for r in healthy}
        longest = max(matched.values())
        rate = longest / request.num_prompt_tokens if request.num_prompt_tokens > 0 else 0.0
        if rate >= RAY_MATCH_RATE_THRESHOLD and longest > 0:
            candidates = [r for r in healthy if matched[r.index] == longest]
        else:
            smallest = min(r.num_prefix_tokens for r in healthy)
            candidates = [r for r in healthy if r.num_prefix_tokens == smallest]
    shortest = min(r.num_in_flight for r in candidates)
    return _pick_tie(request, [r for r in candidates if r.num_in_flight == shortest])


def _thunderagent(request: RouteRequest, healthy: Sequence[ReplicaLoad],
                  num_replicas: int) -> int:
    need = request.num_prompt_tokens + THUNDER_BUFFER_TOKENS

    def remaining(r: ReplicaLoad) -> float:
        if r.num_kv_tokens is None:
            return float("inf")
        return r.num_kv_tokens - r.num_working_set_tokens - r.num_sessions * THUNDER_BUFFER_TOKENS

    fitting = [r for r in healthy if remaining(r) >= need]
    return min(fitting or healthy, key=lambda r: (r.num_working_set_tokens, r.index)).index


def _fill_with(r: ReplicaLoad, extra_tokens: int) -> float:
    """Projected KV fill of ``r`` with ``extra_tokens`` more, as a fraction of its KV (its session
    count when the KV size is unknown, so the order still balances)."""
    if not r.num_kv_tokens:
        return float(r.num_sessions + (1 if extra_tokens else 0))
    return (r.num_working_set_tokens + extra_tokens) / r.num_kv_tokens


def _mars_placement(request: RouteRequest, healthy: Sequence[ReplicaLoad],
                    num_replicas: int) -> int:
    size = max(request.num_projected_tokens, request.num_prompt_tokens)
    current = next((r for r in healthy if r.index == request.replica), None)
    others = [r for r in healthy if r is not current]
    if current is not None:
        if not others or not current.num_kv_tokens:
            return current.index
        # Over-commit of the current replica's KV, tokens (the session is already counted).
        overflow = current.num_working_set_tokens - current.num_kv_tokens
        best = min(others, key=lambda r: (_fill_with(r, size), r.index))
        # The move's charge: a re-prefill of the session's context (worth it only if the over-commit
        # is at least that), or a KV transfer (any over-commit).
        charge = 1 if request.moves_kv else size
        if overflow >= charge and size > 0 and _fill_with(best, size) <= REHOME_MAX_FILL:
            return best.index
        return current.index
    # A new session's KV is its first prompt but grows to its whole context: the replica's session
    # count predicts that growth better than the working set's projection now (measured:
    # docs/compare.md, "Replicas and routers"), which breaks ties; re-homing corrects what it misses.
    return min(healthy, key=lambda r: (r.num_sessions, _fill_with(r, size),
                                       r.num_sessions - r.num_acting_sessions, r.index)).index


def _pooled_kv(request: RouteRequest, healthy: Sequence[ReplicaLoad], num_replicas: int) -> int:
    idlest = min(healthy, key=lambda r: (r.num_in_flight, r.num_sessions, r.index))
    current = next((r for r in healthy if r.index == request.replica), None)
    if current is not None:
        gap = current.num_in_flight - idlest.num_in_flight
        return idlest.index if gap >= POOLED_REHOME_MIN_GAP else current.index
    return min(healthy, key=lambda r: (r.num_sessions, r.num_in_flight, r.index)).index


ROUTING_POLICIES: Mapping[str, RoutingPolicy] = {
    p.name: p for p in (
        RoutingPolicy("least-sessions", _least_sessions),
        RoutingPolicy("sticky-hash", _sticky_hash),
        RoutingPolicy("llm-d", _llm_d, is_sticky=False, needs_prompt=True),
        RoutingPolicy("prefix-affinity", _prefix_affinity, is_sticky=False, needs_prompt=True),
        RoutingPolicy("thunderagent", _thunderagent, needs_prompt=True),
        RoutingPolicy("mars-placement", _mars_placement, rehomes=True, needs_prompt=True),
        RoutingPolicy("pooled-kv", _pooled_kv, rehomes=True, pools_kv=True),
    )
}
"""Every routing policy by ``--router`` name (see the module docstring for each one's source),
the simulator's ``pooled-kv`` bound included."""


def live_routing_policies() -> tuple[str, ...]:
    """The names a live gateway accepts: every policy but the bounds (``pools_kv``). Pure."""
    return tuple(name for name, p in ROUTING_POLICIES.items() if not p.pools_kv)


def routing_policy(name: str) -> RoutingPolicy:
    """The registered policy ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    policy = ROUTING_POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(ROUTING_POLICIES)} "
                         "(--router / GatewayConfig.routing_policy)")
    return policy


def choose_replica(request: RouteRequest, replicas: Sequence[ReplicaLoad],
                   policy: str | RoutingPolicy = DEFAULT_ROUTING_POLICY) -> int:
    """The replica for the session's next request: the one routing decision. Pure.

    A sticky policy keeps the session's bound replica while it is healthy (KV affinity), asking
    ``choose`` only for a new or detached session, or at every turn when it re-homes; a per-turn
    policy scores every healthy replica every turn.

    Args:
        request: the session's side.
        replicas: every replica (healthy or not), any order.
        policy: a name of :data:`ROUTING_POLICIES` or the policy itself.

    Returns:
        The chosen replica's ``index``.

    Raises:
        NoHealthyReplicaError: no replica is healthy.
        ValueError: unknown policy name.
    """
    spec = routing_policy(policy) if isinstance(policy, str) else policy
    healthy = [r for r in replicas if r.is_healthy]
    if not healthy:
        raise NoHealthyReplicaError(f"no healthy replica among {len(replicas)}")
    if spec.is_sticky and not spec.rehomes and request.replica is not None and any(
            r.index == request.replica for r in healthy):
        return request.replica
    return spec.choose(request, healthy, len(replicas))
