"""A real vLLM scheduler driven in-process, with no model and no server (design.md §9).

The simulator (``eval/sim.py``) and tests build the *real* scheduler classes (stock vLLM
``Scheduler`` / ``AsyncScheduler`` or our plugins from :mod:`mars_openhands.engine`) over a fake
KV cache of ``num_gpu_blocks`` blocks, feed them ``Request`` objects with prefix-cache hashing, and
answer each ``schedule()`` with a synthetic ``ModelRunnerOutput``: every scheduled request that
has computed all its known tokens gets its next planned token ids, a request still in prefill gets
none (as vLLM's model runner does). Steps run one at a time (``schedule()`` then
``update_from_output()``), as vLLM does on CPU where async scheduling is off.

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

Coalesced decode (simulator speed): in a *steady decode* state (nothing waiting, every running
request decoding, nobody finishing early, room in KV; :meth:`InprocEngine.max_decode_run`),
``step(num_decode_tokens=k)`` hands vLLM ``k - 1`` draft tokens per request through its public
``update_draft_token_ids`` and then "accepts" them all: the real scheduler allocates KV for ``k``
tokens per request and advances each by ``k`` tokens in one call, exactly as in speculative
decoding. Over a steady run this gives the same KV state as ``k`` single steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import itertools
import logging
import operator
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from mars_openhands.engine import seams
from mars_openhands.engine.harness.tiny_model import write_tiny_model
from mars_openhands.engine.seams import fast_paths

__all__ = [
    "STOCK_SCHEDULERS",
    "EngineStepRecord",
    "InprocEngine",
    "InprocEngineParams",
    "SessionTokenStream",
    "StreamBlockHasher",
    "build_kv_cache_config",
    "build_scheduler",
    "build_vllm_config",
    "resolve_scheduler_cls",
]

STOCK_SCHEDULERS: dict[str, type[Scheduler]] = {
    "fcfs": AsyncScheduler,
    "fcfs-sync": Scheduler,
}
"""Stock vLLM schedulers by policy name (``fcfs`` = vLLM's default with async scheduling on)."""

_HEADER_TOKENS = 16
"""Leading tokens of a stream derived from (seed, session id): a unique first KV block."""
_TOKEN_ID_RANGE = 256
"""Token ids are drawn from ``0..255``: CPython caches these ints, so long prompts stay small."""


class InprocEngineParams(BaseModel):
    """Engine shape of an in-process scheduler. Frozen; unknown keys are an error.

    Defaults are vLLM's GPU defaults where vLLM has one (block size 16, 256 sequences, 8192
    batched tokens, prefix caching and chunked prefill on).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    num_gpu_blocks: int = Field(ge=2)
    """KV blocks of the pool, including vLLM's null block (e.g. a GPU profile's capacity)."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV block."""
    max_num_seqs: int = Field(256, ge=1)
    """vLLM ``--max-num-seqs``: running-request cap."""
    max_num_batched_tokens: int = Field(8192, ge=1)
    """vLLM ``--max-num-batched-tokens``: token budget of one step."""
    max_model_len: int = Field(131072, ge=16)
    """vLLM ``--max-model-len``: longest prompt + output, tokens."""
    long_prefill_token_threshold: int = Field(0, ge=0)
    """vLLM's per-request prefill chunk cap, tokens (0 = off)."""
    enable_prefix_caching: bool = True
    """vLLM ``--enable-prefix-caching``."""
    prefix_caching_hash_algo: str = "sha256"
    """vLLM ``--prefix-caching-hash-algo`` (the block hash function)."""
    additional_config: dict[str, Any] = Field(default_factory=dict)
    """vLLM ``--additional-config`` (our schedulers read ``additional_config["mars"]``)."""


# ----------------------------------------------------------------------------- building
def resolve_scheduler_cls(policy: str) -> type[Scheduler]:
    """Scheduler class for a policy name.

    Args:
        policy: ``"fcfs"`` (stock ``AsyncScheduler``), ``"fcfs-sync"`` (stock ``Scheduler``), a
            class exported by :mod:`mars_openhands.engine` (e.g. ``"MarsScheduler"``), or a
            ``"package.module:Class"`` / ``"package.module.Class"`` path.

    Raises:
        ValueError: unknown name (the message lists the known ones) or not a vLLM scheduler.
    """
    if policy in STOCK_SCHEDULERS:
        return STOCK_SCHEDULERS[policy]
    from mars_openhands import engine

    exported = sorted(getattr(engine, "_LAZY", {}))
    cls: Any = None
    if policy in exported:
        cls = getattr(engine, policy)
    elif ":" in policy or "." in policy:
        module_name, sep, attr = policy.partition(":") if ":" in policy else policy.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load scheduler class {policy!r}: {e}") from None
    if cls is None:
        raise ValueError(
            f"unknown scheduler policy {policy!r}; expected one of "
            f"{sorted(STOCK_SCHEDULERS) + exported} or a 'module:Class' path"
        )
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ValueError(f"{policy!r} resolves to {cls!r}, which is not a vLLM Scheduler subclass")
    return cls


def _model_dir(params: InprocEngineParams, root: Path | None) -> Path:
    """Write (once per folder) a tiny Llama model dir whose context covers ``max_model_len``."""
    base = root if root is not None else Path(tempfile.gettempdir()) / "mars_openhands_inproc"
    folder = base / f"tiny-{params.max_model_len}"
    if not (folder / "config.json").exists():
        write_tiny_model(folder, max_position_embeddings=params.max_model_len)
    return folder


def build_vllm_config(params: InprocEngineParams, model_dir: Path | None = None) -> VllmConfig:
    """A ``VllmConfig`` over a tiny local model (no tokenizer, no weights, no download).

    Takes ~1 s the first time in a process (vLLM's platform setup), ~20 ms after.

    Args:
        params: the engine shape.
        model_dir: a folder with a ``config.json``; ``None`` writes a tiny one under the temp dir.
    """
    folder = model_dir if model_dir is not None else _model_dir(params, None)
    _quiet_cpu_block_size_warning()
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True,
                        max_model_len=params.max_model_len, dtype="float32")
    sched = SchedulerConfig(
        max_num_seqs=params.max_num_seqs, max_num_batched_tokens=params.max_num_batched_tokens,
        max_model_len=params.max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
        long_prefill_token_threshold=params.long_prefill_token_threshold,
    )
    cache = CacheConfig(block_size=params.block_size,
                        enable_prefix_caching=params.enable_prefix_caching,
                        prefix_caching_hash_algo=params.prefix_caching_hash_algo)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                        additional_config=dict(params.additional_config))
    config.cache_config.num_gpu_blocks = params.num_gpu_blocks
    return config


def _drop_block_size_advice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("CPU backend prefers block_size")


