"""One KV block pool shared by several in-process engines: the simulator's pooled-KV bound
(issue 32, "Done when": capacity per GPU against the pooled bound).

N replicas each hold ``num_gpu_blocks`` blocks of KV. The *pooled* bound gives them one pool of
all N x (``num_gpu_blocks`` - 1) usable blocks (plus vLLM's one null block): a block freed on any
replica is free for all, and a prefix computed on one replica is a prefix hit on every other, at no
transfer cost. No placement of sessions can do better on KV; compute stays per replica (each
engine schedules and steps its own batch).

Mental model: vLLM's ``BlockPool`` (free queue, prefix-cache map, null block) holds no per-request
state; each scheduler's KV cache manager keeps its requests' block tables. So the N schedulers
are built as usual, each believing it has the whole pool (its watermark, its policy's pressure
read the pool), and every one after the first is rebound to the first one's pool
(:func:`~mars_openhands.engine.seams.blocks.share_block_pool`). What stays per scheduler: its
requests, its waiting queue and its preemptions (a scheduler short of blocks preempts its own
requests, never another replica's). Our schedulers' retention pins are per replica too, but a
replica short of blocks reclaims the pool's pins, any replica's, in its own reclaim order before
it preempts, and MARS's residency plans split the pool's budget (each replica's is the pool's
less the other replicas' residents' demand), and a session whose next turn goes to another
replica moves there whole (record, pins, residency) (``kv_pool_peers``, ``adopt_session``,
:mod:`mars_openhands.engine.schedulers.kv_retention`).

::

    replica 0   replica 1   ...  replica N-1        one scheduler each (compute per replica)
        \\           |               /
         +---------- BlockPool -----+              one free queue, one prefix-cache map,
         | null | N x (num_gpu_blocks - 1) blocks  one null block
         +-----------------------------+

Counts and the leak check are over the pool: a block's references are the sum of every
scheduler's block-table references and pins.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mars_openhands.engine import seams

if TYPE_CHECKING:
    from mars_openhands.engine.harness.build import InprocEngineParams
    from mars_openhands.engine.harness.inproc_engine import InprocEngine

__all__ = ["assert_pooled_no_leaks", "pooled_kv_block_counts", "pooled_params"]


def pooled_params(params: Sequence[InprocEngineParams]) -> list[InprocEngineParams]:
    """Each replica's engine shape with the pool's size: every replica's usable blocks together,
    plus the one null block. Pure.

    Args:
        params: one shape per replica (the same block size for all).

    Raises:
        ValueError: no shapes, or block sizes that differ (blocks of one pool have one size).
    """
    if not params:
        raise ValueError("pooled_params needs at least one engine shape")
    sizes = {p.block_size for p in params}
    if len(sizes) != 1:
        raise ValueError(f"a pooled KV needs one block size, got {sorted(sizes)} across the "
                         "replicas (--replica-gpus with different block sizes)")
    num_gpu_blocks = 1 + sum(p.num_gpu_blocks - 1 for p in params)
    return [p.model_copy(update={"num_gpu_blocks": num_gpu_blocks}) for p in params]


def _pins(engine: InprocEngine) -> dict[int, int]:
    plugin = engine.plugin
    return plugin.retained.pin_counts() if plugin is not None else {}


def pooled_kv_block_counts(engines: Sequence[InprocEngine]) -> tuple[int, int, int]:
    """``(free, retained, used)`` blocks of the pool the engines share, null block excluded: free
    from the one free queue, retained = every engine's retained-only pins (a block pinned on one
    replica and referenced on another counts as used), used = the rest. Pure."""
    scheduler = engines[0].scheduler
    free = seams.blocks.num_free_blocks(scheduler)
    retained = sum(e.plugin.kv_block_counts()[1] for e in engines if e.plugin is not None)
    return free, retained, seams.blocks.num_gpu_blocks(scheduler) - 1 - free - retained


def assert_pooled_no_leaks(engines: Sequence[InprocEngine]) -> dict[str, int]:
    """Integrity check of a shared pool: every block's ref count equals the block-table references
    plus the pins of all the engines, and the blocks with no reference are exactly the free ones.

    Returns:
        ``{"free", "used", "pinned", "num_gpu_blocks"}`` (used: blocks some request references).

    Raises:
        AssertionError: printing the counts and the first mismatching blocks.
    """
    refs: Counter[int] = Counter()
    pins: Counter[int] = Counter()
    for engine in engines:
        refs.update(seams.blocks.referenced_block_counts(engine.scheduler))
        pins.update(_pins(engine))
    scheduler = engines[0].scheduler
    bad = []
    num_zero = 0
    for b in seams.blocks.all_blocks(scheduler):
        if b.is_null:
            continue
        expected = refs[b.block_id] + pins[b.block_id]
        if b.ref_cnt != expected:
            bad.append((b.block_id, b.ref_cnt, expected))
        num_zero += b.ref_cnt == 0
    free = seams.blocks.num_free_blocks(scheduler)
    total = seams.blocks.num_gpu_blocks(scheduler)
    assert not bad and num_zero == free, (
        f"pooled KV block leak over {len(engines)} engines: free {free} vs {num_zero} blocks "
        f"with ref 0 of num_gpu_blocks {total}; (block_id, ref_cnt, expected) mismatches: "
        f"{bad[:10]}")
    return {"free": free, "used": len(refs), "pinned": len(pins), "num_gpu_blocks": total}
