"""The token ids of a simulated session and their vLLM block hashes.

Mental model of the token ids of one session (a :class:`SessionTokenStream`, append-only)::

    stream : | header(16) + appended_0 | output_0 | appended_1 | output_1 | appended_2 | ...
    turn 0 : |<------- prompt -------->|<- out ->|
    turn 1 : |<------------------ prompt ------------------->|<- out ->|
    turn 2 : |<--------------------------- prompt ------------------------------>| ...

Turn k+1's prompt is turn k's prompt, its output ids and the observation ids, so vLLM's prefix
cache (and retained KV) can serve everything but the new observation. The first block of each
stream is unique to (seed, session id), so sessions never share a block by accident. The stream
also memoizes its block hashes, so a 60k-token turn hashes only its new blocks (vLLM's own hash
function and chaining; :class:`StreamBlockHasher`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

__all__ = ["SessionTokenStream", "StreamBlockHasher"]

_HEADER_TOKENS = 16
"""Leading tokens of a stream derived from (seed, session id): a unique first KV block."""
_TOKEN_ID_RANGE = 256
"""Token ids are drawn from ``0..255``: CPython caches these ints, so long prompts stay small."""


# ----------------------------------------------------------------------------- token ids
class SessionTokenStream:
    """The append-only token ids of one session and the memo of their block hashes.

    Args:
        session_id: the session (its first block is derived from it and ``seed``).
        seed: run seed; the same (seed, session id) always gives the same ids.
    """

    def __init__(self, session_id: str, seed: int) -> None:
        digest = hashlib.blake2b(f"{seed}/{session_id}".encode(), digest_size=16).digest()
        self.session_id = session_id
        self.token_ids: list[int] = list(digest[:_HEADER_TOKENS])
        self.block_hashes: list[Any] = []
        """vLLM block hashes of the stream's full blocks computed so far (a prefix)."""
        self._rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        self._num_pending_header = _HEADER_TOKENS

    def __len__(self) -> int:
        return len(self.token_ids) - self._num_pending_header

    def append(self, num_tokens: int) -> tuple[int, int]:
        """Append ``num_tokens`` fresh ids (the first 16 of a stream are its header).

        Mutates the stream. Returns ``(start, end)`` of the new ids in :attr:`token_ids`.
        """
        start = len(self)
        take = min(self._num_pending_header, num_tokens)
        self._num_pending_header -= take
        rest = num_tokens - take
        if rest > 0:
            self.token_ids.extend(self._rng.integers(0, _TOKEN_ID_RANGE, rest, dtype=np.uint8)
                                  .tolist())
        return start, start + num_tokens

    def ids(self, start: int, end: int) -> list[int]:
        """A copy of ``token_ids[start:end]``.

        Raises:
            ValueError: the range is not inside the appended ids.
        """
        if not 0 <= start <= end <= len(self):
            raise ValueError(f"token range [{start}, {end}) is outside the {len(self)} ids of "
                             f"session {self.session_id!r}; append() them first")
        return self.token_ids[start:end]


class StreamBlockHasher:
    """vLLM's request block hasher with a per-session memo of the shared prefix.

    A request registered with :meth:`register` (its tokens are a prefix of a session stream) gets
    the stream's known hashes for free and vLLM computes only the rest; new full blocks extend the
    memo. Hashes are byte-identical to vLLM's (same function, same chaining).

    Args:
        block_size: tokens per block (vLLM's ``hash_block_size``).
        hash_algo: vLLM's ``prefix_caching_hash_algo``.
    """

    def __init__(self, block_size: int, hash_algo: str = "sha256") -> None:
        fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(fn)
        self.block_size = block_size
        self._inner = get_request_block_hasher(block_size, fn)
        self._streams: dict[str, tuple[SessionTokenStream, int]] = {}

    def register(self, request_id: str, stream: SessionTokenStream, end: int) -> None:
        """Declare that ``request_id``'s tokens will be ``stream.token_ids[:end]`` at most."""
        self._streams[request_id] = (stream, end)

    def forget(self, request_id: str) -> None:
        """Drop a finished request."""
        self._streams.pop(request_id, None)

    def __call__(self, request: Request) -> list[Any]:
        """vLLM hook: the hashes of ``request``'s new full blocks. Mutates the memo."""
        have = len(request.block_hashes)
        if (have + 1) * self.block_size > request.num_tokens:
            return []  # no new full block (the common case: most decode tokens)
        entry = self._streams.get(request.request_id)
        if entry is None:
            return self._inner(request)
        stream, end = entry
        known = stream.block_hashes
        num_full = min(request.num_tokens, end) // self.block_size
        reuse = known[have:num_full]
        if reuse:
            # vLLM's hasher starts after request.block_hashes: hand it the memoized ones first.
            request.block_hashes.extend(reuse)
            new = reuse + self._inner(request)
            del request.block_hashes[have:]
        else:
            new = self._inner(request)
        upto = min(have + len(new), num_full)
        if upto > len(known):
            # Every full block of this request up to `end` is a block of the stream.
            behind = request.block_hashes[len(known):have] if have > len(known) else []
            known.extend(behind + new[max(0, len(known) - have):upto - have])
        return new