def _quiet_cpu_block_size_warning() -> None:
    """Drop vLLM's "CPU backend prefers block_size is multiples of 32" warning in this process.

    It is kernel-performance advice, and no kernel runs here; the simulator uses the emulated
    GPU's block size (16) on purpose, and the warning repeats once per engine built (18 lines in a
    two-policy fidelity run).
    """
    cpu_logger = logging.getLogger("vllm.platforms.cpu")
    if _drop_block_size_advice not in cpu_logger.filters:
        cpu_logger.addFilter(_drop_block_size_advice)


def build_kv_cache_config(params: InprocEngineParams) -> KVCacheConfig:
    """One full-attention KV group of ``num_gpu_blocks`` blocks (the bytes are never allocated).

    The layer geometry is irrelevant to the scheduler (it only counts blocks), so one small layer
    stands for the model.
    """
    spec = FullAttentionSpec(block_size=params.block_size, num_kv_heads=1, head_size=16,
                             dtype=torch.float32)
    page = spec.page_size_bytes
    size = page * params.num_gpu_blocks
    return KVCacheConfig(
        num_blocks=params.num_gpu_blocks,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=["layer.0"], layer_stride=size,
                                        block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )


def build_scheduler(
    scheduler_cls: type[Scheduler], params: InprocEngineParams, model_dir: Path | None = None
) -> Scheduler:
    """Construct ``scheduler_cls`` the way vLLM's ``EngineCore`` does (``log_stats=False``).

    Raises:
        ValueError: from our schedulers, on an invalid ``additional_config["mars"]``.
    """
    vllm_config = build_vllm_config(params, model_dir)
    return scheduler_cls(
        vllm_config=vllm_config, kv_cache_config=build_kv_cache_config(params),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=params.block_size, hash_block_size=params.block_size, log_stats=False,
    )


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


_BLOCK_HASH = operator.attrgetter("block_hash")
_MEMO_AT_LOOKUP = 2
"""A request's lookup (in one state) at which :class:`PrefixHitMemo` builds its memo."""
_HASH_KEY_SESSIONS = 32
"""Sessions whose waiting heads' pool keys ``InprocEngine`` keeps (the least recent goes)."""


class PrefixHitMemo:
    """Exact memo of vLLM's prefix-cache lookup (``KVCacheManager.get_computed_blocks``).

    A lookup walks the request's block hashes until the first one the cache misses: O(context
    blocks), ~5,000 for a 78k-token turn, repeated every step a request waits for KV and once
    more by our schedulers at arrival. Its answer is a function of the request (its token count
    and hashes) and of the cache entries for the keys it read: the hit blocks' keys and the
    first missed key. The pool's map reports every insert and pop
    (:func:`fast_paths.watch_prefix_cache`): a pop that leaves no block under hit ``j``'s key cuts the
    memo to its first ``j`` blocks (the walk now stops there), any other change to a key a memo
    read drops the memo. So a memo that is still there is what the walk would return now. A memo
    is built at a request's second lookup in the same state: building and dropping one costs about
    two walks, most requests are looked up once before their KV is allocated, and one waiting for
    KV is looked up every step. Our schedulers' look at arrival (:meth:`peek`) does not count.
    Installed on one scheduler's KV cache manager (an instance attribute, as our
    ``allocate_slots`` wrapper).

    Args:
        sched: the scheduler (one KV cache group with full attention).
    """

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._memo: dict[str, tuple[int, int, tuple[list[Any], ...], int, int, list[Any],
                                    dict[Any, int], int]] = {}
        """request id -> (num_tokens, len(block_hashes), blocks, hit tokens, boundary, keys,
        key -> its first index in the keys: ``keys.index`` in O(1), hit blocks ``h``). A cut
        leaves the lists as they were: the hit is ``blocks[0][:h]``, the keys read ``keys[:h + 1]``
        (a cut per evicted block, tail first, would copy O(context) each time)."""
        self._reader: dict[Any, str] = {}
        """pool key -> the request whose memo read it."""
        self._looked_up: dict[str, tuple[int, int, int]] = {}
        """request id -> (num_tokens, len(block_hashes), lookups in that state) while it has no
        memo."""
        self._map = fast_paths.watch_prefix_cache(sched, self._on_change, self._reader)
        self._inner: Callable[[Request], tuple[Any, int, int]] = fast_paths.install_prefix_lookup(
            sched, self)
        """vLLM's own lookup (a memo miss)."""
        self._block_size = sched.block_size
        self.num_hits = 0

    def _on_change(self, key: Any, is_gone: bool) -> None:
        rid = self._reader.get(key)
        if rid is None:
            return
        memo = self._memo.get(rid)
        hit = memo[7] if memo is not None else 0
        # The reader maps only keys still in this memo's (maybe cut) keys to it.
        j = memo[6][key] if is_gone and memo is not None and memo[4] == 0 else hit
        if j >= hit:  # an insert, a duplicate left, or the missed key: the walk may go further
            del self._reader[key]
            self.forget(rid)
            if memo is not None:  # a memo again at its next lookup
                self._looked_up[rid] = (memo[0], memo[1], _MEMO_AT_LOOKUP - 1)
            return
        # Hit block j left the cache and no other block has its key: the walk now stops at j
        # (blocks 0..j-1 are untouched, or their own change would have come first).
        for dropped in memo[5][j + 1:hit + 1]:  # the keys read past j (islice would walk from 0)
            if self._reader.get(dropped) == rid:
                del self._reader[dropped]
        self._memo[rid] = (*memo[:3], j * self._block_size, 0, memo[5], memo[6], j)

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s memo (a finished request). Mutates."""
        self._looked_up.pop(request_id, None)
        memo = self._memo.pop(request_id, None)
        if memo is not None:
            for key in itertools.islice(memo[5], memo[7] + 1):
                if self._reader.get(key) == request_id:
                    del self._reader[key]

    def _check_map(self) -> None:
        """After ``reset_prefix_cache`` (a new, unwatched map): drop every memo, watch the new map."""
        if fast_paths.prefix_cache_map(self._sched) is not self._map:
            for rid in list(self._memo):
                self.forget(rid)
            self._looked_up.clear()
            self._map = fast_paths.watch_prefix_cache(self._sched, self._on_change, self._reader)

    def _valid_memo(self, request: Request) -> tuple[Any, ...] | None:
        """``request``'s memo if it is for the request's current state (token count and block
        hashes) and the current map, else None."""
        self._check_map()
        memo = self._memo.get(request.request_id)
        if memo is not None and memo[0] == request.num_tokens and memo[1] == len(request.block_hashes):
            return memo
        return None

    def peek(self, request: Request) -> int:
        """Tokens the prefix cache would serve ``request`` now (:func:`seams.blocks.prefix_hit_tokens`),
        from the memo when it is still valid; a walk does not count toward the memo."""
        memo = self._valid_memo(request)
        return memo[3] if memo is not None else self._inner(request)[1]

    def __call__(self, request: Request) -> tuple[Any, int, int]:
        """vLLM's ``get_computed_blocks(request)``, from the memo when it is still valid."""
        memo = self._valid_memo(request)
        if memo is not None:
            self.num_hits += 1
            hit = memo[7]
            return (fast_paths.new_kv_cache_blocks(self._sched, tuple(g[:hit] for g in memo[2])),
                    memo[3], memo[4])
        rid = request.request_id
        state = (request.num_tokens, len(request.block_hashes))
        seen = self._looked_up.get(rid)
        num_lookups = seen[2] + 1 if seen is not None and seen[:2] == state else 1
        self.forget(rid)
        blocks, num_tokens, boundary = self._inner(request)
        if num_lookups < _MEMO_AT_LOOKUP:
            self._looked_up[rid] = (*state, num_lookups)
            return blocks, num_tokens, boundary
        groups = tuple(list(g) for g in blocks.blocks)
        if len(groups) != 1:
            return blocks, num_tokens, boundary  # not a plain full-attention hit: no memo
        keys = list(map(_BLOCK_HASH, groups[0]))
        hit = len(keys)
        if hit < len(request.block_hashes):
            keys.append(fast_paths.pool_block_hash_key(request.block_hashes[hit]))
        if None in keys:
            return blocks, num_tokens, boundary
        # key -> its first index (assigned last-to-first, so the first occurrence wins)
        positions = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))
        self._memo[rid] = (request.num_tokens, len(request.block_hashes), groups, num_tokens,
                           boundary, keys, positions, hit)
        self._reader.update(dict.fromkeys(keys, rid))
        return blocks, num_tokens, boundary


