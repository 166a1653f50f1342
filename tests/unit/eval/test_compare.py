"""``mars-openhands compare`` (eval/compare.py, eval/sweep.py, eval/policies.py) on the sim backend, and the
live-backend plumbing (eval/backends.py)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
import pytest

try:  # module level: FastAPI resolves the fake server's string annotation here
    from fastapi import Request
except ImportError:  # pragma: no cover - the URL-backend test skips then
    Request = None  # type: ignore[assignment,misc]

from compare_helpers import small_workload

from eval.compare import add_compare_subcommand
from eval.compare_setup import kv_scale_for_trim
from eval.knee import find_base_rate
from eval.policies import (
    ABLATIONS,
    DEFAULT_POLICIES,
    HOST_KV_POLICIES,
    POLICIES,
    REFERENCE,
    admission_modes,
    live_policy_config,
    parse_policies,
)
from eval.runs import plan, sim_config
from eval.sweep import run_compare
from eval.sweep_options import CompareOptions


def test_parse_policies_all_and_dedup() -> None:
    assert parse_policies("all") == DEFAULT_POLICIES == tuple(
        n for n in POLICIES if n not in (*ABLATIONS, REFERENCE, *HOST_KV_POLICIES))
    assert HOST_KV_POLICIES == ("vllm-offload-lru", "vllm-offload-arc", "continuum-offload",
                                "thunderagent-offload", "mars-offload", "mars-offload-free")
    assert parse_policies("mars, fcfs,mars") == ("mars", "fcfs")
    assert parse_policies("mars-mlfq,mars") == ("mars-mlfq", "mars")


def test_unknown_policy_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError) as info:
        parse_policies("fcfs,marz")
    message = str(info.value)
    assert "'marz'" in message
    for name in POLICIES:
        assert name in message


def test_knee_search_brackets_the_threshold() -> None:
    knee = 0.37
    calls: list[float] = []

    def slowdown(rate: float) -> float:
        calls.append(rate)
        return 1.2 if rate <= knee else 5.0

    search = find_base_rate(slowdown, 0.01, bound=2.0, max_runs=12)
    assert knee / 1.05 <= search.rate_per_s <= knee
    assert len(calls) == len(search.probes) <= 12
    assert all(stable == (r <= knee) for r, _, stable in search.probes)
    assert "largest stable rate" in search.how and search.is_bracketed


def test_knee_search_respects_budget_and_goes_down_when_start_is_unstable() -> None:
    search = find_base_rate(lambda r: math.inf if r > 0.1 else 1.0, 1.0, bound=2.0, max_runs=3)
    assert [p[0] for p in search.probes] == [1.0, 0.5, 0.25]
    assert search.rate_per_s == 0.25 and "no stable rate" in search.how
    assert not search.is_bracketed
    search = find_base_rate(lambda r: 1.0, 1.0, bound=2.0, max_runs=3)
    assert search.rate_per_s == 4.0 and "no unstable rate" in search.how
    assert not search.is_bracketed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    return parser


def test_cli_rejects_unknown_backend_and_unknown_policy(tmp_path, capsys) -> None:
    args = _parser().parse_args(["compare", "--backend", "gpu", "--out", str(tmp_path)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "unknown backend 'gpu'" in err and "emulated" in err and "http" in err
    args = _parser().parse_args(["compare", "--policies", "fcfs,nope", "--out", str(tmp_path)])
    assert args.func(args) == 2
    assert "nope" in capsys.readouterr().err


def test_cli_rejects_bad_loads() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["compare", "--loads", "0.5,x"])


# ----------------------------------------------------------------------------- end to end (sim)
def test_run_compare_writes_everything_and_survives_a_failing_policy(tmp_path, sim) -> None:
    def flaky(workload, config, timer, sink=None):
        if config.policy == "MarsScheduler":
            raise RuntimeError("injected failure")
        return sim.simulate(workload, config, timer, sink)

    options = CompareOptions(policies=("fcfs", "mars", "continuum-dy"), loads=(0.5, 2.0),
                             num_gpu_blocks=512, base_rate_per_s=1.0, admission="off")
    results = run_compare(small_workload(), options, sim.LinearStepTimeModel(), tmp_path, simulate_fn=flaky)
    assert len(results) == 6
    assert set(zip(results["label"], results["load_x"], strict=True)) == {
        (p, x) for p in ("fcfs", "mars", "continuum-dy") for x in (0.5, 2.0)}
    failed = results.loc[results["status"] == "failed"]
    assert set(failed["label"]) == {"mars"} and failed["error"].str.contains("injected failure").all()
    ok = results.loc[results["status"] == "ok"]
    assert (ok["num_completed"] == 4).all()
    assert (ok["slowdown_mean"] >= 0.99).all() and (ok["e2e_p99_s"] >= ok["e2e_p50_s"]).all()
    assert list(ok["rate_per_s"]) == [0.5, 0.5, 2.0, 2.0]
    for run_id in ok["run_id"]:
        per_session = pd.read_parquet(tmp_path / f"{run_id}.parquet")
        assert len(per_session) == 4 and {"e2e_s", "slowdown", "ideal_s"} <= set(per_session.columns)
    assert not (tmp_path / "mars__load0.5.parquet").exists()
    text = (tmp_path / "summary.md").read_text()
    assert "| mars | FAILED |" in text and "injected failure" in text
    assert "1 sessions/s (given with --base-rate)" in text
    for name in ("e2e_vs_load.png", "e2e_cdf.png", "goodput_vs_alpha.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_run_compare_searches_the_base_rate_and_runs_admission_both(tmp_path, sim) -> None:
    options = CompareOptions(policies=("fcfs",), loads=(1.0,), num_gpu_blocks=512, admission="both",
                             search_max_runs=3, knee_slowdown=1.5)
    results = run_compare(small_workload(), options, sim.LinearStepTimeModel(), tmp_path)
    assert list(results["label"]) == ["fcfs", "fcfs+adm"]
    assert (results["status"] == "ok").all()
    text = (tmp_path / "summary.md").read_text()
    assert "FCFS knee search: 3 runs" in text
    rate = results["rate_per_s"].iloc[0]
    assert f"{rate:.4g} sessions/s" in text


def test_kv_scale_for_trim_is_the_kept_context_share() -> None:
    from eval.workloads import trim_workload

    full = small_workload(n=2, turns=3)
    trimmed = trim_workload(full, max_turns=1)
    kept = sum(s.turns[0].prompt_tokens_appended + s.turns[0].output_tokens for s in full.sessions)
    total = sum(t.prompt_tokens_appended + t.output_tokens for s in full.sessions for t in s.turns)
    assert kv_scale_for_trim(full, trimmed) == pytest.approx(kept / total)
    assert kv_scale_for_trim(full, full) == 1.0
    with pytest.raises(ValueError, match="not in the full workload"):
        kv_scale_for_trim(trim_workload(full, num_sessions=1), full)


# ----------------------------------------------------------------------------- live backends (plumbing)
def test_parse_backend_names_and_urls() -> None:
    from eval.backends import parse_backend

    assert [parse_backend(k).kind for k in ("sim", "emulated", " cpu ")] == ["sim", "emulated", "cpu"]
    assert not parse_backend("sim").is_live and parse_backend("cpu").is_live
    spec = parse_backend("http://127.0.0.1:8000/v1/")
    assert (spec.kind, spec.url, spec.label) == ("url", "http://127.0.0.1:8000", "http://127.0.0.1:8000")
    assert parse_backend("https://example.org/").url == "https://example.org"
    for bad, fragment in (("gpu", "unknown backend 'gpu'"), ("ftp://x", "unknown backend"),
                          ("http://", "has no host"), ("http://h:port", "bad port")):
        with pytest.raises(ValueError, match=fragment):
            parse_backend(bad)


@pytest.mark.parametrize(("backend", "policies", "admission", "scale", "has_base", "fragment"), [
    ("http://h:1", ("fcfs", "mars"), "off", 1.0, True, "exactly that one"),
    ("http://h:1", (), "off", 1.0, True, "got none"),
    ("http://h:1", ("mars",), "both", 1.0, True, "cannot switch the admission"),
    ("cpu", ("fcfs",), "off", 0.5, True, "needs --backend emulated"),
    ("sim", ("fcfs",), "off", 0.5, True, "needs --backend emulated"),
    ("cpu", ("fcfs",), "off", 1.0, False, "needs --absolute-rates or --base-rate"),
    ("http://h:1", ("fcfs",), "off", 1.0, False, "needs --absolute-rates or --base-rate"),
    ("emulated", ("fcfs",), "off", 0.0, True, "positive"),
    ("emulated", ("fcfs",), "off", float("nan"), True, "positive"),
])
def test_check_live_options_rejects_with_the_fix(backend, policies, admission, scale, has_base,
                                                 fragment) -> None:
    from eval.backends import check_live_options, parse_backend

    with pytest.raises(ValueError, match=fragment):
        check_live_options(parse_backend(backend), policies, admission, scale, has_base)


def test_check_live_options_accepts_what_can_run() -> None:
    from eval.backends import check_live_options, parse_backend

    check_live_options(parse_backend("emulated"), ("fcfs", "mars"), "both", 0.25, False)  # sim knee
    check_live_options(parse_backend("cpu"), ("fcfs", "mars"), "both", 1.0, True)
    check_live_options(parse_backend("http://h:1"), ("mars",), "on", 1.0, True)
    check_live_options(parse_backend("sim"), ("fcfs",), "both", 1.0, False)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--backend", "http://127.0.0.1:9", "--policies", "fcfs,mars", "--base-rate", "1"], "exactly"),
    (["--backend", "cpu", "--time-scale", "0.5", "--base-rate", "1"], "needs --backend emulated"),
    (["--backend", "cpu", "--policies", "fcfs"], "needs --absolute-rates or --base-rate"),
    (["--backend", "emulated", "--time-scale", "-1"], "--time-scale must be a positive"),
])
def test_cli_rejects_bad_live_combinations_before_any_work(tmp_path, capsys, argv, fragment) -> None:
    args = _parser().parse_args(["compare", *argv, "--out", str(tmp_path / "out")])
    assert args.func(args) == 2
    assert fragment in capsys.readouterr().err.replace("\n", " ")
    assert not (tmp_path / "out").exists()


def test_live_runs_are_grouped_by_policy_for_one_server_each() -> None:
    from eval.backends import order_for_servers

    options = CompareOptions(policies=("fcfs", "mars"), loads=(0.5, 1.0), num_gpu_blocks=64,
                             admission="both", base_rate_per_s=2.0)
    sim_order = plan(options, 2.0)
    assert [r.policy for r in sim_order] == ["fcfs", "fcfs", "mars", "mars"] * 2  # by load (sim)
    live_order = order_for_servers(sim_order, options.policies)
    assert [r.run_id for r in live_order] == [
        "fcfs__load0.5", "fcfs+adm__load0.5", "fcfs__load1", "fcfs+adm__load1",
        "mars__load0.5", "mars+adm__load0.5", "mars__load1", "mars+adm__load1"]
    assert sorted(r.run_id for r in live_order) == sorted(r.run_id for r in sim_order)


def test_live_scheduler_names() -> None:
    from eval.backends import live_scheduler

    assert live_scheduler("fcfs") == "mars_openhands.engine.FcfsScheduler"  # stock + telemetry
    assert live_scheduler(POLICIES["mars"].scheduler) == "mars_openhands.engine.MarsScheduler"
    assert live_scheduler("pkg.mod.Cls") == "pkg.mod.Cls"


def test_server_options_per_backend(tmp_path) -> None:
    from eval.backends import EMULATED_EXECUTOR, LiveBackend, LiveOptions, parse_backend

    config = {name: (p.scheduler, p.additional_config) for name, p in POLICIES.items()}
    options = LiveOptions(num_gpu_blocks=900, max_model_len_tokens=4096, time_scale=0.25)
    with LiveBackend(parse_backend("emulated"), options, config) as backend:
        emulated = backend.server_options("continuum-dy", tmp_path)
        socket_dir = Path(emulated.additional_config["mars"]["inbox_addr"].removeprefix("ipc://")).parent
        assert socket_dir.is_dir() and len(str(socket_dir)) < 60  # ipc paths must stay short
    assert not socket_dir.exists()  # close() removed the temporary folder
    assert emulated.executor_backend == EMULATED_EXECUTOR
    assert emulated.scheduler_cls == "mars_openhands.engine.ContinuumScheduler"
    assert emulated.num_gpu_blocks_override == 900 and emulated.max_model_len == 4096
    assert (emulated.max_num_seqs, emulated.max_num_batched_tokens) == (256, 8192)  # the sim's shape
    extra = emulated.additional_config
    assert extra["mars"]["continuum"]["mode"] == "continuum-dy"  # the policy's own config kept
    assert extra["mars"]["telemetry"]["addr"].startswith("ipc://")
    assert extra["mars"]["inbox_addr"].startswith("ipc://")
    assert extra["emulated_gpu"]["time_scale"] == 0.25
    with LiveBackend(parse_backend("cpu"), options, config) as backend:
        cpu = backend.server_options("fcfs", tmp_path)
    assert cpu.executor_backend is None and cpu.block_size == 32
    assert "emulated_gpu" not in cpu.additional_config
    assert cpu.scheduler_cls == "mars_openhands.engine.FcfsScheduler"
    with pytest.raises(ValueError, match="sim"):
        LiveBackend(parse_backend("sim"), options, config)


def test_time_scaling_round_trip() -> None:
    from datetime import UTC, datetime, timedelta

    from eval.backends import scale_workload_time, unscale_events
    from mars_openhands.stream import events as ev

    w = small_workload(n=2, turns=3)
    w = w.model_copy(update={"sessions": tuple(s.model_copy(update={"arrival_s": 2.0 * i})
                                               for i, s in enumerate(w.sessions))})
    scaled = scale_workload_time(w, 0.1)
    assert [s.arrival_s for s in scaled.sessions] == pytest.approx([0.0, 0.2])
    assert scaled.sessions[0].turns[0].tool_duration_s == pytest.approx(0.1 * w.sessions[0].turns[0].tool_duration_s)
    assert scaled.sessions[0].turns[-1].tool_duration_s == 0.0
    assert scaled.sessions[0].turns[0].output_tokens == w.sessions[0].turns[0].output_tokens
    assert scale_workload_time(w, 1.0) is w
    with pytest.raises(ValueError):
        scale_workload_time(w, 0.0)

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    events = [
        ev.SessionStart(t_wall=t0, t_mono_ns=10**9, session_id="s0", turn=0, source="replay"),
        ev.ToolEnd(t_wall=t0 + timedelta(seconds=0.3), t_mono_ns=10**9 + 3 * 10**8, session_id="s0",
                   turn=0, source="replay", tool_name="bash", tool_call_id="c", duration_s=0.2),
        ev.RequestFirstToken(t_wall=t0 + timedelta(seconds=0.5), t_mono_ns=10**9 + 5 * 10**8,
                             session_id="s0", turn=1, source="engine:0", request_id="r", ttft_s=0.05),
    ]
    back = unscale_events(events, t0, 10**9, 0.1)
    assert [(e.t_wall - t0).total_seconds() for e in back] == pytest.approx([0.0, 3.0, 5.0])
    assert [e.t_mono_ns for e in back] == [10**9, 4 * 10**9, 6 * 10**9]
    assert back[1].duration_s == pytest.approx(2.0) and back[2].ttft_s == pytest.approx(0.5)
    assert back[1].tool_name == "bash" and back[2].request_id == "r"
    assert unscale_events(events, t0, 10**9, 1.0) == events


def test_client_side_gpu_events_follow_the_turn_records() -> None:
    from datetime import UTC, datetime

    from eval.backends import client_side_gpu_events
    from eval.replay import ReplayResult, SessionRecord, TurnRecord

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    record = SessionRecord("s0", 0.0, status="ok", turns=[
        TurnRecord(turn=0, num_prompt_tokens=10, send_s=0.1, num_output_tokens=3, first_token_s=0.3,
                   finish_s=0.5),
        TurnRecord(turn=1, num_prompt_tokens=20, send_s=1.0, num_output_tokens=2, finish_s=1.4),
        TurnRecord(turn=2, num_prompt_tokens=30, send_s=2.0)])  # never finished
    events = client_side_gpu_events(ReplayResult(started_at=t0, sessions=[record]))
    assert [(e.kind, e.turn) for e in events] == [("first_token", 0), ("finished", 0), ("finished", 1)]
    assert events[0].ttft_s == pytest.approx(0.2)
    assert (events[2].t_wall - t0).total_seconds() == pytest.approx(1.4)
    assert events[2].num_prompt_tokens == 20 and events[2].num_output_tokens == 2


def _fake_openai_app(token_delay_s: float, seen: list[dict]):
    """A minimal OpenAI-compatible engine: ``/v1/models`` and streamed ``/v1/completions`` with ids."""
    import asyncio
    import json

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "fake-model", "max_model_len": 4096}]}

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202
        body = await request.json()
        seen.append(body)

        async def chunks():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(token_delay_s)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'token_ids': [i % 7]}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_url():
    import socket
    import threading
    import time

    import uvicorn

    if Request is None:
        pytest.skip("the fake OpenAI server needs fastapi and uvicorn")
    seen: list[dict] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_openai_app(0.002, seen), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=10)


def test_url_backend_runs_the_replay_and_labels_the_one_policy(tmp_path, sim, fake_url) -> None:
    from eval.backends import LiveBackend, LiveOptions, parse_backend

    url, seen = fake_url
    workload = small_workload(n=3, turns=2)
    live = LiveBackend(parse_backend(url + "/v1"), LiveOptions(num_gpu_blocks=64, max_model_len_tokens=4096,
                                                               num_tool_workers=4),
                       {name: (p.scheduler, p.additional_config) for name, p in POLICIES.items()})
    options = CompareOptions(policies=("mars",), loads=(5.0,), is_absolute_rates=True, num_gpu_blocks=64,
                             admission="off")
    results = run_compare(workload, options, None, tmp_path, live=live)
    assert list(results["label"]) == ["mars"] and (results["status"] == "ok").all(), results["error"].tolist()
    row = results.iloc[0]
    assert row["num_completed"] == 3 and row["e2e_mean_s"] > 0.2  # tools alone take >= 0.2 s
    assert 0.5 < row["slowdown_mean"] < 5
    # One unrecorded warm-up session (2 turns), 2 rounds of 3 isolated replays for the ideal (2 turns
    # each), then the run (3 sessions x 2 turns).
    warm_up = [b for b in seen if b["session_id"].startswith("warm-up-")]
    assert len(warm_up) == 2 and seen[:2] == warm_up
    assert len(seen) == 2 + 2 * 3 * 2 + 3 * 2
    assert [b["session_id"] for b in seen[2:14:2]] == ["s0", "s1", "s2"] * 2  # rounds, not back to back
    assert seen[2]["prompt"] != seen[8]["prompt"]  # each round has its own seed: no prefix-cache hits
    assert {b["model"] for b in seen} == {"fake-model"}
    assert all(b["session_id"] in {"s0", "s1", "s2"} and b["ignore_eos"] for b in seen[2:])
    table = pd.read_parquet(tmp_path / "mars__load5.parquet")
    assert table["is_complete"].all() and (table["e2e_s"] >= table["tool_s"]).all()
    text = (tmp_path / "summary.md").read_text()
    assert f"measured on {url}" in text


@pytest.mark.parametrize("has_previous_results", [False, True])
def test_cli_url_backend_with_nothing_listening_fails_early(tmp_path, capsys, closed_port_url,
                                                            has_previous_results) -> None:
    workload = tmp_path / "w.json"
    from eval.workloads.format import save_workload

    save_workload(small_workload(n=2, turns=2), workload)
    out = tmp_path / "out"
    if has_previous_results:  # a finished run's folder: refused before anything is replaced
        out.mkdir()
        (out / "summary.md").write_text("the previous run\n")
    args = _parser().parse_args(["compare", "--backend", closed_port_url, "--policies", "mars",
                                 "--workload", str(workload), "--absolute-rates", "--loads", "1",
                                 "--out", str(out)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot list models at {closed_port_url}/v1/models" in err
    assert "give --backend the URL of a running one" in err
    if has_previous_results:
        assert [p.name for p in out.iterdir()] == ["summary.md"]
        assert (out / "summary.md").read_text() == "the previous run\n"
    else:
        assert not out.exists()


def test_scale_time_fields_scales_durations_only() -> None:
    from eval.backends import LiveBackend, LiveOptions, parse_backend, scale_time_fields
    from mars_openhands.policy.admission import AdmissionParams
    from mars_openhands.policy.params import SchedulerParams

    base = SchedulerParams()
    scaled = scale_time_fields(base, 3.0)
    assert scaled["retention"]["max_ttl_s"] == pytest.approx(3 * base.retention.max_ttl_s)
    assert scaled["retention"]["reload_linear_s_per_token"] == pytest.approx(
        3 * base.retention.reload_linear_s_per_token)
    assert scaled["retention"]["price_max_s_per_block_s"] == base.retention.price_max_s_per_block_s
    assert scaled["levels"]["aging_interval_s"] == pytest.approx(3 * base.levels.aging_interval_s)
    assert scaled["levels"]["prompt_thresholds_tokens"] == list(base.levels.prompt_thresholds_tokens)
    assert scaled["reorder_interval_s"] == pytest.approx(3 * base.reorder_interval_s)
    assert SchedulerParams.model_validate(scaled).retention.cold_start_ttl_s == pytest.approx(
        3 * base.retention.cold_start_ttl_s)
    admission = scale_time_fields(AdmissionParams(), 2.0)
    assert admission["update_interval_s"] == pytest.approx(2 * AdmissionParams().update_interval_s)
    assert admission["window_max"] == AdmissionParams().window_max

    config = {name: (p.scheduler, p.additional_config) for name, p in POLICIES.items()}
    with LiveBackend(parse_backend("emulated"), LiveOptions(num_gpu_blocks=64, max_model_len_tokens=1024,
                                                            time_scale=2.0), config) as backend:
        mars = backend.server_options("continuum-dy", Path("/nonexistent")).additional_config["mars"]
        plain = backend.server_options("fcfs", Path("/nonexistent")).additional_config["mars"]
    assert mars["continuum"]["mode"] == "continuum-dy"  # the policy's own setting survives scaling
    assert mars["retention"]["max_ttl_s"] == pytest.approx(2 * base.retention.max_ttl_s)
    assert plain["reorder_interval_s"] == pytest.approx(2 * base.reorder_interval_s)
    assert mars["telemetry"]["addr"].startswith("ipc://")


def test_auto_admission_gives_the_window_to_the_mars_policies_only() -> None:
    assert [admission_modes("auto", p) for p in ("fcfs", "continuum", "mars-preview", "mars")] == [
        (False,), (False,), (True,), (True,)]
    assert admission_modes("off", "mars") == (False,) and admission_modes("on", "fcfs") == (True,)
    assert admission_modes("both", "mars") == (False, True)


def test_measured_ideal_is_each_sessions_fastest_round() -> None:
    """Rounds interleave the sessions, use their own seeds, and keep each session's minimum E2E."""
    from datetime import UTC, datetime, timedelta

    from eval.backends import LiveBackend, LiveOptions, parse_backend
    from mars_openhands.stream import events as ev

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    e2e_s = {("s0", 0): 1.4, ("s1", 0): 1.0, ("s0", 1): 1.1, ("s1", 1): 1.3, ("s0", 2): 1.2, ("s1", 2): 0.9}
    calls: list[tuple[str, int]] = []

    class Scripted(LiveBackend):
        def run(self, policy, is_admission_enabled, workload, seed):  # noqa: ANN001, ANN202
            (session,) = workload.sessions
            calls.append((session.session_id, seed))
            e = e2e_s[(session.session_id, sum(1 for sid, _ in calls if sid == session.session_id) - 1)]
            at = lambda s: {"t_mono_ns": int(s * 1e9), "t_wall": t0 + timedelta(seconds=s)}  # noqa: E731
            sid = session.session_id
            return [ev.SessionStart(**at(0.0), session_id=sid, source="replay"),
                    ev.RequestFinished(**at(e), session_id=sid, turn=0, source="engine:0", request_id="r",
                                       num_prompt_tokens=10, num_output_tokens=2),
                    ev.SessionEnd(**at(e), session_id=sid, source="replay")]

    live = Scripted(parse_backend("http://127.0.0.1:9/v1"),
                    LiveOptions(num_gpu_blocks=64, max_model_len_tokens=4096, ideal_repeats=3), {})
    ticks: list[None] = []
    ideal = live.measure_ideal_s(small_workload(n=2, turns=2), "fcfs", 5, on_session=lambda: ticks.append(None))
    assert ideal == pytest.approx({"s0": 1.1, "s1": 0.9})
    assert [sid for sid, _ in calls] == ["s0", "s1"] * 3 and len(ticks) == 6
    assert len({seed for _, seed in calls}) == 3 and calls[0][1] == calls[1][1] == 5


