"""PolicyHooks (which hooks a class overrides) and the shared RequestState transitions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from mars_openhands.engine.schedulers.autellix import AutellixScheduler  # noqa: E402
from mars_openhands.engine.schedulers.base import MarsBaseScheduler  # noqa: E402
from mars_openhands.engine.schedulers.fcfs import FcfsScheduler  # noqa: E402
from mars_openhands.engine.schedulers.hooks import PolicyHooks, is_overridden  # noqa: E402
from mars_openhands.engine.schedulers.request_state import (  # noqa: E402
    RequestState,
    reset_mlfq,
    update_mlfq_feedback,
)
from mars_openhands.policy.params import LevelParams  # noqa: E402
from mars_openhands.policy.types import TurnMeta  # noqa: E402


def test_is_overridden_sees_only_the_policy_class_hooks() -> None:
    assert issubclass(MarsBaseScheduler, PolicyHooks)
    assert not any(is_overridden(FcfsScheduler, h) for h in ("waiting_key", "victim_key", "on_step_start"))
    assert is_overridden(AutellixScheduler, "waiting_key") and is_overridden(AutellixScheduler, "on_scheduled")
    assert not is_overridden(AutellixScheduler, "on_step_start")
    with pytest.raises(AttributeError):
        is_overridden(FcfsScheduler, "not_a_hook")


def test_default_key_hooks_raise_so_they_are_never_called_by_accident() -> None:
    hooks = PolicyHooks()
    with pytest.raises(NotImplementedError):
        hooks.waiting_key(None, 0.0)  # type: ignore[arg-type]
    assert hooks.chunk_tokens(None, 7, 0) == 7  # type: ignore[arg-type]


def test_the_classes_that_merge_runs_declare_it_through_the_run_contract() -> None:
    """Merged runs (coalesce.py): a class allows them by implementing ``MergesRuns`` (ours list
    ``CertifiedRuns`` first); the others, and the policy hooks, know nothing of them."""
    from mars_openhands.engine import (
        ContinuumScheduler,
        InferceptScheduler,
        MarsPreviewScheduler,
        MarsScheduler,
        ThunderAgentScheduler,
    )
    from mars_openhands.engine.schedulers.coalesce import CertifiedRuns, MergesRuns

    merging = {AutellixScheduler, ContinuumScheduler, InferceptScheduler, MarsPreviewScheduler,
               MarsScheduler, ThunderAgentScheduler}
    for cls in (*merging, FcfsScheduler, MarsBaseScheduler):
        assert issubclass(cls, MergesRuns) == issubclass(cls, CertifiedRuns) == (cls in merging), cls
    assert not any(name.startswith(("run_", "blocked_run")) for name in vars(PolicyHooks))


def test_mlfq_feedback_and_reset() -> None:
    state = RequestState("s", TurnMeta(), arrival_s=0.0, quantum_tokens=2048)
    request = SimpleNamespace(num_prompt_tokens=10_000, num_computed_tokens=2048, num_tokens=10_000)
    update_mlfq_feedback(state, request, 2048, 3.0, LevelParams())
    assert (state.feedback_level, state.mlfq_last_scheduled_s) == (1, 3.0)
    reset_mlfq(state)
    assert (state.feedback_level, state.mlfq_last_scheduled_s) == (0, None)
