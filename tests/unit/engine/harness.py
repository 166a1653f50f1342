"""Drive REAL vLLM schedulers in-process, without a model or a server (design.md §9).

API (stable; other helpers build on it)::

    h = Harness(MarsScheduler, num_blocks=64, mars={"retention": {...}})  # or Scheduler / AsyncScheduler
    r = h.make_request("s1", prompt_token_ids=h.tokens(100), max_tokens=4,
                       extra_args={"mars_turn": 0})
    h.add(r)                    # scheduler.add_request
    res = h.step(dt_s=0.01)     # schedule() -> synthetic ModelRunnerOutput -> update_from_output()
    res.num_scheduled_tokens    # {request_id: tokens} of that step; res.finished_ids, res.output
    h.run_until_done()          # step until nothing is left (raises if it does not converge)
    h.next_turn(r, num_new_tokens=20, max_tokens=4, extra_args={...})  # prompt = r's tokens + new
    h.clock.advance(5.0)        # the scheduler's clock (our schedulers only) is a FakeClock
    h.assert_no_leaks()         # our integrity check (also a ref-count check for stock schedulers)

Mental model: after ``schedule()`` vLLM has already advanced each scheduled request's
``num_computed_tokens``; a request whose computed tokens reach its ``num_tokens`` has finished its
prompt (or is decoding) and gets exactly one sampled token; a request still in prefill gets none
(as the model runner does). Tokens are sampled as a deterministic id, and stop on ``max_tokens``
(``ignore_eos``). By default steps run one at a time (schedule -> update), which is how vLLM runs
on CPU, where the platform forces async scheduling off; ``pipeline_depth=2`` reproduces async
scheduling (the next step is scheduled before the previous output is applied).

The tiny model directory is a minimal ``LlamaForCausalLM`` ``config.json`` written to a temp dir
(``skip_tokenizer_init=True``); nothing is downloaded. ``ModelConfig`` (~2 s to build) is cached
per process.
"""

from __future__ import annotations

import functools
import json
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

__all__ = ["FakeClock", "Harness", "StepResult", "run_preemption_scenario", "tiny_model_dir"]

VOCAB_SIZE = 512
MAX_MODEL_LEN = 131072
SAMPLED_TOKEN_ID = 7


@functools.lru_cache(maxsize=1)
def tiny_model_dir() -> str:
    """A temp dir holding a minimal LlamaForCausalLM config.json (written once per process)."""
    path = Path(tempfile.mkdtemp(prefix="mars-tiny-model-"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }))
    return str(path)


@functools.lru_cache(maxsize=1)
def _model_config() -> ModelConfig:
    return ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True,
                       max_model_len=MAX_MODEL_LEN, dtype="float32")


@functools.lru_cache(maxsize=1)
def _hash_fn() -> Any:
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return fn