def test_mars_preview_keeps_the_preview_cpu_threshold_and_mars_has_ours() -> None:
    options = CompareOptions(num_gpu_blocks=64)
    preview = sim_config(options, "mars-preview", True).admission
    ours = sim_config(options, "mars", True).admission
    assert preview.cpu_set_backlog_ratio == 4.0 and ours.cpu_set_backlog_ratio == 1.5
    assert preview.max_admission_wait_s is None and ours.max_admission_wait_s == 1800.0
    assert preview.tool_fraction_horizon_s is None and ours.tool_fraction_horizon_s == 600.0
    assert live_policy_config()["mars-preview"][3] == {"cpu_set_backlog_ratio": 4.0, "max_admission_wait_s": None,
                                                       "tool_fraction_horizon_s": None}


def test_host_kv_policies_get_the_sized_tier_and_the_scope_names_it() -> None:
    from eval.compare import host_kv_note

    options = CompareOptions(policies=("fcfs", "vllm-offload-arc"), num_gpu_blocks=100, host_kv_gib=8.0,
                             host_kv_bytes_per_block=16 * 98304)
    tier = sim_config(options, "vllm-offload-arc", False).engine.host_kv
    assert tier is not None and (tier.size_gib, tier.eviction, tier.kv_bytes_per_block) == (8.0, "arc", 16 * 98304)
    assert sim_config(options, "fcfs", False).engine.host_kv is None
    note = host_kv_note(options)
    assert note.startswith("Host KV tier: 8 GiB for vllm-offload-arc") and "none for the others" in note
    gpu_only = CompareOptions(policies=("fcfs",), num_gpu_blocks=2)
    assert host_kv_note(gpu_only) == "Host KV tier: none (GPU KV only)."
    # Cache keys: unchanged without a host-tier policy, sized with one.
    assert gpu_only.host_kv_key() == () and options.host_kv_key() == ("host_kv", 8.0, 16 * 98304)