# ----------------------------------------------------------------------------- the engine
@dataclass
class EngineStepRecord:
    """What one :meth:`InprocEngine.step` did.

    Attributes:
        scheduler_output: vLLM's ``SchedulerOutput``.
        num_scheduled_tokens: request id -> tokens scheduled this step.
        prefill: ``(new_tokens, cached_tokens)`` per request running a prefill chunk.
        decode_context_tokens: context length (tokens attended, incl. the new one) per decoding
            request at the first of the step's ``num_decode_tokens`` decode positions.
        num_decode_tokens: tokens each decoding request advanced (``k`` of a coalesced step).
        new_request_cached_tokens: request id -> prefix-cache hit tokens, for requests scheduled
            for the first time (or resumed) in this step.
        preempted_ids: requests vLLM preempted in this step.
        outputs: ``(request_id, num_new_tokens, finish_reason or None)`` from update_from_output.
        sampled_token_ids: the synthetic model output, one list per scheduled request.
    """

    scheduler_output: Any
    num_scheduled_tokens: dict[str, int]
    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode_context_tokens: list[int] = field(default_factory=list)
    num_decode_tokens: int = 1
    new_request_cached_tokens: dict[str, int] = field(default_factory=dict)
    preempted_ids: set[str] = field(default_factory=set)
    outputs: list[tuple[str, int, str | None]] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.num_scheduled_tokens

    @property
    def finished_ids(self) -> list[str]:
        """Requests that finished in this step."""
        return [rid for rid, _, reason in self.outputs if reason is not None]