class FakeClock:
    """Monotonic fake clock (seconds); assign to ``scheduler.clock``."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> float:
        """Move forward ``dt_s`` >= 0 seconds; returns the new time."""
        if dt_s < 0:
            raise ValueError(f"clock cannot go back, got dt_s={dt_s}")
        self.now_s += dt_s
        return self.now_s


@dataclass
class StepResult:
    """One harness step."""

    scheduler_output: Any
    output: dict[int, Any]
    num_scheduled_tokens: dict[str, int]
    finished_ids: set[str] = field(default_factory=set)
    preempted_ids: set[str] = field(default_factory=set)


def make_vllm_config(
    *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
    long_prefill_token_threshold: int, enable_prefix_caching: bool, mars: dict[str, Any] | None,
    scheduling_policy: str = "fcfs",
) -> VllmConfig:
    """VllmConfig over the tiny model (prefix caching on by default, chunked prefill on)."""
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False, enable_chunked_prefill=True,
        long_prefill_token_threshold=long_prefill_token_threshold, policy=scheduling_policy,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    additional = {"mars": mars} if mars is not None else {}
    return VllmConfig(model_config=_model_config(), scheduler_config=sched, cache_config=cache,
                      additional_config=additional)


class Harness:
    """A real vLLM scheduler (stock or ours) over a fake KV cache of ``num_blocks`` blocks.

    Args:
        scheduler_cls: vLLM ``Scheduler``/``AsyncScheduler`` or one of our subclasses.
        num_blocks: KV blocks in the pool (block 0 is vLLM's null block).
        block_size: tokens per block.
        max_num_seqs: running-request cap.
        max_num_batched_tokens: token budget per step.
        long_prefill_token_threshold: vLLM's per-request prefill cap (0 = off).
        enable_prefix_caching: vLLM's prefix cache.
        mars: the ``additional_config["mars"]`` dict for our schedulers.
        seed: seeds :meth:`tokens`.
        pipeline_depth: 1 = schedule then update (vLLM on CPU); 2 = async scheduling as vLLM's
            batch queue runs it on GPU: step k+1 is scheduled before step k's output is applied
            (use with an ``AsyncScheduler`` subclass).
        scheduling_policy: vLLM's ``--scheduling-policy`` ("fcfs" or "priority").
    """

    def __init__(
        self, scheduler_cls: type[Scheduler], *, num_blocks: int = 256, block_size: int = 16,
        max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
        long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True,
        mars: dict[str, Any] | None = None, seed: int = 0, pipeline_depth: int = 1,
        scheduling_policy: str = "fcfs",
    ) -> None:
        if pipeline_depth not in (1, 2):
            raise ValueError(f"pipeline_depth must be 1 or 2, got {pipeline_depth}")
        self.pipeline_depth = pipeline_depth
        self._in_flight: list[tuple[Any, ModelRunnerOutput]] = []
        self.block_size = block_size
        self.vllm_config = make_vllm_config(
            block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_prefix_caching=enable_prefix_caching, mars=mars,
            scheduling_policy=scheduling_policy,
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16,
                                 dtype=torch.float32)
        page = spec.page_size_bytes
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=["layer.0"],
                                            layer_stride=page * num_blocks, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.scheduler = scheduler_cls(
            vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
        )
        self.clock = FakeClock()
        if hasattr(self.scheduler, "clock"):
            self.scheduler.set_clock(self.clock)
        self.block_hasher = get_request_block_hasher(block_size, _hash_fn())
        self.rng = random.Random(seed)
        self.finished: dict[str, Request] = {}
        self.steps: list[StepResult] = []
        self._next_id = 0

    # ------------------------------------------------------------------ requests
    def tokens(self, n: int) -> list[int]:
        """``n`` random token ids (distinct prompts never share a block by accident)."""
        return [self.rng.randrange(10, VOCAB_SIZE) for _ in range(n)]

    def make_request(
        self, session_id: str | None, prompt_token_ids: list[int], max_tokens: int = 4,
        extra_args: dict[str, Any] | None = None, *, request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        """A vLLM ``Request`` with prefix-cache hashing, ``ignore_eos`` and the given extras."""
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.extra_args = dict(extra_args) if extra_args else None
        return Request(request_id, list(prompt_token_ids), params, None,
                       block_hasher=self.block_hasher, session_id=session_id, priority=priority)

    def next_turn(self, previous: Request, num_new_tokens: int, max_tokens: int = 4,
                  extra_args: dict[str, Any] | None = None) -> Request:
        """The session's next turn: previous prompt + its outputs + ``num_new_tokens`` new ones."""
        prompt = list(previous.prompt_token_ids or []) + list(previous.output_token_ids)
        return self.make_request(previous.session_id, prompt + self.tokens(num_new_tokens),
                                 max_tokens, extra_args)

    def add(self, request: Request) -> Request:
        """``scheduler.add_request(request)``; returns the request."""
        self.scheduler.add_request(request)
        return request

    # ------------------------------------------------------------------ stepping
    def step(self, dt_s: float = 0.0) -> StepResult:
        """Advance the clock by ``dt_s``, then schedule -> synthetic output -> update.

        With ``pipeline_depth=2`` the update applies the *previous* step's output (the returned
        result then describes that update; its ``num_scheduled_tokens`` are of this schedule).
        """
        self.clock.advance(dt_s)
        s = self.scheduler
        out = s.schedule()
        req_ids = list(out.num_scheduled_tokens)
        # After schedule() vLLM marks requests still inside their prompt as prefill chunks; the
        # model runner samples no token for those.
        sampled = [[] if s.requests[rid].is_prefill_chunk else [SAMPLED_TOKEN_ID] for rid in req_ids]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        self._in_flight.append((out, runner_output))
        result = StepResult(out, {}, dict(out.num_scheduled_tokens),
                            preempted_ids=set(out.preempted_req_ids or ()))
        while len(self._in_flight) >= self.pipeline_depth or (
            self._in_flight and not s.has_unfinished_requests()
        ):
            self._apply_oldest(result)
        self.steps.append(result)
        return result

    def _apply_oldest(self, result: StepResult) -> None:
        out, runner_output = self._in_flight.pop(0)
        engine_outputs = self.scheduler.update_from_output(out, runner_output)
        result.output.update(engine_outputs)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    result.finished_ids.add(o.request_id)

    def run_until_done(self, max_steps: int = 10000, dt_s: float = 0.01) -> list[StepResult]:
        """Step until the scheduler holds no unfinished request.

        Raises:
            RuntimeError: still busy after ``max_steps`` (a stall), naming the counts.
        """
        results = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and not self._in_flight:
                return results
            results.append(self.step(dt_s))
        running, waiting = self.scheduler.get_request_counts()
        raise RuntimeError(
            f"scheduler did not drain in {max_steps} steps: running={running}, waiting={waiting}"
        )

    def run_until_finished(self, request_id: str, max_steps: int = 10000,
                           dt_s: float = 0.01) -> StepResult:
        """Step until ``request_id`` finishes; returns that step.

        Raises:
            RuntimeError: not finished after ``max_steps``.
        """
        for _ in range(max_steps):
            res = self.step(dt_s)
            if request_id in res.finished_ids:
                return res
        raise RuntimeError(f"{request_id} not finished after {max_steps} steps")

    # ------------------------------------------------------------------ checks
    def num_free_blocks(self) -> int:
        """Free (or evictable) blocks of the pool."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def assert_no_leaks(self) -> dict[str, int]:
        """Our schedulers: ``assert_no_leaks()``. Stock: every ref count matches request refs."""
        if hasattr(self.scheduler, "assert_no_leaks"):
            return self.scheduler.assert_no_leaks()
        pool = self.scheduler.kv_cache_manager.block_pool
        refs: dict[int, int] = {}
        for m in self.scheduler.kv_cache_manager.coordinator.single_type_managers:
            for blocks in m.req_to_blocks.values():
                for b in blocks:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        bad = [(b.block_id, b.ref_cnt) for b in pool.blocks
               if not b.is_null and b.ref_cnt != refs.get(b.block_id, 0)]
        assert not bad, f"stock scheduler ref-count mismatch: {bad[:10]}"
        return {"free": pool.get_num_free_blocks(), "used": len(refs)}


def run_preemption_scenario(scheduler_cls: type[Scheduler], mars: dict[str, Any] | None = None,
                            long_arrival_steps: tuple[int, ...] = (0, 300),
                            max_steps: int = 20_000) -> dict[str, Any]:
    """Issue 16 kind 4's workload: 384 blocks of 16, a 512-token step budget, async scheduling
    (one step in flight), four short sessions (100-token prompts) decoding 1,500 tokens each
    from step 0, and two 4,000-token prompts decoding as long, arriving at ``long_arrival_steps``.

    Returns:
        ``ratio``: prefill tokens scheduled over prompt tokens (a prefix-cache hit is not
        recomputed; 1.0 = every prompt token computed once); ``preempted``: request id ->
        preemptions; ``resumed_hits``: request id -> prefix hit (tokens) at each resume.

    Raises:
        RuntimeError: the engine did not drain within ``max_steps`` (naming what is held).
    """
    h = Harness(scheduler_cls, num_blocks=384, max_num_batched_tokens=512, max_num_seqs=256,
                mars=mars, pipeline_depth=2)
    arrivals = [(0, f"short{i}", 100) for i in range(4)]
    arrivals += [(step, f"long{i}", 4000) for i, step in enumerate(long_arrival_steps)]
    num_prompt = sum(n for _, _, n in arrivals)
    last_arrival = max(step for step, _, _ in arrivals)
    num_prefill, preempted, hits, pending = 0, {}, {}, set()
    for step in range(max_steps):
        for _, sid, n in [a for a in arrivals if a[0] == step]:
            extra = {"mars_turn": 0, "mars_last_step": 0} if mars is not None else None
            h.add(h.make_request(sid, h.tokens(n), 1500, extra, request_id=sid))
        if step > last_arrival and not h.scheduler.has_unfinished_requests() and not h._in_flight:
            break
        res = h.step(0.01)
        for rid in res.preempted_ids:
            preempted[rid] = preempted.get(rid, 0) + 1
            pending.add(rid)
        for rid, n in res.num_scheduled_tokens.items():
            num_prefill += n if n > 1 else 0
            if rid in pending:
                pending.discard(rid)
                hits.setdefault(rid, []).append(h.scheduler.requests[rid].num_computed_tokens - n)
    else:
        raise RuntimeError(f"engine did not drain in {max_steps} steps: "
                           f"held {sorted(getattr(h.scheduler, 'held', {}))}")
    h.assert_no_leaks()
    return {"ratio": num_prefill / num_prompt, "preempted": preempted, "resumed_hits": hits}


def add_stream_turn(engine: Any, stream: Any, rid: str, appended: int, output: int, t_s: float = 0.0) -> int:
    """One turn on an in-process engine: ``appended`` new prompt tokens, then ``output`` tokens the
    request will decode, on the session's token ``stream``. Returns the turn's prompt length.
    Mutates ``stream`` and ``engine`` (``InprocEngine``, ``SessionTokenStream``)."""
    stream.append(appended)
    prompt = len(stream)
    stream.append(output)
    engine.add_request(rid, stream, prompt, output, arrival_time_s=t_s)
    return prompt