def test_host_kv_adds_stock_offload_and_the_named_policies_variants() -> None:
    from eval.compare import _options_from_args
    from eval.policies import OFFLOAD_VARIANTS

    args = _parser().parse_args(["compare", "--policies", "fcfs,thunderagent,continuum,mars,vllm-tuned",
                                      "--host-kv-gib", "64", "--kv-blocks", "100", "--loads", "1"])
    options = _options_from_args(args, parse_policies(args.policies))
    assert options.policies == ("fcfs", "vllm-offload-lru", "thunderagent", "thunderagent-offload",
                                "continuum", "continuum-offload", "mars", "mars-offload", "vllm-tuned",
                                "vllm-offload-arc")
    assert OFFLOAD_VARIANTS == {"fcfs": "vllm-offload-lru", "continuum": "continuum-offload",
                                "thunderagent": "thunderagent-offload", "mars": "mars-offload"}
    for name, variant in OFFLOAD_VARIANTS.items():
        # The variant is its policy with the tier: the same scheduler, settings and control plane.
        base, spec = POLICIES[name], POLICIES[variant]
        assert (spec.scheduler, dict(spec.additional_config), spec.has_control_plane, spec.is_baseline) == (
            base.scheduler, dict(base.additional_config), base.has_control_plane, base.is_baseline)
        tier = sim_config(options, variant, spec.has_control_plane).engine.host_kv
        assert tier is not None and tier.size_gib == 64.0
        assert sim_config(options, name, base.has_control_plane).engine.host_kv is None


