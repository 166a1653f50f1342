"""``compare``'s deployment flags (eval/deployment.py, issue 31): ``--model`` with its own weight
dtype, ``--kv-cache-dtype``, ``--gpu-memory-utilization``; their one-line errors, and the scope
line and facts every report carries."""

from __future__ import annotations

import argparse
import json

import pytest
from compare_helpers import small_workload

from eval.compare import add_compare_subcommand
from eval.deployment import Deployment, deployment_from_args, parse_model
from eval.workloads.format import save_workload

PREFIX = "mars-openhands compare: error: "


def _parser() -> argparse.ArgumentParser:
    from mars_openhands.cli_style import CliParser

    parser = CliParser(prog="mars-openhands")
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(["compare", *argv])
    return args.func(args)


@pytest.mark.parametrize(("text", "key"), [
    ("qwen3-coder-30b-a3b-instruct", ("qwen3-coder-30b-a3b-instruct", "bf16")),
    ("gpt-oss-120b", ("gpt-oss-120b", "mxfp4")),  # its only weights: no bf16 profile exists
    ("qwen3-30b-a3b", ("qwen3-30b-a3b", "bf16")),  # bf16 where a model has several
    ("qwen3-30b-a3b/fp8", ("qwen3-30b-a3b", "fp8")),
])
def test_model_names_a_profile_with_its_own_weight_dtype(text: str, key: tuple[str, str]) -> None:
    assert parse_model(text) == key


def test_an_explicit_kv_dtype_equal_to_the_models_own_is_the_default_deployment() -> None:
    args = _parser().parse_args(["compare", "--kv-cache-dtype", "bf16"])
    assert deployment_from_args(args) == Deployment() == deployment_from_args(_parser().parse_args(["compare"]))
    fp8 = deployment_from_args(_parser().parse_args(["compare", "--kv-cache-dtype", "fp8",
                                                     "--gpu-memory-utilization", "0.95"]))
    assert (fp8.kv_cache_dtype, fp8.kv_dtype, fp8.kv_bytes_per_token, fp8.gpu_memory_utilization) == (
        "fp8", "fp8", 49_152, 0.95)
    assert fp8.describe() == ("Deployment: qwen3-coder-30b-a3b-instruct (bf16 weights), KV cache fp8 "
                              "(48 KiB/token), gpu-memory-utilization 0.95.")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype: invalid choice: 'fp4' (choose from 'bf16', 'fp8')"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: expected a fraction in (0, 1] of the "
                                          "GPU's memory (vLLM's default 0.9), got '1.5'"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization: expected a fraction in (0, 1] of the "
                                        "GPU's memory (vLLM's default 0.9), got '0'"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization: expected a fraction in (0, 1] of the "
                                          "GPU's memory (vLLM's default 0.9), got 'nan'"),
    (["--gpu-memory-utilization", "most"], "--gpu-memory-utilization: expected a fraction in (0, 1], got 'most'"),
])
def test_bad_deployment_values_are_one_line_naming_the_flag(tmp_path, capsys, argv, expected) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _run([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == PREFIX + expected + "\n"


@pytest.mark.parametrize(("model", "expected"), [
    ("llama-70b", "--model: unknown model 'llama-70b'; choose one of gpt-oss-120b (mxfp4), qwen3-30b-a3b "
                  "(bf16/fp8), qwen3-coder-30b-a3b-instruct (bf16)"),
    ("gpt-oss-120b/bf16", "--model: gpt-oss-120b has no 'bf16' weights; choose one of gpt-oss-120b/mxfp4"),
])
def test_unknown_model_is_one_line_listing_the_profiles(tmp_path, capsys, model, expected) -> None:
    assert _run(["--model", model, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == PREFIX + expected + "\n"
    assert not (tmp_path / "out").exists()


def _tiny_compare(tmp_path, *flags: str) -> tuple[str, dict]:
    workload = tmp_path / "w.json"
    save_workload(small_workload(2, 2), workload)
    out = tmp_path / "out"
    code = _run(["--workload", str(workload), "--policies", "fcfs", "--base-rate", "0.5", "--loads", "1",
                 "--gpu", "h100_sxm", "--jobs", "1", "--no-reference", "--no-cache", "--out", str(out), *flags])
    assert code == 0
    return (out / "summary.md").read_text(), json.loads((out / "run.json").read_text())["facts"]


def test_gpt_oss_120b_runs_a_tiny_compare_end_to_end(tmp_path, sim) -> None:
    summary, facts = _tiny_compare(tmp_path, "--model", "gpt-oss-120b")
    scope = "Deployment: gpt-oss-120b (mxfp4 weights), KV cache bf16 (36 KiB/token), gpu-memory-utilization 0.9."
    assert scope in summary.splitlines()[2] and scope in facts["scope"]
    assert (facts["model"], facts["kv cache dtype"], facts["kv bytes per token"]) == ("gpt-oss-120b/mxfp4", "bf16",
                                                                                      36_864)
    # the whole GPU's KV at 36,864 B/token: 2.7x Qwen3-Coder's 7,396 blocks on an H100 SXM
    assert "KV 19748 blocks = the whole GPU" in facts["timing"]


def test_fp8_kv_and_memory_utilization_set_the_kv_blocks_and_the_scope(tmp_path, sim) -> None:
    summary, facts = _tiny_compare(tmp_path, "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.95")
    assert "KV cache fp8 (48 KiB/token), gpu-memory-utilization 0.95." in summary.splitlines()[2]
    assert (facts["kv cache dtype"], facts["gpu memory utilization"]) == ("fp8", 0.95)
    assert "KV 20254 blocks = the whole GPU" in facts["timing"]  # 10,127 bf16 blocks at 0.95, twice


def test_the_emulated_server_gets_the_deployment(tmp_path) -> None:
    from eval.backends import LiveBackend, LiveOptions, parse_backend
    from eval.policies import POLICIES

    emulated = pytest.importorskip("mars_openhands.engine.harness.executor.emulated")
    config = {name: (p.scheduler, p.additional_config) for name, p in POLICIES.items()}
    options = LiveOptions(num_gpu_blocks=900, max_model_len_tokens=4096, model="gpt-oss-120b", dtype="mxfp4",
                          kv_cache_dtype="fp8", gpu_memory_utilization=0.95)
    with LiveBackend(parse_backend("emulated"), options, config) as backend:
        gpu = backend.server_options("fcfs", tmp_path).additional_config["emulated_gpu"]
    profile = emulated.EmulatedGpuConfig(**gpu)  # what the executor parses from --additional-config
    assert (profile.model, profile.dtype, profile.kv_cache_dtype, profile.gpu_memory_utilization) == (
        "gpt-oss-120b", "mxfp4", "fp8", 0.95)
    assert profile.kv_bytes_per_token == 18_432
