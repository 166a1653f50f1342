"""The policy registry: every ``--policies`` name and how it maps onto the engine (design.md §5).

One :class:`PolicySpec` per name: the scheduler class and its ``--additional-config``, other engine
settings, whether the policy counts as a baseline, whether it comes with the gateway's admission
window (its control plane), which part an ablation switches off, and whether it is the
unbounded-KV reference. ``compare``, ``openhands bench`` (:mod:`eval.ohbench`), the live backends
(:func:`live_policy_config`) and the benchmarks all read policies from here; docs/schedulers.md
describes the schedulers, docs/compare.md the ablations and the reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eval.workloads import Workload

__all__ = [
    "ABLATIONS",
    "DEFAULT_HOST_KV_GIB",
    "DEFAULT_POLICIES",
    "FREE_COPIES",
    "HOST_KV_POLICIES",
    "OFFLOAD_VARIANTS",
    "POLICIES",
    "QUICK_POLICIES",
    "STOCK_OFFLOAD_POLICIES",
    "REFERENCE",
    "TIER_BOUNDS",
    "PolicySpec",
    "admission_modes",
    "live_policy_config",
    "merge_config",
    "parse_policies",
    "policy_additional_config",
    "reference_tag",
    "takes_mars_config",
    "unbounded_kv_blocks",
    "with_host_kv_policies",
]


@dataclass(frozen=True)
class PolicySpec:
    """How one ``--policies`` name maps onto the simulator.

    Attributes:
        scheduler: ``SimConfig.policy`` (``"fcfs"`` or a class exported by ``mars_openhands.engine``).
        additional_config: vLLM ``--additional-config`` (see docs/schedulers.md).
        is_baseline: counts as a baseline for the "best baseline" ratios.
    """

    scheduler: str
    additional_config: Mapping[str, Any] = field(default_factory=dict)
    is_baseline: bool = True
    engine: Mapping[str, Any] = field(default_factory=dict)
    """Engine settings besides the scheduler (``InprocEngineParams`` fields in the simulator; the
    live backends turn them into server flags, :func:`eval.backends.engine_flags`)."""
    has_control_plane: bool = False
    """The policy comes with the gateway's admission window (``--admission auto`` turns it on):
    MARS is an internal scheduler *and* an external control plane (MARS §4.2, §4.3)."""
    ablates: str | None = None
    """For an ablation variant of ``mars``: the part switched off (a key of :data:`eval.report.PAPER_ABLATIONS`);
    not in ``--policies all``."""
    admission: Mapping[str, Any] = field(default_factory=dict)
    """Gateway admission-window settings (``AdmissionParams`` fields) for its runs with the window."""
    host_kv: Mapping[str, Any] | None = None
    """The policy runs with vLLM's host-memory KV tier (``--kv-offloading-backend native``):
    ``HostKvParams`` fields besides the size (``eviction``, ...); the size is ``compare
    --host-kv-gib`` (docs/compare.md "Host-memory KV tier"). ``None``: GPU KV only. Not in
    ``--policies all`` (``--host-kv-gib`` adds them)."""
    offload_of: str | None = None
    """For a host-tier policy: the GPU-only policy it is (the same scheduler and settings with
    vLLM's tier underneath; ``compare --host-kv-gib`` / ``plan --host-kv-gib`` add it next to
    that policy, :func:`with_host_kv_policies`)."""
    is_kv_unbounded: bool = False
    """A reference, not a policy: the engine gets KV for every session's whole context at once
    (:func:`unbounded_kv_blocks`), so nothing ever waits for KV, is preempted or re-prefilled.
    Simulator only; no admission window; not a baseline."""
    is_tier_bound: bool = False
    """A bound, not a policy: a scheduler over a host tier whose copies are free (:data:`FREE_COPIES`:
    a copy takes ~0 s and slows no step), so its capacity bounds every store / drop / load decision
    of that scheduler's order over the tier (vLLM's prompt-only stores kept), not other orders
    (docs/schedulers.md "The tier bound"). Simulator only; not a baseline; not in ``--policies all``; reports name it
    :func:`reference_tag`."""


_WITH_MLFQ: Mapping[str, Any] = {"mars": {"mars": {"mlfq": True}}}
"""``mars-mlfq``: mars with the MLFQ priority coordinator on (``mars.mlfq``, off in ``mars``):
levels from the prefill work a turn adds and the session's attained service, bounded aging
promotion, per-level prefill quanta (8192, 2048, 1024, 512 tokens). Everything else as mars."""
_NO_COSCHEDULER: Mapping[str, Any] = {"mars": {"retention": {"enabled": False}, "residency": {"enabled": False}}}
"""``mars-no-coscheduler``: no CPU-GPU co-scheduling of KV: neither residency (pinning the
resident sessions' KV across tool calls, holding the others' turns) nor value-model retention
(TTL by the tool's duration CDF); a finished turn's KV goes back to vLLM's prefix cache as under
stock vLLM. Priority levels and the control plane stay on."""

FREE_COPIES: Mapping[str, Any] = {"eviction": "lru", "h2d_gb_per_s": 1e6, "d2h_gb_per_s": 1e6,
                                   "duplex_gb_per_s": 2e6, "copy_slowdown": 1.0}
"""``HostKvParams`` of a tier bound: copies at 10^6 GB/s each way (each direction keeps it while both
copy: the duplex sum is twice that), so a 16-token block of a 100 kB/token model moves in ~2 ns and
a 120k-token context in ~12 µs, against the modelled 50 GB/s (~30 µs a block, ~0.2 s a context);
no step slows while copying (``copy_slowdown`` 1). The size stays ``--host-kv-gib``."""

POLICIES: Mapping[str, PolicySpec] = {
    "fcfs": PolicySpec("fcfs"),
    # Stock vLLM as vLLM's agentic benchmark tunes it (design.md §5; docs/schedulers.md).
    "vllm-tuned": PolicySpec("fcfs", engine={"long_prefill_token_threshold": 512}),
    "autellix": PolicySpec("AutellixScheduler"),
    "infercept": PolicySpec("InferceptScheduler"),
    "continuum": PolicySpec("ContinuumScheduler", {"mars": {"continuum": {"mode": "continuum"}}}),
    "continuum-dy": PolicySpec("ContinuumScheduler", {"mars": {"continuum": {"mode": "continuum-dy"}}}),
    "thunderagent": PolicySpec("ThunderAgentScheduler"),
    # Stock vLLM with its native host-memory KV tier (OffloadingConnector), LRU and ARC eviction.
    "vllm-offload-lru": PolicySpec("fcfs", host_kv={"eviction": "lru"}, offload_of="fcfs"),
    "vllm-offload-arc": PolicySpec("fcfs", host_kv={"eviction": "arc"}),
    # The baselines with offload as their authors ran it (docs/schedulers.md "With the host
    # tier"): the scheduler unchanged, vLLM's native tier underneath in place of LMCache.
    # Continuum: vllm-continuum's README "With CPU offload (requires lmcache)" runs the same
    # `--scheduling-policy continuum` with `--kv-transfer-config {"kv_connector": "LMCacheConnectorV1",
    # "kv_role": "kv_both"}` (as vendored in Afterglow231/MARS_preview @ 7e649f3); the scheduler
    # itself does not change with offload. ThunderAgent: its router (ThunderAgent-org/ThunderAgent
    # @ a7eef77) has no offload setting and sits in front of any vLLM; the paper's appendix A.2
    # (arXiv 2602.13692) measured vLLM + LMCache CPU offload underneath. Both: offload-unaware
    # schedulers over an offloading engine, which is what these variants run.
    "continuum-offload": PolicySpec("ContinuumScheduler", {"mars": {"continuum": {"mode": "continuum"}}},
                                    host_kv={"eviction": "lru"}, offload_of="continuum"),
    "thunderagent-offload": PolicySpec("ThunderAgentScheduler", host_kv={"eviction": "lru"},
                                       offload_of="thunderagent"),
    # The preview's own CPU overload threshold, no wait bound and C_cpu with f = 1 (a faithful port;
    # ours: 1.5, 1800 s and the measured tool fraction).
    "mars-preview": PolicySpec("MarsPreviewScheduler", is_baseline=False, has_control_plane=True,
                               admission={"cpu_set_backlog_ratio": 4.0, "max_admission_wait_s": None,
                                          "tool_fraction_horizon_s": None}),
    "mars": PolicySpec("MarsScheduler", is_baseline=False, has_control_plane=True),
    # mars over the same tier: its residency charges a displaced idle session the host load of its
    # stored blocks, not their re-prefill (policy/residency.resume_cost_s), so it keeps less idle KV.
    "mars-offload": PolicySpec("MarsScheduler", is_baseline=False, has_control_plane=True,
                               host_kv={"eviction": "lru"}, offload_of="mars"),
    # mars-offload with free copies: a bound on mars's tier decisions (docs/schedulers.md "With the
    # host tier"); not an offload variant of mars (with_host_kv_policies never adds it).
    "mars-offload-free": PolicySpec("MarsScheduler", is_baseline=False, has_control_plane=True,
                                    host_kv=FREE_COPIES, is_tier_bound=True),
    # Ablations (MARS §6): mars with one part switched off (docs/compare.md "Ablations").
    "mars-mlfq": PolicySpec("MarsScheduler", _WITH_MLFQ, is_baseline=False, has_control_plane=True,
                            ablates="priority"),
    "mars-no-control-plane": PolicySpec("MarsScheduler", is_baseline=False, has_control_plane=False,
                                        ablates="control_plane"),
    "mars-no-coscheduler": PolicySpec("MarsScheduler", _NO_COSCHEDULER, is_baseline=False,
                                      has_control_plane=True, ablates="coscheduler"),
    # The reference every KV policy is measured against (docs/compare.md "Headroom").
    "unbounded-kv": PolicySpec("fcfs", is_baseline=False, is_kv_unbounded=True),
}
"""The one policy registry: every ``--policies`` name (design.md §5), in the default order, then
the ablation variants of ``mars``."""
DEFAULT_POLICIES: tuple[str, ...] = tuple(n for n, p in POLICIES.items()
                                          if p.ablates is None and not p.is_kv_unbounded and p.host_kv is None)
"""``--policies all``: every policy except the ablation variants, the reference and the host-tier
baselines (:data:`HOST_KV_POLICIES`)."""
HOST_KV_POLICIES: tuple[str, ...] = tuple(n for n, p in POLICIES.items() if p.host_kv is not None)
"""The policies with a host-memory KV tier."""
STOCK_OFFLOAD_POLICIES: tuple[str, ...] = ("vllm-offload-lru", "vllm-offload-arc")
"""Stock vLLM with its tier: ``--host-kv-gib`` always adds them (the baseline every tier needs)."""
OFFLOAD_VARIANTS: Mapping[str, str] = {p.offload_of: n for n, p in POLICIES.items() if p.offload_of}
"""GPU-only policy -> its host-tier variant (``fcfs`` -> ``vllm-offload-lru``, ``mars`` ->
``mars-offload``, ...)."""
DEFAULT_HOST_KV_GIB = 256.0
"""Host KV tier of a host-tier policy without ``--host-kv-gib``, GiB: one GPU's share of a DGX
H200's 2 TB system memory (8 GPUs), the machine the profiles model."""
REFERENCE = "unbounded-kv"
"""The unbounded-KV reference (``PolicySpec.is_kv_unbounded``): ``compare`` adds it to every
simulator sweep unless ``--no-reference`` or ``--quick`` (:func:`eval.compare.with_reference`)."""
TIER_BOUNDS: tuple[str, ...] = tuple(n for n, p in POLICIES.items() if p.is_tier_bound)
"""The host-tier bounds (``PolicySpec.is_tier_bound``): run only when ``--policies`` names them."""
ABLATIONS: tuple[str, ...] = tuple(n for n, p in POLICIES.items() if p.ablates is not None)
"""The ablation variants (``--ablations`` adds them to the policies)."""
QUICK_POLICIES: tuple[str, ...] = ("fcfs", "continuum", "thunderagent", "mars")
"""``--quick``: FCFS, the two strongest baselines and mars. Continuum was the strongest baseline of
the full-workload measurements in issue 12 (H100 and H200); ThunderAgent (ICML'26) is the newest
program-level baseline, built to beat Continuum in exactly this regime."""


def parse_policies(text: str | Sequence[str]) -> tuple[str, ...]:
    """Split a comma-separated policy list (``"all"`` = every one) and check the names.

    Raises:
        ValueError: an unknown name (the message lists the supported ones) or an empty list.
    """
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if names == ["all"]:
        return DEFAULT_POLICIES
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        problem = f"unknown policy {unknown[0]!r}" if unknown else "no policy given"
        raise ValueError(f"{problem}; supported: {', '.join(POLICIES)} (or 'all')")
    return tuple(dict.fromkeys(names))


def with_host_kv_policies(policies: Sequence[str], *, with_stock: bool = True) -> tuple[str, ...]:
    """``policies`` plus what ``--host-kv-gib`` adds: each named policy's host-tier variant
    (:data:`OFFLOAD_VARIANTS`) right after it, then stock vLLM's tier
    (:data:`STOCK_OFFLOAD_POLICIES`) unless ``with_stock`` is False (``plan``: the variants
    only). Pure.

    >>> with_host_kv_policies(("fcfs", "mars", "vllm-tuned"))
    ('fcfs', 'vllm-offload-lru', 'mars', 'mars-offload', 'vllm-tuned', 'vllm-offload-arc')
    >>> with_host_kv_policies(("fcfs", "mars"), with_stock=False)
    ('fcfs', 'vllm-offload-lru', 'mars', 'mars-offload')
    """
    out = [n for name in policies for n in (name, OFFLOAD_VARIANTS.get(name)) if n]
    return tuple(dict.fromkeys((*out, *(STOCK_OFFLOAD_POLICIES if with_stock else ()))))


def reference_tag(name: str) -> str | None:
    """How reports mark a reference's rows after its name: ``"limit"`` for the unbounded-KV
    reference, ``"free copies (tier bound)"`` for a tier bound, ``None`` for a policy or a name not
    in the registry. ``name``: a policy or a run label (``mars-offload-free+adm``). Pure.

    >>> reference_tag("unbounded-kv"), reference_tag("mars-offload-free+adm"), reference_tag("mars-offload")
    ('limit', 'free copies (tier bound)', None)
    """
    spec = POLICIES.get(name.removesuffix("+adm"))
    if spec is None:
        return None
    return "limit" if spec.is_kv_unbounded else "free copies (tier bound)" if spec.is_tier_bound else None


def admission_modes(admission: str, policy: str) -> tuple[bool, ...]:
    """Admission-window settings to run ``policy`` with under ``--admission``. Pure.

    >>> admission_modes("auto", "mars"), admission_modes("auto", "fcfs"), admission_modes("both", "fcfs")
    ((True,), (False,), (False, True))
    """
    if POLICIES[policy].is_kv_unbounded:
        return (False,)
    if admission == "auto":
        return (POLICIES[policy].has_control_plane,)
    return {"off": (False,), "on": (True,), "both": (False, True)}[admission]


def merge_config(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of two JSON-like dicts (``extra`` wins). Pure.

    >>> merge_config({"mars": {"a": 1, "b": {"c": 2}}}, {"mars": {"b": {"d": 3}}})
    {'mars': {'a': 1, 'b': {'c': 2, 'd': 3}}}
    """
    out = dict(base)
    for key, value in extra.items():
        out[key] = (merge_config(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
                    else value)
    return out


def takes_mars_config(policy: str) -> bool:
    """Whether ``compare --mars-config`` reaches ``policy``: it runs ``MarsScheduler`` (``mars``,
    its variants, ``mars-offload``). Pure.

    Raises:
        KeyError: ``policy`` is not in the registry.
    """
    return POLICIES[policy].scheduler == "MarsScheduler"


def policy_additional_config(policy: str, mars_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``policy``'s vLLM ``--additional-config``: its registry entry's, with ``mars_config``
    (``compare --mars-config``: keys of ``SchedulerParams``) merged into the ``mars`` section when
    the policy runs ``MarsScheduler`` (``mars`` and its variants); other policies are unchanged. Pure.

    >>> policy_additional_config("mars-mlfq", {"residency": {"order": "response-ratio"}})
    {'mars': {'mars': {'mlfq': True}, 'residency': {'order': 'response-ratio'}}}
    >>> policy_additional_config("thunderagent", {"residency": {"order": "response-ratio"}})
    {}

    Raises:
        KeyError: ``policy`` is not in the registry.
    """
    spec = POLICIES[policy]
    if not mars_config or not takes_mars_config(policy):
        return dict(spec.additional_config)
    return merge_config(spec.additional_config, {"mars": mars_config})


def live_policy_config(mars_config: Mapping[str, Any] | None = None,
                       ) -> dict[str, tuple[str, Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]]:
    """``LiveBackend``'s ``policy_config``: name -> (scheduler, additional config, engine, admission
    settings), with ``mars_config`` as in :func:`policy_additional_config`. Pure."""
    return {name: (p.scheduler, policy_additional_config(name, mars_config), p.engine, p.admission)
            for name, p in POLICIES.items()}


def unbounded_kv_blocks(workload: Workload, block_size: int = 16) -> int:
    """KV blocks that hold every session's whole context at once: the unbounded-KV reference. Pure.

    Per session ``ceil(context / block_size) + 1`` blocks (its final context plus the block a
    decode step may open), summed over the sessions. Shape: one int, blocks of ``block_size``
    tokens.
    """
    return sum(-(-s.max_context_tokens // block_size) + 1 for s in workload.sessions)