def test_a_lost_replicas_cost_reaches_the_results_and_the_summary(tmp_path, sim) -> None:
    """``compare --replicas 4 --lose-replica 1@1``: the sessions re-placed, turns failed and
    context re-prefilled are columns of results.parquet and a "Replicas" table in summary.md
    (they were dropped with the SimResult)."""
    losses = []

    def keep(workload, config, timer, sink=None):
        result = sim.simulate(workload, config, timer, sink)
        losses.append(result.replica_loss)
        return result

    options = CompareOptions(policies=("fcfs",), loads=(2.0,), num_gpu_blocks=512, base_rate_per_s=1.0,
                             admission="off", num_replicas=4, lose_replica=(1, 1.0), router="least-sessions")
    results = run_compare(small_workload(16, turns=4), options, sim.LinearStepTimeModel(), tmp_path, simulate_fn=keep)
    row = results.iloc[0]
    loss = losses[-1]
    assert loss is not None and loss.num_sessions_replaced >= 1
    assert (row["lost_replica"], row["loss_sessions_replaced"], row["loss_reprefill_tokens"]) == (
        1, loss.num_sessions_replaced, loss.num_reprefill_tokens)
    assert row["num_completed"] == row["num_sessions"] and row["num_rehomes"] >= 0
    text = (tmp_path / "summary.md").read_text()
    assert "## Replicas" in text and (
        f"| 1 (1) | {loss.num_sessions_replaced:,} | {loss.num_turns_failed:,} | "
        f"{loss.num_reprefill_tokens:,} |") in text
