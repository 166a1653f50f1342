"""GPU step-time model from NVIDIA's measured kernel data (design.md §9).

One vLLM engine step (one forward pass over a mixed batch of prefill chunks and decode tokens)
takes ``scale × estimate + overhead_ms``, where ``estimate`` is AIConfigurator's kernel-level
prediction for that batch (``aiconfigurator-core`` 0.12.0,
``RustForwardPassPerfModel.estimate_forward_pass_time_ms``, built from measured vLLM 0.24.0
kernel latencies) and ``scale``/``overhead_ms`` are the profile's calibration
(:class:`~mars_openhands.engine.harness.executor.profiles.Calibration`).

Mental model: the estimator sees a step only through five sums, because requests are averaged
within each phase::

    step = | prefill chunks: P requests | decode tokens: D requests |
             new tokens  Σ num_scheduled_tokens        D tokens (one each)
             cached      Σ num_computed_tokens         context Σ (num_computed + 1)

so a step is ``(P, Σnew, Σcached, D, Σcontext)``. The object is pure and engine-free: no vLLM,
no clock, no sleeping; the emulated executor and the simulator both call it.

Known quirk (design.md §9): with P > 1 prefill requests, a ``Σnew`` not divisible by P can
inflate the estimate by up to 50%, so ``Σnew`` is rounded down to a multiple of P (a few tokens
of a multi-thousand-token step). Context and cached sums are bucketed to ~1.6% (a multiple of
``2**(floor(log2 x) - 6)``) so that an LRU cache hits: a cached call costs ~1-2 µs, a miss
15-130 µs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mars_openhands.engine.harness.executor.profiles import (
    AIC_BACKEND,
    AIC_BACKEND_VERSION,
    AIC_PACKAGE_VERSION,
    KV_CACHE_DTYPES,
    GpuProfile,
    materialize_model_config,
    require_aiconfigurator,
)

__all__ = [
    "ForwardPassEstimator",
    "StepShape",
    "StepTimeModel",
    "StepTimeModelError",
    "bucket_tokens",
]

_EXACT_BELOW_TOKENS = 256
"""Sums below this many tokens are used exactly (bucket width 1)."""
_BUCKET_SHIFT = 6
"""Bucket width is ``2**(floor(log2 x) - 6)``: at most 1/64 ≈ 1.6% of the value."""


class StepTimeModelError(ValueError):
    """The kernel data cannot answer a step (e.g. outside the measured range)."""


class ForwardPassEstimator(Protocol):
    """What :class:`StepTimeModel` needs from AIConfigurator (or a test double)."""

    def estimate_forward_pass_time_ms(self, metrics: dict[str, Any]) -> float | None:
        """Kernel-level forward-pass time in ms for one scheduled step."""


@contextlib.contextmanager
def _quiet_aiconfigurator() -> Iterator[None]:
    """Silence aiconfigurator's per-table 'low-fidelity fallback rows' warnings while loading.

    The warnings concern MLA/DSA tables that Qwen3 and gpt-oss never query.
    """
    log = logging.getLogger("aiconfigurator_core")
    before = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(before)


def bucket_tokens(num_tokens: int) -> int:
    """Round a token sum to its cache bucket (pure).

    Args:
        num_tokens: a sum of tokens (>= 0).

    Returns:
        ``num_tokens`` itself below 256; otherwise the nearest multiple of
        ``2**(floor(log2 num_tokens) - 6)`` (relative error <= 1/128).

    Example:
        >>> bucket_tokens(100), bucket_tokens(10_000), bucket_tokens(10_100)
        (100, 9984, 10112)
    """
    if num_tokens < _EXACT_BELOW_TOKENS:
        return num_tokens
    width = 1 << (num_tokens.bit_length() - 1 - _BUCKET_SHIFT)
    return ((num_tokens + width // 2) // width) * width


@dataclass(frozen=True)
class StepShape:
    """The five sums that describe one engine step to the kernel model.

    Attributes:
        num_prefill_requests: requests running a prefill chunk this step (P).
        prefill_new_tokens: Σ tokens those chunks compute (Σ num_scheduled_tokens).
        prefill_cached_tokens: Σ tokens already in KV for those requests (Σ num_computed_tokens).
        num_decode_requests: requests decoding one token this step (D).
        decode_context_tokens: Σ context length attended by the decode tokens (tokens).
    """

    num_prefill_requests: int = 0
    prefill_new_tokens: int = 0
    prefill_cached_tokens: int = 0
    num_decode_requests: int = 0
    decode_context_tokens: int = 0

    @classmethod
    def from_requests(
        cls,
        prefill: Iterable[tuple[int, int]] = (),
        decode_context_tokens: Sequence[int] = (),
    ) -> StepShape:
        """Build from per-request numbers.

        Args:
            prefill: one ``(new_tokens, cached_tokens)`` per prefill request.
            decode_context_tokens: one context length (tokens, including the token being
                decoded) per decode request.
        """
        num_p = new = cached = 0
        for new_tokens, cached_tokens in prefill:
            num_p += 1
            new += new_tokens
            cached += cached_tokens
        return cls(num_p, new, cached, len(decode_context_tokens), sum(decode_context_tokens))

    def validate(self) -> None:
        """Raise :class:`StepTimeModelError` on an impossible shape (negative sums, a prefill
        request with no new token, a decode request with no context)."""
        if min(self.num_prefill_requests, self.prefill_new_tokens, self.prefill_cached_tokens,
               self.num_decode_requests, self.decode_context_tokens) < 0:
            raise StepTimeModelError(f"step sums must be >= 0, got {self}")
        if self.prefill_new_tokens < self.num_prefill_requests or (
            self.num_prefill_requests == 0 and self.prefill_new_tokens > 0
        ):
            raise StepTimeModelError(
                f"each prefill request computes >= 1 new token, got {self.num_prefill_requests} "
                f"requests and {self.prefill_new_tokens} new tokens"
            )
        if self.decode_context_tokens < self.num_decode_requests:
            raise StepTimeModelError(
                f"each decode request attends >= 1 token, got {self.num_decode_requests} "
                f"requests and {self.decode_context_tokens} context tokens"
            )

    def cache_key(self) -> tuple[int, int, int, int, int]:
        """The bucketed, quirk-corrected sums the estimate is computed (and cached) for.

        ``Σnew`` is rounded down to a multiple of P (the >1-prefill quirk); the cached and
        context sums go to :func:`bucket_tokens`; counts stay exact.
        """
        num_p = self.num_prefill_requests
        new = (self.prefill_new_tokens // num_p) * num_p if num_p > 1 else self.prefill_new_tokens
        return (num_p, new, bucket_tokens(self.prefill_cached_tokens), self.num_decode_requests,
                bucket_tokens(self.decode_context_tokens))


class StepTimeModel:
    """Modelled GPU time of one vLLM engine step for a :class:`GpuProfile` (pure, engine-free).

    Not thread-safe for the cache bookkeeping of concurrent callers (use one per thread).

    Example:
        >>> m = StepTimeModel(GpuProfile(gpu="h100_sxm", model="qwen3-30b-a3b"))  # doctest: +SKIP
        >>> round(m.step_time_s(prefill=[(2048, 0)]) * 1000, 1)  # doctest: +SKIP
        47.5
    """

    def __init__(
        self,
        profile: GpuProfile,
        *,
        estimator: ForwardPassEstimator | None = None,
        cache_size: int = 1 << 16,
    ) -> None:
        """Load the kernel data for ``profile`` (~2 s import + ~4 s per model, once).

        Args:
            profile: the GPU × model × dtype and its calibration.
            estimator: an object with ``estimate_forward_pass_time_ms(metrics)``; ``None``
                builds AIConfigurator's native model for the profile.
            cache_size: entries in the per-instance LRU cache of kernel estimates.

        Raises:
            ImportError: aiconfigurator-core (pinned version) is missing.
            StepTimeModelError: aiconfigurator has no data for the profile.
        """
        self.profile = profile
        calibration = profile.calibration
        self.scale = calibration.scale
        self.overhead_s = calibration.overhead_ms / 1000.0
        self._estimator = estimator if estimator is not None else _build_estimator(profile)
        self._cached_estimate_ms = functools.lru_cache(maxsize=cache_size)(self._estimate_ms)

    def estimate_ms(self, shape: StepShape) -> float:
        """AIConfigurator's uncalibrated kernel estimate for ``shape``, in ms (0.0 if empty).

        Raises:
            StepTimeModelError: impossible shape, or the kernel data cannot answer it.
        """
        shape.validate()
        return self._cached_estimate_ms(*shape.cache_key())

    def shape_time_s(self, shape: StepShape) -> float:
        """Calibrated step time in seconds: ``scale × estimate + overhead`` (0.0 if empty).

        Raises:
            StepTimeModelError: as :meth:`estimate_ms`.
        """
        shape.validate()
        if shape.num_prefill_requests == 0 and shape.num_decode_requests == 0:
            return 0.0
        return self.scale * self.estimate_ms(shape) / 1000.0 + self.overhead_s

    def step_time_s(
        self,
        prefill: Iterable[tuple[int, int]] = (),
        decode_context_tokens: Sequence[int] = (),
    ) -> float:
        """Calibrated time of one step in seconds.

        Args:
            prefill: one ``(new_tokens, cached_tokens)`` per request running a prefill chunk.
            decode_context_tokens: one context length per decode request (tokens attended,
                including the new one).

        Returns:
            ``scale × estimate_ms / 1000 + overhead_ms / 1000``; 0.0 for an empty step.

        Raises:
            StepTimeModelError: impossible inputs or no kernel data for them.
        """
        return self.shape_time_s(StepShape.from_requests(prefill, decode_context_tokens))

    def decode_step_time_s(self, num_decode_requests: int, decode_context_tokens: int) -> float:
        """:meth:`step_time_s` of a pure-decode step, from its shape (``D`` requests attending
        ``decode_context_tokens`` in total): the same value, without building the context list.

        Raises:
            StepTimeModelError: as :meth:`step_time_s`.
        """
        return self.shape_time_s(StepShape(0, 0, 0, num_decode_requests, decode_context_tokens))

    def cache_info(self) -> functools._CacheInfo:
        """Hits/misses of the estimate cache (for benchmarks)."""
        return self._cached_estimate_ms.cache_info()

    def _estimate_ms(self, num_p: int, new: int, cached: int, num_d: int, context: int) -> float:
        metrics = {
            "version": 1,
            "scheduled_requests": {
                "num_prefill_requests": num_p,
                "sum_prefill_tokens": new,
                "sum_prefill_kv_tokens": cached,
                "num_decode_requests": num_d,
                "sum_decode_kv_tokens": context,
            },
        }
        try:
            value = self._estimator.estimate_forward_pass_time_ms(metrics)
        except ValueError as exc:  # aiconfigurator's PerfDataNotAvailableError is a ValueError
            raise StepTimeModelError(
                f"no kernel data for step (P={num_p}, new={new}, cached={cached}, D={num_d}, "
                f"context={context}) on {self.profile.key}: {exc}"
            ) from exc
        if value is None:
            raise StepTimeModelError(f"aiconfigurator returned no estimate for {metrics}")
        return float(value)


def _build_estimator(profile: GpuProfile) -> ForwardPassEstimator:
    """Build AIConfigurator's native forward-pass model for ``profile`` (vLLM 0.24.0 data)."""
    require_aiconfigurator()
    from aiconfigurator_core.sdk.rust_engine_step import RustForwardPassPerfModel

    config = {
        "schema_version": 1,
        "model_name": materialize_model_config(profile.model_spec),
        "system_name": profile.aic_system,
        "backend": AIC_BACKEND,
        "backend_version": AIC_BACKEND_VERSION,
        "tp_size": profile.tp_size,
        "pp_size": 1,
        "moe_tp_size": profile.tp_size,
        "moe_ep_size": 1,
        "attention_dp_size": 1,
    }
    if profile.kv_cache_dtype is not None:  # the fp8-KV attention kernels (vLLM --kv-cache-dtype)
        config["kv_cache_dtype"] = KV_CACHE_DTYPES[profile.kv_cache_dtype][1]
    try:
        with _quiet_aiconfigurator():
            return RustForwardPassPerfModel.from_native(config)
    except ValueError as exc:
        raise StepTimeModelError(
            f"aiconfigurator {AIC_PACKAGE_VERSION} has no vLLM {AIC_BACKEND_VERSION} data for "
            f"{profile.key} (system {profile.aic_system}): {exc}"
        ) from exc
