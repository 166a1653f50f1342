"""KV block accounting and its integrity check (tests, the simulator's end-of-run check).

A mixin of :class:`~.base.MarsBaseScheduler`: the fast ``(free, retained, used)`` count from the
retained pool's pins, and a full walk of every block's references that checks it.
"""

from __future__ import annotations

from mars_openhands.engine import seams

__all__ = ["KvIntegrity"]



class KvIntegrity:
    """Mixin of :class:`~.base.MarsBaseScheduler`: KV block counts and the leak check. Pure."""

    def kv_block_counts(self) -> tuple[int, int, int]:
        """(free, retained-only, used) blocks; used = referenced by at least one request.

        Excludes vLLM's null block, so ``free + retained + used == num_gpu_blocks - 1``.
        O(pinned blocks): a pinned block is retained-only when its ref count is just our pins;
        every other block with a reference is used. :meth:`assert_no_leaks` checks this against
        a full walk of the requests' blocks.
        """
        free = seams.blocks.num_free_blocks(self)
        retained_only = self.retained.retained_only_blocks(seams.blocks.num_blocks_referenced_once,
                                                           seams.blocks.block_ref_count)
        return free, retained_only, seams.blocks.num_gpu_blocks(self) - 1 - free - retained_only

    def assert_no_leaks(self) -> dict[str, int]:
        """Integrity check: every block's ref count equals request refs + our pins, and
        ``free + retained + used == num_gpu_blocks`` (counting vLLM's null block as used).

        Returns:
            The counts, for logging/tests.

        Raises:
            AssertionError: printing the numbers and the first mismatching blocks.
        """
        refs = seams.blocks.referenced_block_counts(self)
        pins = self.retained.pin_counts()
        bad = []
        num_zero = 0
        for b in seams.blocks.all_blocks(self):
            if b.is_null:
                continue
            expected = refs.get(b.block_id, 0) + pins.get(b.block_id, 0)
            if b.ref_cnt != expected:
                bad.append((b.block_id, b.ref_cnt, expected))
            num_zero += b.ref_cnt == 0
        free, retained_only, used = self.kv_block_counts()
        pinned = {b.block_id for e in self.retained.values() for b in e.blocks}
        exact = (num_zero, sum(1 for bid in pinned if bid not in refs), len(refs))
        total = seams.blocks.num_gpu_blocks(self)
        counts = {"free": free, "retained": retained_only, "used": used, "null": 1,
                  "num_gpu_blocks": total}
        assert not bad and (free, retained_only, used) == exact and free + retained_only + used + 1 == total, (
            f"KV block leak: free {free} + retained {retained_only} + used {used} + null 1 "
            f"!= num_gpu_blocks {total} (blocks with ref 0: {num_zero}); "
            f"(block_id, ref_cnt, expected) mismatches: {bad[:10]}; "
            f"fast (free, retained, used) {(free, retained_only, used)} vs full walk {exact}"
        )
        return counts