class InprocEngine:
    """One real vLLM scheduler plus the synthetic model runner around it.

    Args:
        policy: scheduler class or policy name (:func:`resolve_scheduler_cls`).
        params: the engine shape.
        seed: seeds the token ids of session streams.
        clock: virtual clock (seconds) for our schedulers (``scheduler.clock``); stock vLLM
            reads no clock that matters with ``log_stats=False`` (request arrival times are set
            by the caller).
        model_dir: tiny model folder (default: written under the temp dir).
        memoize_prefix_hits: install a :class:`PrefixHitMemo`, the fused block allocation
            (:func:`fast_paths.install_fused_block_allocation`), the batched token append
            (:func:`fast_paths.install_batched_token_append`) and the fused prefix lookup
            (:func:`fast_paths.install_fused_prefix_lookup`): exact; the simulator's speed.
    """

    def __init__(
        self, policy: str | type[Scheduler], params: InprocEngineParams, *, seed: int = 0,
        clock: Callable[[], float] | None = None, model_dir: Path | None = None,
        memoize_prefix_hits: bool = False,
    ) -> None:
        cls = resolve_scheduler_cls(policy) if isinstance(policy, str) else policy
        self.params = params
        self.seed = seed
        self.scheduler = build_scheduler(cls, params, model_dir)
        if clock is not None:
            self.set_clock(clock)
        self.hasher = StreamBlockHasher(params.block_size, params.prefix_caching_hash_algo)
        self.prefix_memo = (PrefixHitMemo(self.scheduler)
                            if memoize_prefix_hits and params.enable_prefix_caching else None)
        if memoize_prefix_hits:
            fast_paths.install_fused_block_allocation(self.scheduler)
            fast_paths.install_batched_token_append(self.scheduler)
            fast_paths.install_fused_prefix_lookup(self.scheduler)
        self._planned: dict[str, list[int]] = {}
        self._requests: dict[str, Request] = {}
        self._kv_counts: tuple[int, int, int] | None = None
        """Memo of :meth:`kv_block_counts`; cleared by every call that can change the KV state."""
        self._is_waiting_blocked = False
        self._probe_num_tokens = 0
        """Tokens the probe step scheduled: its waiting queue saw the budget less these."""
        """The last probe (see :meth:`max_blocked_decode_run`) left every waiting request
        unscheduled, and nothing that could change that has happened since."""
        self._hash_keys: dict[str, tuple[int, Any, dict[Any, int]]] = {}
        """session id -> (len(block_hashes), the last hash, pool key of each full block -> its
        index) of its last waiting head looked at; the last ``_HASH_KEY_SESSIONS`` sessions."""
        self.num_steps = 0
        """``schedule()`` calls so far."""
        self.num_decode_substeps = 0
        """Engine steps represented so far (a coalesced step of ``k`` tokens counts ``k``)."""
        self.num_prefill_runs = 0
        """Merged chunked-prefill runs so far (:meth:`max_prefill_run`; the simulator's speed)."""
        self._probe_has_prefill = False  # our schedulers: the last probe step held a prefill chunk

    # ------------------------------------------------------------------ plumbing
    def set_clock(self, clock: Callable[[], float]) -> None:
        """Point our scheduler's clock at ``clock`` (no-op for stock vLLM). Mutates."""
        if hasattr(self.scheduler, "clock"):
            self.scheduler.clock = clock

    @property
    def is_plugin(self) -> bool:
        """True for our schedulers (they have telemetry, a clock and a CPU-event inbox)."""
        return hasattr(self.scheduler, "post_event")

    def stream(self, session_id: str) -> SessionTokenStream:
        """A new token stream for ``session_id`` (seeded by the engine's seed)."""
        return SessionTokenStream(session_id, self.seed)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, stream: SessionTokenStream, prompt_end: int, num_output_tokens: int,
        *, arrival_time_s: float, session_id: str | None = None,
        extra_args: dict[str, Any] | None = None,
    ) -> Request:
        """Add one turn: prompt ``stream[:prompt_end]``, output ``stream[prompt_end:+n]``.

        The output ids must already be appended to ``stream``. Mutates the scheduler.

        Args:
            request_id: unique id.
            stream: the session's token stream.
            prompt_end: prompt length in tokens (>= 1).
            num_output_tokens: ``max_tokens`` (>= 1); generation ignores EOS.
            arrival_time_s: ``Request.arrival_time`` (the caller's clock, seconds).
            session_id: vLLM's native ``Request.session_id`` (default: the stream's).
            extra_args: ``SamplingParams.extra_args`` (the gateway's ``vllm_xargs``).

        Raises:
            ValueError: bad lengths, or the output ids are not in the stream yet.
        """
        if prompt_end < 1 or num_output_tokens < 1:
            raise ValueError(f"request {request_id!r} needs prompt >= 1 and output >= 1 tokens, "
                             f"got {prompt_end} and {num_output_tokens}")
        end = prompt_end + num_output_tokens
        self._planned[request_id] = stream.ids(prompt_end, end)
        sampling = SamplingParams(max_tokens=num_output_tokens, ignore_eos=True)
        sampling.extra_args = dict(extra_args) if extra_args else None
        self.hasher.register(request_id, stream, end)
        request = Request(request_id, stream.ids(0, prompt_end), sampling, None,
                          arrival_time=arrival_time_s, block_hasher=self.hasher,
                          session_id=session_id if session_id is not None else stream.session_id)
        # Per-request prefill stats feed only the API's usage/metrics output, which nothing reads
        # here; vLLM computes them at the first output with an O(context blocks) walk.
        request.prefill_stats = None
        self._requests[request_id] = request
        waiting = self.scheduler.waiting
        head = waiting.peek_request() if waiting else None
        self.scheduler.add_request(request)
        self._kv_counts = None
        if self.is_plugin or head is None or waiting.peek_request() is not head:
            # Stock vLLM queues it behind a blocked head, which stays blocked; our schedulers
            # may reorder or admit on arrival.
            self._is_waiting_blocked = False
        return request

    def has_work(self) -> bool:
        """True while the scheduler holds an unfinished request."""
        return self.scheduler.has_unfinished_requests()

    def request(self, request_id: str) -> Request | None:
        """A live request by id (``None`` once finished)."""
        return self._requests.get(request_id)

    # ------------------------------------------------------------------ stepping
    def step(self, num_decode_tokens: int = 1) -> EngineStepRecord:
        """One engine step: :meth:`schedule` then :meth:`update` (no time passes in between).

        Raises:
            ValueError: as :meth:`schedule`.
        """
        return self.update(self.schedule(num_decode_tokens))

    def schedule(self, num_decode_tokens: int = 1, *, hide_waiting: bool = False,
                 prefill_run: bool = False, last_step_s: float | None = None) -> EngineStepRecord:
        """``schedule()`` and the synthetic model output for it (not yet applied).

        Args:
            num_decode_tokens: tokens each decoding request advances (``k``); ``k > 1`` only in a
                steady decode state (see :meth:`max_decode_run`), via vLLM's draft-token path.
            hide_waiting: a blocked decode run (:meth:`max_blocked_decode_run`): the scheduler
                runs with an empty waiting queue, as each of the ``k`` single steps would leave
                every waiting request unscheduled.
            prefill_run: a chunked-prefill run of ``k`` steps (:meth:`max_prefill_run`): each
                capped prefill gets ``k`` chunks and each decode ``k`` tokens in one call.
            last_step_s: with ``hide_waiting``, the scheduler-clock start of the run's last
                single step (our schedulers stamp per-step clocks with it: ``run_last_step_s``;
                a blocked chunked-prefill run too).

        Returns:
            The step's record (``is_empty`` when nothing was scheduled); pass it to
            :meth:`update` once the step's (virtual) time has passed.

        Raises:
            ValueError: ``num_decode_tokens`` > 1 outside a steady decode state, or
                ``hide_waiting`` (``prefill_run``) outside a blocked decode run (a chunked-prefill
                run) of that length.
        """
        if prefill_run:
            out = self._schedule_prefill_run(num_decode_tokens, hide_waiting, last_step_s)
        elif hide_waiting:
            out = self._schedule_hiding_waiting(num_decode_tokens, last_step_s)
        else:
            if num_decode_tokens > 1:
                self._propose_drafts(num_decode_tokens, self.max_decode_run(num_decode_tokens))
            out = self.scheduler.schedule()
        self._kv_counts = None
        self.num_steps += 1
        record = EngineStepRecord(out, dict(out.num_scheduled_tokens),
                                  num_decode_tokens=num_decode_tokens,
                                  preempted_ids=set(out.preempted_req_ids or ()))
        for new in out.scheduled_new_reqs:
            record.new_request_cached_tokens[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            if rid in cached.resumed_req_ids:
                record.new_request_cached_tokens[rid] = num_computed
        record.sampled_token_ids = [self._sample(rid, out, record) for rid in out.num_scheduled_tokens]
        if record.num_scheduled_tokens:
            self.num_decode_substeps += (num_decode_tokens if prefill_run or not record.prefill
                                         else 1)
        if not hide_waiting:
            self._is_waiting_blocked = self._is_blocked_probe(record)
        return record

    def _is_blocked_probe(self, record: EngineStepRecord) -> bool:
        """Whether this single step proves the waiting requests blocked (see
        :meth:`max_blocked_decode_run`): requests wait, every running request was scheduled (so
        vLLM looked at the waiting queue with what the step's budget had left, remembered in
        ``_probe_num_tokens``), and none was admitted, resumed or preempted. With stock vLLM the
        step may hold prefill chunks (:meth:`max_blocked_prefill_run`); with our schedulers only
        if the class certifies merged prefill runs (``coalescible_prefill_runs``; such a probe
        starts no blocked decode run), else every scheduled request decoded one token."""
        s = self.scheduler
        if (record.num_decode_tokens != 1 or not s.waiting
                or record.preempted_ids or record.new_request_cached_tokens
                or fast_paths.is_kv_holding_waiting(s)
                or len(record.num_scheduled_tokens) != len(s.running)):
            return False
        if self.is_plugin:
            self._probe_has_prefill = bool(record.prefill) or any(
                n != 1 for n in record.num_scheduled_tokens.values())
            if self._probe_has_prefill and not s.coalescible_prefill_runs:
                return False
        self._probe_num_tokens = sum(record.num_scheduled_tokens.values())
        return True

    def _schedule_hiding_waiting(self, k: int, last_step_s: float | None) -> Any:
        """One ``schedule()`` of a blocked decode run of ``k`` tokens, the waiting queue hidden."""
        s = self.scheduler
        limit = self.max_blocked_decode_run(k)
        if limit < k:
            raise ValueError(f"hide_waiting with num_decode_tokens={k} but the engine allows a "
                             f"blocked decode run of at most {limit}; call max_blocked_decode_run()")
        if k > 1:
            self._propose_drafts(k, limit)
        with self._waiting_hidden(1, last_step_s):
            return s.schedule()

    @contextlib.contextmanager
    def _waiting_hidden(self, num_steps: int, last_step_s: float | None) -> Iterator[None]:
        """While open, the scheduler sees an empty waiting queue (a merged blocked run: every
        waiting request stays blocked in each step it stands for); our schedulers also get the
        run's step count (``run_num_steps``), its last step's start (``run_last_step_s``) and
        ``is_waiting_hidden``. Everything is restored on exit, even on error."""
        s = self.scheduler
        if self.is_plugin:
            s.run_num_steps, s.run_last_step_s, s.is_waiting_hidden = num_steps, last_step_s, True
        try:
            with fast_paths.hidden_waiting(s):
                yield
        finally:
            if self.is_plugin:
                s.run_num_steps, s.run_last_step_s, s.is_waiting_hidden = 1, None, False

    def _schedule_prefill_run(self, k: int, hide_waiting: bool, last_step_s: float | None = None) -> Any:
        """One ``schedule()`` standing for ``k`` chunked-prefill steps (:meth:`max_prefill_run`;
        ``hide_waiting``: :meth:`max_blocked_prefill_run`; ``last_step_s``: see :meth:`schedule`)."""
        limit = self.max_blocked_prefill_run(k) if hide_waiting else self.max_prefill_run(k)
        if limit < k:
            raise ValueError(f"prefill_run with num_decode_tokens={k} but the engine allows a "
                             f"chunked-prefill run of at most {limit}; call max_prefill_run() "
                             "or max_blocked_prefill_run()")
        s = self.scheduler
        req_ids, drafts = [], []
        for request in s.running:
            if request.num_computed_tokens == request.num_tokens - 1:  # decoding
                index = request.num_output_tokens
                req_ids.append(request.request_id)
                drafts.append(list(self._planned[request.request_id][index:index + k - 1]))
        s.update_draft_token_ids(DraftTokenIds(req_ids, drafts))
        self.num_prefill_runs += 1
        budget = k * sum(self.run_step_tokens())
        if not hide_waiting:
            with fast_paths.scaled_step_budget(s, k, budget):
                return s.schedule()
        with self._waiting_hidden(k, last_step_s), fast_paths.scaled_step_budget(s, k, budget):
            return s.schedule()

    def max_prefill_run(self, limit: int) -> int:
        """Largest ``k <= limit`` for which one ``schedule()`` with the step's token budget and
        vLLM's long-prefill chunk cap ``T`` scaled by ``k`` (:func:`fast_paths.scaled_step_budget`)
        equals ``k`` single steps, else 1. Pure.

        Mental model: vllm-tuned (``long_prefill_token_threshold`` 512) re-prefills a 60k-token
        context in ~120 steps of one 512-token chunk beside the decodes. While nothing waits,
        every step schedules the running requests in their order, each capped prefill gets ``T``
        tokens (its remainder is larger than ``T``) and each decode one token, within the budget,
        and nobody is preempted if the ``k`` steps' new blocks fit in the free blocks (no block
        is freed inside the run: nobody finishes before its last step, and the free blocks only
        shrink). So the same requests get the same tokens in every step, and a run's end state
        equals ``k`` steps' (the blocks taken are the same first ones of the free queue, in
        another order among the requests: no decision reads block ids). Stock vLLM only (our
        schedulers: :meth:`max_blocked_prefill_run`), async scheduling only.

        Region diagram of one prefilling request (``c`` computed tokens, cap ``T``)::

            | computed c | k chunks of T (this run) | rest > 0 |
            |<-------------------- num_tokens --------------------->|
        """
        s = self.scheduler
        if self.is_plugin or s.waiting or fast_paths.is_kv_holding_waiting(s):
            return 1
        return self._prefill_run_len(limit, self.run_step_tokens())

    def max_blocked_prefill_run(self, limit: int, within: Callable[[int], int] | None = None) -> int:
        """:meth:`max_prefill_run` while requests wait for KV: largest ``k <= limit`` for which
        one ``schedule()`` with the waiting queue hidden and the budget scaled by ``k`` equals
        ``k`` single steps, else 1. Pure.

        The probe (:meth:`max_blocked_decode_run`) was a single step that scheduled every
        running request, left every waiting one waiting and scheduled as many tokens as each
        step of the run does (the same requests, the same chunks): so vLLM asks the waiting head
        with the same budget left in every step and fewer free blocks, which leave it blocked
        (:meth:`_keep_head_blocked`).

        Our schedulers: a class that certifies its hooks (``coalescible_prefill_runs``: Autellix,
        the MARS preview) gives each running prefill's chunk (``prefill_run_chunk_tokens``: the same in
        every step), its own per-step decisions are bounded as in a blocked decode run
        (``blocked_run_is_safe``, ``blocked_run_max_tokens`` with the step's tokens, and the
        simulator's ``blocked_run_until_s``), no decode finishes inside the run, and the chunk
        hook scales each chunk by ``k`` (``run_num_steps``). ``within``: as in
        :meth:`max_blocked_decode_run`.
        """
        s = self.scheduler
        if (limit <= 1 or not self._is_waiting_blocked or not s.waiting or fast_paths.is_kv_holding_waiting(s)
                or (not self.is_plugin and self.params.long_prefill_token_threshold <= 0)):
            return 1
        if self.is_plugin and not (s.coalescible_prefill_runs and s.blocked_run_is_safe()):
            return 1
        steps = self.run_step_tokens()
        k = self._prefill_run_len(limit, steps)
        if k <= 1 or self._probe_num_tokens != sum(steps):
            return 1
        if self.is_plugin:
            k = s.blocked_run_max_tokens(k, step_tokens=self._probe_num_tokens)
        if within is not None and k > 1:
            k = within(k)
        if k <= 1:
            return 1
        return self._keep_head_blocked(k, lambda k_: self._prefill_run_new_blocks(k_, steps))

    @staticmethod
    def _is_decoding(r: Request) -> bool:
        c = r.num_computed_tokens
        return c == r.num_tokens - 1 and c >= r.num_prompt_tokens

    def _run_step_tokens(self, r: Request) -> int:
        """Tokens the running ``r`` takes in each step of a chunked-prefill run: 1 if decoding,
        else its prefill chunk (stock vLLM: the long-prefill cap; our schedulers:
        ``prefill_run_chunk_tokens``, 0 when the chunk may change after a step). Pure."""
        if self._is_decoding(r):
            return 1
        if self.is_plugin:
            return self.scheduler.prefill_run_chunk_tokens(r) or 0
        return self.params.long_prefill_token_threshold

    def run_step_tokens(self) -> list[int]:
        """Tokens each running request takes per step of a merged run (1 if decoding, else its
        prefill chunk, 0 when the chunk may change after a step), in the running order. Pure."""
        return [self._run_step_tokens(r) for r in self.scheduler.running]

    def _prefill_run_len(self, limit: int, steps: Sequence[int]) -> int:
        """:meth:`max_prefill_run` without its empty-waiting condition (``steps``:
        :meth:`run_step_tokens`). Pure."""
        s = self.scheduler
        if (limit <= 1 or not isinstance(s, AsyncScheduler)
                or len(s.running) + len(s.waiting) < 2):
            return 1
        # Our schedulers decide on a finish: a decode's last token takes a single step.
        keep_last = int(self.is_plugin)
        k, num_prefill, total = limit, 0, 0
        for r, n in zip(s.running, steps, strict=True):
            c = r.num_computed_tokens
            if r.num_output_placeholders or r.spec_token_ids or r.request_id not in self._planned:
                return 1
            total += n
            if self._is_decoding(r):
                k = min(k, r.max_tokens - r.num_output_tokens - keep_last,
                        self.params.max_model_len - c - 1 - keep_last)
            elif n > 0 and r.num_tokens - c > n:
                num_prefill += 1
                k = min(k, (r.num_tokens - c - 1) // n)  # k chunks leave >= 1 token to prefill
            else:
                return 1
        if num_prefill == 0 or total > min(
                self.params.max_num_batched_tokens, seams.hooks.max_num_scheduled_tokens(s)):
            return 1
        while k > 1 and self._prefill_run_new_blocks(k, steps) > seams.blocks.num_free_blocks(s):
            k //= 2
        return max(1, k)

    def _prefill_run_new_blocks(self, k: int, steps: Sequence[int]) -> int:
        """New KV blocks the running requests take over ``k`` steps of ``steps`` tokens each
        (:meth:`run_step_tokens`). Pure."""
        bs = self.params.block_size
        total = 0
        for r, n in zip(self.scheduler.running, steps, strict=True):
            total += max(0, -(-(r.num_computed_tokens + k * n) // bs)
                         - seams.blocks.num_block_table_entries(self.scheduler, r.request_id))
        return total

    def prefill_run_shapes(self, k: int) -> Iterator[tuple[list[tuple[int, int]], list[int]]]:
        """The step-time model's input of each of the ``k`` single steps a chunked-prefill run
        stands for: ``(prefill (new, cached) chunks, decode contexts)`` in the running order, as
        :meth:`schedule` would record them step by step (lazily). Pure."""
        steps = list(zip(self.scheduler.running, self.run_step_tokens(), strict=True))
        for i in range(k):
            prefill: list[tuple[int, int]] = []
            decode: list[int] = []
            for r, n in steps:
                before = r.num_computed_tokens + i * n
                if before >= r.num_prompt_tokens:
                    decode.append(before + 1)
                else:
                    prefill.append((n, before))
            yield prefill, decode

    def update(self, record: EngineStepRecord) -> EngineStepRecord:
        """Apply the step's synthetic model output (``update_from_output``). Mutates ``record``.

        Returns:
            ``record`` with :attr:`EngineStepRecord.outputs` filled.
        """
        req_ids = list(record.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=record.sampled_token_ids,
        )
        engine_outputs = self.scheduler.update_from_output(record.scheduler_output, runner_output)
        self._kv_counts = None
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                reason = None if o.finish_reason is None else str(o.finish_reason)
                record.outputs.append((o.request_id, len(o.new_token_ids), reason))
                if reason is not None:
                    self._forget(o.request_id)
                    self._is_waiting_blocked = False  # its blocks are free now
        return record

    def _sample(self, rid: str, out: Any, record: EngineStepRecord) -> list[int]:
        """Classify ``rid`` for the step-time model and return its sampled ids (maybe none)."""
        request = self.scheduler.requests[rid]
        num_new = out.num_scheduled_tokens[rid]
        spec = out.scheduled_spec_decode_tokens.get(rid, ())
        before = request.num_computed_tokens - num_new
        if before >= request.num_prompt_tokens:
            record.decode_context_tokens.append(before + 1)
        else:
            record.prefill.append((num_new, before))
        if request.num_computed_tokens < request.num_tokens:
            return []  # still in prefill after this chunk: the model runner samples nothing
        index = request.num_output_tokens
        planned = self._planned.get(rid, ())
        ids = list(planned[index:index + 1 + len(spec)])
        return ids + [0] * (1 + len(spec) - len(ids))

    def _propose_drafts(self, k: int, limit: int) -> None:
        """Give each running request its next ``k - 1`` planned ids as draft tokens (``limit``:
        the longest run the engine allows now)."""
        if limit < k:
            raise ValueError(f"num_decode_tokens={k} but the engine allows at most {limit} "
                             "coalesced decode tokens now; call max_decode_run() first")
        req_ids, drafts = [], []
        for request in self.scheduler.running:
            index = request.num_output_tokens
            req_ids.append(request.request_id)
            drafts.append(list(self._planned[request.request_id][index:index + k - 1]))
        self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def _forget(self, request_id: str) -> None:
        self._planned.pop(request_id, None)
        self._requests.pop(request_id, None)
        self.hasher.forget(request_id)
        if self.prefix_memo is not None:
            self.prefix_memo.forget(request_id)

    def max_decode_run(self, limit: int) -> int:
        """Largest ``k <= limit`` for which a coalesced step equals ``k`` single steps. Pure.

        Requires a steady decode state: nothing waiting, every running request decoding with
        exactly its last sampled token pending, none finishing before its ``k``-th token (with
        the sync ``Scheduler``: none finishing within the run, see the code comment), and
        enough free KV blocks and token budget for ``k`` more tokens each (so vLLM neither
        preempts nor splits). Returns 1 when not steady.

        Region diagram of one decoding request (``c`` computed tokens, block size ``b``)::

            | computed c tokens | pending 1 | k - 1 drafts |
            blocks needed after the step: ceil((c + k) / b); held now: ceil(c / b)
        """
        s = self.scheduler
        if limit <= 1 or not s.running or s.waiting or fast_paths.is_kv_holding_waiting(s):
            return 1
        return self._steady_decode_run(limit)

    def _steady_decode_run(self, limit: int, keep_last: bool = False) -> int:
        """:meth:`max_decode_run` without its empty-waiting condition (``keep_last``: no request
        may finish within the run). Pure."""
        s = self.scheduler
        running = s.running
        k = min(limit, self.params.max_num_batched_tokens // len(running))
        if self.params.long_prefill_token_threshold > 0:
            k = min(k, self.params.long_prefill_token_threshold)
        # The sync Scheduler caches a request's full blocks at its next allocate_slots(), so a
        # run must not end a request: its last token takes a single step, after which vLLM
        # caches the blocks the drafts filled (AsyncScheduler caches them at update time).
        keep_last = int(keep_last or not isinstance(s, AsyncScheduler))
        for r in running:
            c = r.num_computed_tokens
            if (c != r.num_tokens - 1 or c < r.num_prompt_tokens or r.num_output_placeholders
                    or r.request_id not in self._planned):
                return 1
            k = min(k, r.max_tokens - r.num_output_tokens - keep_last,
                    self.params.max_model_len - c - 1 - keep_last)
        while k > 1:
            if self._run_new_blocks(k) <= seams.blocks.num_free_blocks(s):
                break
            k //= 2
        return max(1, k)

    def _run_new_blocks(self, k: int) -> int:
        """New KV blocks the running requests take over ``k`` more decode tokens each. Pure."""
        bs = self.params.block_size
        return sum(-(-(r.num_computed_tokens + k) // bs) - -(-r.num_computed_tokens // bs)
                   for r in self.scheduler.running)

    def max_blocked_decode_run(self, limit: int, within: Callable[[int], int] | None = None) -> int:
        """Largest ``k <= limit`` for which one ``schedule()`` with the waiting queue hidden
        (:meth:`schedule` ``hide_waiting=True``) equals ``k`` single steps. Pure.

        Mental model: FCFS past its KV knee. Requests wait for KV while the running ones decode;
        every single step asks vLLM to admit the waiting head, and the answer stays "no" until a
        request finishes, a request arrives or the head's prefix hit changes. The *probe* is the
        last single step: it was a pure decode step (the waiting queue saw the full remaining
        token budget) and left every waiting request unscheduled (:meth:`_is_blocked_probe`);
        since then nothing was added, finished or preempted. Over the next ``k`` steps the same
        requests decode one token each (same token budget and running count), the free blocks
        only shrink (decode allocations, no frees), and each waiting request's need for blocks
        is unchanged as long as its prefix hit is. vLLM stops at the first waiting request it
        cannot allocate (requests are never skipped here: no KV connector, no structured output),
        so only the head is asked, and the blocks the run takes (the head of vLLM's free queue,
        :func:`fast_paths.next_evicted_blocks`) must leave it blocked (:meth:`_keep_head_blocked`). So
        vLLM would leave every waiting request waiting in every step, and hiding them is exact.
        With stock vLLM a request added behind the head leaves the probe valid.

        Our schedulers add time- and event-driven decisions of their own; one that implements
        ``blocked_run_is_safe()`` (and returns True) certifies that none falls due before the
        next event the simulator bounds the run with (``blocked_run_until_s``). Stock vLLM
        schedulers need no hook. Returns 1 when the run is not provably exact.
        """
        s = self.scheduler
        if (limit <= 1 or not self._is_waiting_blocked or not s.running or not s.waiting
                or fast_paths.is_kv_holding_waiting(s) or self._probe_num_tokens != len(s.running)):
            return 1
        if self.is_plugin and (self._probe_has_prefill or not (
                hasattr(s, "blocked_run_is_safe") and s.blocked_run_is_safe())):
            return 1
        # Our schedulers decide on a finish (retained KV from the other requests' lengths): the
        # finishing token takes a single step, where every other request is one token further.
        k = self._steady_decode_run(limit, keep_last=self.is_plugin)
        if self.is_plugin and k > 1:
            k = s.blocked_run_max_tokens(k)
        if within is not None and k > 1:
            k = within(k)
        if k <= 1:
            return 1
        return self._keep_head_blocked(k, self._run_new_blocks)

    def _keep_head_blocked(self, k: int, new_blocks: Callable[[int], int]) -> int:
        """Largest ``k' <= k`` whose run (taking ``new_blocks(k')`` blocks off the free queue)
        leaves the waiting head blocked, or 1. Pure.

        vLLM stops at the first waiting request it cannot allocate: only the head is asked. No
        running request of its session may cache one of its blocks (sessions' streams never
        share a block). Which evictions keep it blocked:

        * with vLLM's full-sequence gate (``scheduler_reserve_full_isl``, vLLM's default) any:
          a waiting request is admitted only if its whole context fits, ``R = blocks(context) -
          hit + evictable hit (+ 1 for a hit ending inside a block) <= F`` (its chunk's own
          check needs no more). ``hit - evictable`` are the hit blocks in use (ref count > 0),
          which no eviction touches: evicting a hit block from the free queue takes it off the
          hit and off the evictable hits (a cut inside the hit takes the blocks after it off
          both, and may drop in-use ones: ``R`` grows). ``R`` drops only by a block the run
          takes (the partial block of a cut hit; a free copy of a key whose pinned copy then
          serves the hit), while ``F`` loses every block the run takes::

              R = blocks(context) - (hit blocks in use) [+ 1]    F - taken
        * without the gate its chunk decides. Stock rule (:meth:`_is_head_rule_stock`):
          evictions from the end of its hit (:meth:`_first_unsafe_eviction`). Otherwise none of
          its blocks, and a scheduler that shrinks chunks to fit also keeps the free blocks at or
          above the most its chunk can need (:meth:`_unshrunk_free_floor`), so the chunk it was
          refused stays what it is (without that floor a chunk halved to the fewer free blocks
          fits: ``test_blocked_run_ends_before_the_step_that_admits_the_head``)."""
        s = self.scheduler
        head = s.waiting.peek_request()
        if any(r.session_id == head.session_id for r in s.running):
            return 1
        if fast_paths.has_full_sequence_gate(s):
            return k  # vLLM's full-sequence gate: no eviction lets the head in (docstring)
        num_taken = new_blocks(k)
        if self._is_head_rule_stock():
            first_hit = self._first_unsafe_eviction(head, fast_paths.next_evicted_blocks(s, num_taken))
        else:  # the first block with one of the head's keys: one walk, no list
            first_hit = fast_paths.first_free_block_holding(s, num_taken, self._pool_hash_keys(head))
            if getattr(s, "chunk_shrinking", False):
                floor = max(0, seams.blocks.num_free_blocks(s) - self._unshrunk_free_floor())
                first_hit = floor if first_hit is None else min(first_hit, floor)
        if first_hit is None or num_taken <= first_hit:
            return k
        lo, hi = 1, k  # largest k' with new_blocks(k') <= first_hit (monotone in k')
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if new_blocks(mid) <= first_hit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _unshrunk_free_floor(self) -> int:
        """Free blocks below which a waiting head's chunk may be shrunk further in a step of the
        run: the most new blocks a chunk of the step's leftover token budget can take, plus the
        watermark. Pure.

        Shrinking halves a chunk until its new blocks fit in the free blocks (minus the
        watermark): while those stay at or above the unshrunk chunk's blocks the chunk is the
        one the probe step was refused, which fewer free blocks still refuse."""
        s = self.scheduler
        budget = max(0, seams.hooks.max_num_scheduled_tokens(s) - self._probe_num_tokens)
        return -(-budget // self.params.block_size) + 1 + seams.blocks.watermark_blocks(s)

    def _first_unsafe_eviction(self, head: Request, evicted: Sequence[Any]) -> int | None:
        """Index of the first of ``evicted`` (the blocks a run takes, in order) whose eviction
        may let the blocked waiting ``head`` in, or None, for a head whose chunk does not depend
        on its hit or the free blocks (:meth:`_is_head_rule_stock`), without vLLM's full-sequence
        gate (:meth:`_keep_head_blocked`). Pure.

        vLLM needs ``R = blocks(hit + chunk) - hit + evictable hit blocks`` free blocks; losing
        the last hit block takes one off ``R`` (or none, when the chunk is the prompt's rest and
        grows by a block), while the run took that block (and maybe more) off the free ones: the
        shortfall only grows. A block past the hit, or one whose key another cached block still
        holds, changes nothing. A block inside the hit cuts it short and may drop several
        evictable hits from ``R`` at once: the walk stops there. ::

            head's keys : | k0 | k1 | ... | k(h-2) | k(h-1) | k(h) miss ...
            evicted     :   stop  stop      stop     ok: h -> h - 1      ok (past the hit)
        """
        keys = self._pool_hash_keys(head)
        s = self.scheduler
        # C-level passes: each evicted block's position among the head's keys (none: past all).
        past = 1 << 62  # beyond any hit (an int: ``int.__gt__`` below)
        positions = list(map(keys.get, map(fast_paths.raw_block_key, evicted), itertools.repeat(past)))
        if positions.count(past) == len(positions):
            return None
        hit = seams.blocks.prefix_hit_tokens(s, head) // self.params.block_size  # a block of the head's
        copies: dict[Any, int] = {}
        # Blocks past the hit change nothing, and the hit only shrinks: only those inside it.
        for i in itertools.compress(range(len(positions)), map(hit.__gt__, positions)):
            position = positions[i]
            if position >= hit:
                continue  # past the (shortened) hit: the walk stopped before it
            key = fast_paths.raw_block_key(evicted[i])
            if key not in copies:
                copies[key] = fast_paths.num_cached_copies(s, key)
            copies[key] -= 1
            if copies[key] > 0:
                continue  # another cached block still serves this key
            if position != hit - 1:
                return i
            hit -= 1
        return None

    def _is_head_rule_stock(self) -> bool:
        """Whether a blocked head stays blocked while a run evicts its hit from the end
        (:meth:`_first_unsafe_eviction`'s stock rule); else any block with one of its keys is
        unsafe. Pure."""
        s = self.scheduler
        return ((not self.is_plugin or s.head_blocked_like_stock())
                and fast_paths.has_one_plain_kv_group(s))

    def _pool_hash_keys(self, request: Request) -> dict[Any, int]:
        """:func:`fast_paths.pool_block_hash_keys` of a waiting request, memoized per session: a turn's
        context extends the session's previous one, so its keys extend the memo's. Block hashes
        are chained (each covers its whole prefix): the memo's ``m`` keys are the request's first
        ``m`` when its hash ``m - 1`` equals the memo's last; otherwise the keys are rebuilt. The
        returned dict is the memo's (callers read it). Mutates the memo."""
        hashes = request.block_hashes
        n = len(hashes)
        sid = request.session_id or request.request_id
        memo = self._hash_keys.pop(sid, None)  # re-inserted last: the most recent session
        keys = None
        if memo is not None and memo[0] <= n and (memo[0] == 0 or hashes[memo[0] - 1] == memo[1]):
            keys = memo[2]
            if memo[0] < n:
                groups = fast_paths.num_kv_cache_groups(self.scheduler)
                keys.update(fast_paths.pool_block_hash_keys(request, groups, start=memo[0]))
        if keys is None:
            groups = fast_paths.num_kv_cache_groups(self.scheduler)
            keys = fast_paths.pool_block_hash_keys(request, groups)
        self._hash_keys[sid] = (n, hashes[n - 1] if n else None, keys)
        if len(self._hash_keys) > _HASH_KEY_SESSIONS:
            del self._hash_keys[next(iter(self._hash_keys))]
        return keys

    # ------------------------------------------------------------------ KV state
    def kv_block_counts(self) -> tuple[int, int, int]:
        """``(free, retained, used)`` blocks, null block excluded (free includes evictable
        prefix-cache blocks; retained = pinned by our schedulers and referenced by no request).

        Memoized between calls that change the KV state (``add_request``, ``schedule``,
        ``update``, ``shutdown``): our schedulers count by walking every request's blocks, and
        the simulator asks several times per step (admission ticks, snapshots)."""
        if self._kv_counts is None:
            s = self.scheduler
            if hasattr(s, "kv_block_counts"):
                self._kv_counts = s.kv_block_counts()
            else:
                free = seams.blocks.num_free_blocks(s)
                self._kv_counts = (free, 0, seams.blocks.num_gpu_blocks(s) - 1 - free)
        return self._kv_counts

    def kv_usage(self) -> float:
        """Used fraction of the KV pool, 0..1 (evictable prefix-cache and retained blocks count as
        free, as the gateway reads ``engine_step``)."""
        _, _, used = self.kv_block_counts()
        return min(1.0, used / max(1, seams.blocks.num_gpu_blocks(self.scheduler) - 1))

    def num_gpu_blocks(self) -> int:
        """Total KV blocks of the pool (including vLLM's null block)."""
        return seams.blocks.num_gpu_blocks(self.scheduler)

    def shutdown(self) -> None:
        """Release what the scheduler still holds (our schedulers: retained KV). Mutates."""
        if hasattr(self.scheduler, "shutdown"):
            self.scheduler.shutdown()
        self._kv_counts = None

    def assert_no_leaks(self) -> dict[str, int]:
        """Integrity check: block ref counts match request references (+ our pins).

        Raises:
            AssertionError: naming the counts and the first bad blocks.
        """
        s = self.scheduler
        if hasattr(s, "assert_no_leaks"):
            return s.assert_no_leaks()
        refs = seams.blocks.referenced_block_counts(s)
        bad = [(b.block_id, b.ref_cnt, refs.get(b.block_id, 0))
               for b in seams.blocks.all_blocks(s) if not b.is_null and b.ref_cnt != refs.get(b.block_id, 0)]
        free = seams.blocks.num_free_blocks(s)
        assert not bad, f"KV ref-count mismatch (block, ref_cnt, request refs): {bad[:10]}"
        assert free + len(refs) == seams.blocks.num_gpu_blocks(s) - 1, (
            f"free {free} + used {len(refs)} != num_gpu_blocks {seams.blocks.num_gpu_blocks(s)} - 1")
        return {"free": free, "used": len(refs)}


def decode_run_step_time_s(
    step_time_s: Callable[[Sequence[tuple[int, int]], Sequence[int]], float],
    decode_context_tokens: Sequence[int], num_decode_tokens: int,
) -> float:
    """Modelled time of ``k`` consecutive pure-decode steps, seconds.

    Decode time is close to linear in the context, so ``k`` steps take ``k`` times the step at
    the mean context (each request's context grows by one token per step)::

        t = k * step(contexts + (k - 1) / 2)

    Args:
        step_time_s: ``(prefill, decode_context_tokens) -> seconds`` of one step.
        decode_context_tokens: contexts at the first of the ``k`` steps.
        num_decode_tokens: ``k`` >= 1.
    """
    k = num_decode_tokens
    if k == 1:
        return step_time_s((), decode_context_tokens)
    mid = (k - 1) // 2
    return k * step_time_s((), [c + mid for c in decode_context_tokens])
