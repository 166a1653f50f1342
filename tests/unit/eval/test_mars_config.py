"""``compare --mars-config``: scheduler keys for the mars policies only, checked at parsing, part of
the cache key and named in the scope line (eval/policies.py, eval/compare.py, eval/sweep.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from eval.compare import add_compare_subcommand
from eval.policies import POLICIES, live_policy_config, policy_additional_config
from eval.sweep_options import CompareOptions

RR = {"residency": {"order": "response-ratio", "response_ratio_prior_s": 120.0}}
TRACE = Path(__file__).parents[2] / "fixtures" / "traces" / "good"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mars-openhands")
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["compare", *argv])
    return args.func(args)


def test_it_reaches_every_mars_scheduler_policy_and_no_other() -> None:
    for name, spec in POLICIES.items():
        merged = policy_additional_config(name, RR)
        if spec.scheduler == "MarsScheduler":
            assert merged["mars"]["residency"].items() >= RR["residency"].items(), name
        else:
            assert merged == dict(spec.additional_config), name
    # the variants keep their own keys beside it, and the registry is not changed by a merge
    assert policy_additional_config("mars-mlfq", RR)["mars"]["mars"] == {"mlfq": True}
    assert policy_additional_config("mars-no-coscheduler", RR)["mars"]["residency"]["enabled"] is False
    assert "residency" not in POLICIES["mars"].additional_config.get("mars", {})
    assert live_policy_config(RR)["mars"][1]["mars"]["residency"]["order"] == "response-ratio"
    assert live_policy_config(RR)["thunderagent"][1] == live_policy_config()["thunderagent"][1]


def test_it_changes_the_run_cache_key_only_when_given() -> None:
    plain = CompareOptions(policies=("mars",), num_gpu_blocks=64)
    assert plain.mars_config_key() == ()  # keys of earlier results stay valid
    given = plain.model_copy(update={"mars_config": RR})
    other = plain.model_copy(update={"mars_config": {"residency": {"order": "fifo"}}})
    assert given.mars_config_key() != other.mars_config_key() and given.mars_config_key() != ()


@pytest.mark.parametrize(("value", "expected"), [
    ("{not json", "argument --mars-config: expected a JSON object"),
    ("[1, 2]", "argument --mars-config: expected a JSON object {...}"),
])
def test_a_value_that_is_not_a_json_object_fails_at_parsing(value, expected, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _run(["--mars-config", value])
    assert info.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize(("config", "names"), [
    ({"residency": {"ordr": "fifo"}}, "unknown key 'mars.residency.ordr'; did you mean 'order'? 'mars.residency' takes: enabled,"),
    ({"residency": {"order": "lifo"}}, "mars.residency.order: Input should be 'fifo' or 'response-ratio'"),
])
def test_an_unknown_key_or_bad_value_is_one_line_naming_it(config, names, tmp_path, capsys) -> None:
    assert _run(["--mars-config", json.dumps(config), "--policies", "mars", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mars-openhands compare: error: --mars-config: ") and names in err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("policies", ["fcfs", "fcfs,continuum,thunderagent"])
def test_it_without_a_mars_policy_is_one_line_and_writes_nothing(policies, tmp_path, capsys) -> None:
    """It reached no policy and was dropped without a word. (A missing --traces: had the check not
    come first, the run would end at once on that instead of running a sweep.)"""
    assert _run(["--mars-config", json.dumps(RR), "--policies", policies, "--out", str(tmp_path / "o"),
                 "--traces", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mars-openhands compare: error: --mars-config: only the mars policies take it (mars, ")
    assert "add mars (or a variant) to --policies, or drop --mars-config" in err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_a_mars_policy_that_only_ablations_or_the_host_tier_add_takes_it() -> None:
    from eval.compare import checked_mars_config

    assert checked_mars_config(RR, ("fcfs", "mars-mlfq")) == RR  # as --policies fcfs --ablations runs
    assert checked_mars_config(RR, ("fcfs", "mars-offload")) == RR
    assert checked_mars_config(None, ("fcfs",)) == {}


def test_a_run_uses_it_and_the_scope_line_names_it(tmp_path, sim) -> None:
    pytest.importorskip("vllm")
    from eval.runs import sim_config

    options = CompareOptions(policies=("mars", "thunderagent"), num_gpu_blocks=64, mars_config=RR)
    mars = sim_config(options, "mars", True).engine.additional_config
    assert mars["mars"]["residency"]["order"] == "response-ratio"
    assert sim_config(options, "thunderagent", False).engine.additional_config == {}
    out = tmp_path / "out"
    code = _run(["--traces", str(TRACE), "--policies", "mars,thunderagent", "--mars-config", json.dumps(RR),
                 "--absolute-rates", "--loads", "0.5", "--no-reference", "--sessions", "1", "--max-turns", "3",
                 "--gpu", "h100_sxm", "--jobs", "1", "--no-cache", "--out", str(out)])
    assert code == 0
    scope = json.loads((out / "run.json").read_text())["facts"]["scope"]
    assert ('mars config: {"residency": {"order": "response-ratio", "response_ratio_prior_s": 120.0}} '
            "(compare --mars-config) for mars.") in scope


def test_a_live_backend_gets_it_too() -> None:
    pytest.importorskip("vllm")
    from compare_helpers import small_workload

    import eval.compare as compare
    from eval.backends import parse_backend
    from eval.compare_setup import _live_setup

    parser = argparse.ArgumentParser(prog="mars-openhands")
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["compare", "--backend", "emulated", "--mars-config", json.dumps(RR)])
    spec = parse_backend(args.backend)
    compare._apply_defaults(args, spec)
    live, _, _ = _live_setup(args, spec, small_workload(), 512, "timing")
    assert live.policy_config["mars"][1]["mars"]["residency"] == RR["residency"]
    assert live.policy_config["thunderagent"][1] == POLICIES["thunderagent"].additional_config
