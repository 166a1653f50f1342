"""``compare --replicas / --router / --lose-replica`` (eval/compare.py) and the sessions drawn with
replacement for them (eval/workloads/transform.draw_sessions)."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest
from compare_helpers import small_workload

from eval.compare import _replica_workload, add_compare_subcommand
from eval.compare_setup import trim_note
from eval.runs import arrivals
from eval.sweep_options import CompareOptions
from eval.workloads import Workload, draw_sessions, trim_workload
from eval.workloads.format import Session


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mars-openhands")
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    return parser


def test_draw_sessions_is_seeded_with_replacement_and_gives_each_copy_its_own_id() -> None:
    workload = small_workload()
    drawn = draw_sessions(workload, 50, seed=3)
    assert len(drawn.sessions) == 50
    ids = [s.session_id for s in drawn.sessions]
    assert len(set(ids)) == 50
    originals = Counter(sid.rpartition("~")[0] for sid in ids)
    assert set(originals) <= {s.session_id for s in workload.sessions}
    assert max(originals.values()) > 1  # with replacement
    by_id = {s.session_id: s for s in workload.sessions}
    assert all(s.turns == by_id[s.session_id.rpartition("~")[0]].turns for s in drawn.sessions)
    assert draw_sessions(workload, 50, seed=3) == drawn
    assert draw_sessions(workload, 50, seed=4) != drawn
    with pytest.raises(ValueError, match="num_sessions >= 1"):
        draw_sessions(workload, 0)


def test_rates_stay_per_gpu_and_arrivals_scale_with_the_replicas() -> None:
    options = CompareOptions(num_gpu_blocks=64, num_replicas=4)
    assert arrivals(0.01, options).rate_per_s == pytest.approx(0.04)
    assert arrivals(0.01, options.model_copy(update={"num_replicas": 1})).rate_per_s == 0.01


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "2", "--backend", "emulated"], "several replicas run only in the simulator"),
    (["--lose-replica", "0@10"], "--lose-replica 0@10: needs --replicas >= 2"),
    (["--replicas", "2", "--lose-replica", "2@10"], "an index below it"),
    (["--replicas", "2", "--router", "pooled-kv", "--lose-replica", "1@10"], "share one KV pool"),
    (["--router", "pooled-kv"], "--router pooled-kv: the pooled-KV bound exists only in the simulator"),
    (["--router", "pooled-kv", "--backend", "http://127.0.0.1:9", "--policies", "mars", "--absolute-rates", "--loads", "0.01"], "exists only in the simulator over"),
    (["--host-kv-gib", "1e9"], "--host-kv-gib"),
    (["--router", "least-sessions"], "--router: needs --replicas >= 2 (got --replicas 1)"),
    (["--sessions-per-replica", "3"], "--sessions-per-replica: needs --replicas >= 2"),
    (["--replica-gpus", "h100_sxm,a100"], "--replica-gpus: unknown GPU 'a100'"),
    (["--kv-transfer-gbps", "50"], "--kv-transfer-gbps 50: needs --replicas >= 2"),
    (["--replicas", "2", "--router", "pooled-kv", "--kv-transfer-gbps", "50"], "share one KV pool"),
])
def test_replica_flags_are_checked_before_anything_runs(argv, message, capsys, tmp_path) -> None:
    args = _parser().parse_args(["compare", *argv, "--out", str(tmp_path / "out")])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--lose-replica", "1"), ("--lose-replica", "x@3"),
                                             ("--router", "round-robin"), ("--replicas", "0")])
def test_bad_replica_values_are_rejected_at_parsing(flag, value) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["compare", flag, value])


def test_a_mix_of_gpu_profiles_is_one_setup_with_a_timer_and_kv_per_replica() -> None:
    from eval.compare import _mixed_setup
    from eval.sweep_options import GpuSetup, real_timer

    setups = [GpuSetup("h100_sxm", "t100", 700, "h100"), GpuSetup("h200_sxm", "t200", 4000, "h200")]
    (mixed,), blocks = _mixed_setup(("h100_sxm", "h200_sxm", "h200_sxm"), setups)
    assert mixed.step_timer == ("t100", "t200", "t200") and blocks == (700, 4000, 4000)
    assert mixed.num_gpu_blocks == 700 and mixed.gpu == "h100_sxm+h200_sxm+h200_sxm"
    assert real_timer(mixed.step_timer) == ["t100", "t200", "t200"]


def test_the_replicas_fact_names_a_mix_by_its_gpus_not_each_gpu_flag() -> None:
    from eval.compare import replicas_fact

    base = dict(router="llm-d", seed=3, lose_replica=None)
    mixed = replicas_fact(argparse.Namespace(replicas=3, gpu=["h100_sxm", "h200_sxm"],
                                             replica_gpus=("h100_sxm", "h200_sxm", "h200_sxm"), **base), 300)
    assert mixed.startswith("3 replicas (h100_sxm+h200_sxm+h200_sxm), router llm-d;") and "--gpu" not in mixed
    same = replicas_fact(argparse.Namespace(replicas=4, gpu=["h100_sxm"], replica_gpus=None,
                                            **{**base, "lose_replica": (1, 60.0)}), 400)
    assert same.startswith("4 x h100_sxm, router llm-d") and same.endswith("(seed 3); replica 1 lost at 60 s")
    moving = replicas_fact(argparse.Namespace(replicas=4, gpu=["h100_sxm"], replica_gpus=None,
                                              kv_transfer_gb_s=50.0, **base), 400)
    assert moving.endswith("a moved session's KV goes along at 50 GB/s (--kv-transfer-gbps), not re-prefilled")


def test_the_kv_transfer_reaches_the_simulator_and_the_cache_key() -> None:
    from eval.runs import sim_config

    options = CompareOptions(num_gpu_blocks=64, num_replicas=2, router="mars-placement", policies=("mars",),
                             kv_transfer_gb_s=50.0, kv_bytes_per_token=98_304)
    config = sim_config(options, "mars", True)
    assert (config.kv_transfer_gb_s, config.kv_bytes_per_token) == (50.0, 98_304)
    plain = options.model_copy(update={"kv_transfer_gb_s": None})
    assert sim_config(plain, "mars", True).kv_transfer_gb_s is None
    assert plain.kv_transfer_key() == ()  # keys of earlier results stay valid
    assert options.kv_transfer_key() not in ((), options.model_copy(update={"kv_transfer_gb_s": 25.0}).kv_transfer_key())


def test_replica_gpus_set_the_replicas_and_refuse_a_conflicting_count(capsys, tmp_path) -> None:
    args = _parser().parse_args(["compare", "--replica-gpus", "h100_sxm,h200_sxm", "--replicas", "3",
                                 "--out", str(tmp_path / "out")])
    assert args.func(args) == 2
    assert "sets --replicas and --gpu" in capsys.readouterr().err


def _uneven_pool() -> Workload:
    """4 sessions of 2, 4, 6 and 8 turns (20 in all): a draw's turns differ from the pool's."""
    base = small_workload(4, 8)
    return base.model_copy(update={"sessions": tuple(
        Session(session_id=s.session_id, arrival_s=0.0, turns=s.turns[-2 * (i + 1):])
        for i, s in enumerate(base.sessions))})


@pytest.mark.parametrize(("max_turns", "per_replica"), [(3, 3), (None, 3), (None, 100)])
def test_the_replica_scope_line_counts_the_drawn_sessions_and_their_turns(max_turns, per_replica) -> None:
    full = _uneven_pool()
    pool = trim_workload(full, max_turns=max_turns)
    args = argparse.Namespace(sessions_per_replica=per_replica, replicas=2, seed=5)
    drawn, scope = _replica_workload(args, pool, trim_note(full, pool))
    assert drawn == draw_sessions(pool, 2 * per_replica, 5)
    assert drawn.num_turns not in (pool.num_turns, full.num_turns)  # the draw's own count
    head = (f"{2 * per_replica} sessions ({drawn.num_turns} turns) drawn with replacement (seed 5) for "
            f"2 replicas, {per_replica} per replica")
    if max_turns is not None:  # the pool's cut follows, named as the pool's
        assert scope.startswith(f"TRIMMED: {head} (fewer than 100), from a pool of 4 sessions ("
                                f"{pool.num_turns} turns), cut: {pool.num_turns} of 20 turns (turn or context cap). "
                                "A quick look"), scope
    elif per_replica < 100:
        assert scope.startswith(f"TRIMMED: {head} (fewer than 100), from all 4 sessions at full length (20 turns) "
                                "on the whole GPU's KV. A quick look, not the real regime: claims need 100 "
                                "sessions per replica"), scope
    else:
        assert scope == (f"Full workload: {head}, from all 4 sessions at full length (20 turns) on the whole "
                         "GPU's KV, no trimming.")
