"""The in-process gateway (control/inprocess.py): vLLM's ``--middleware`` around the fake engine app.

The fake engine (control/fake_engine.py) stands in for the rest of vLLM's ASGI stack; the
middleware wraps it exactly as vLLM's ``app.add_middleware`` does, served by uvicorn in a thread
(so lifespan and disconnects are real).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from gateway_helpers import ADMIN, ADMIN_KEY, chat, event, owner, post_events, wait_until

from mars_openhands.control.fake_engine import build_fake_engine_app
from mars_openhands.control.inprocess import (
    CONFIG_ENV,
    IN_PROCESS_URL,
    MarsGatewayMiddleware,
    config_from_env,
)


def _serve(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "server did not start"
    return server, thread, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def _serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn in a thread (:func:`_serve`) for the block; yields its URL."""
    server, thread, url = _serve(app)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, MarsGatewayMiddleware]]:
    """The fake engine app with the MARS middleware around it (as vLLM's --middleware adds it)."""

    def start(config: dict[str, Any]) -> tuple[str, MarsGatewayMiddleware]:
        monkeypatch.setenv(CONFIG_ENV, json.dumps({"poll_interval_s": 0.05, "num_tool_workers": 100,
                                                   "admission": {"update_interval_s": 0.05},
                                                   "admin_key": ADMIN_KEY, **config}))
        middleware = MarsGatewayMiddleware(build_fake_engine_app())
        server, thread, url = _serve(middleware)
        started.append((server, thread))
        return url, middleware

    started: list[tuple[uvicorn.Server, threading.Thread]] = []
    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=10)


def test_turns_carry_session_metadata_and_the_engine_keeps_its_own_paths(in_process) -> None:
    url, middleware = in_process({})
    with httpx.Client(base_url=url, timeout=10) as client:
        first = client.post("/v1/chat/completions", json=chat("s1"))
        second = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "stream": True,
                                                      "mars_session": "s1"})
        assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] == "ok"
        assert first.headers["x-mars-turn"] == "0" and second.headers["x-mars-turn"] == "1"
        assert second.text.count("data: ") == 4 and second.text.endswith("data: [DONE]\n\n")
        seen = client.get("/fake/requests").json()["requests"]  # not a MARS path: the engine's own
        assert [r["session_id"] for r in seen] == ["s1", "s1"]
        assert [r["vllm_xargs"]["mars_turn"] for r in seen] == [0, 1]
        assert "mars_session" not in seen[0]["body"]
        state = client.get("/mars/v1/state", headers=ADMIN).json()
        assert state["sessions"]["s1"]["turns"] == 2 and state["sessions"]["s1"]["in_flight"] == 0
        assert "vllm:kv_cache_usage_perc" in client.get("/metrics").text  # vLLM keeps /metrics
        assert "mars_admission_window" in client.get("/mars/v1/metrics").text
        assert client.get("/mars/v1/healthz").json()["healthy_replicas"] == ["local"]
    assert middleware.gateway.router.replicas[0].url == IN_PROCESS_URL
    # The poller reads the engine's /metrics in-process (KV usage and block size from the fake).
    client = httpx.Client(base_url=url, timeout=10)
    client.post("/fake/config", json={"kv_usage": 0.4, "block_size": 32})
    wait_until(lambda: middleware.gateway.router.replicas[0].kv_usage_polled == pytest.approx(0.4),
               what="the in-process poll to read KV usage 0.4")


def test_a_client_that_hangs_up_aborts_the_engine_request_and_frees_the_session(in_process) -> None:
    url, middleware = in_process({})
    httpx.post(f"{url}/fake/config", json={"delay_s": 0.5, "num_chunks": 50, "chunk_delay_s": 0.05})
    with (pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=0.3) as client,
          client.stream("POST", f"{url}/v1/chat/completions", json=chat("s2", stream=True)) as resp):
        for _ in resp.iter_raw():
            pass
    wait_until(lambda: httpx.get(f"{url}/fake/requests").json()["num_aborted"] == 1,
               what="the engine to see the disconnect and abort")
    wait_until(lambda: middleware.gateway.num_client_disconnects == 1, what="the gateway to count it")
    session = middleware.gateway.sessions.get("s2")
    assert session is not None and session.num_in_flight == 0
    assert httpx.get(f"{url}/fake/requests").json()["num_active"] == 0


def test_the_admission_window_holds_a_second_session_until_the_first_ends(in_process) -> None:
    url, middleware = in_process({"admission": {"update_interval_s": 0.05, "window_min": 1,
                                                "window_max": 1, "window_init": 1}})
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("a")).status_code == 200
        results: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: results.append(
            httpx.post(f"{url}/v1/chat/completions", json=chat("b"), timeout=10)))
        waiter.start()
        wait_until(lambda: client.get("/mars/v1/state", headers=ADMIN).json()["num_waiting"] == 1,
                   what="session b to wait for a slot")
        assert not results
        ended = post_events(client, [event("session_end", "a")])
        assert ended.status_code == 200, ended.text
        waiter.join(timeout=10)
        assert results and results[0].status_code == 200
    assert [r["session_id"] for r in httpx.get(f"{url}/fake/requests").json()["requests"]] == ["a", "b"]


def test_config_from_env() -> None:
    config = config_from_env({CONFIG_ENV: json.dumps({"is_admission_enabled": False, "replica": {
        "events_address": "ipc:///tmp/x.sock"}})})
    assert not config.is_admission_enabled
    assert [(r.url, r.name, r.events_address) for r in config.replicas] == [
        (IN_PROCESS_URL, "local", "ipc:///tmp/x.sock")]
    assert config_from_env({}).is_admission_enabled
    for text, message in [
        ("{", "MARS_GATEWAY_CONFIG is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"port": 1}', "port cannot be set in-process"),
        ('{"replicas": []}', "replicas cannot be set in-process"),
        ('{"replica": {"events_address": "tcp:/x"}}', "replica.events_address: stream address 'tcp:/x'"),
        ('{"replica": {"events_address": "tcp://8.8.8.8:5"}}', "'tcp://8.8.8.8:5' is not loopback-only"),
        ('{"admission": {"window_mn": 1}}', "admission.window_mn"),
        ('{"replica": 3}', '"replica" must be an object'),
        ('{"replica": {"url": "http://x"}}', "replica.url cannot be set in-process"),
        ("@/nonexistent/mars.json", "cannot read MARS_GATEWAY_CONFIG file /nonexistent/mars.json"),
    ]:
        with pytest.raises(ValueError) as info:
            config_from_env({CONFIG_ENV: text})
        assert message in str(info.value), (text, str(info.value))


def test_config_from_a_file(tmp_path) -> None:
    path = tmp_path / "mars.json"
    path.write_text(json.dumps({"session_idle_timeout_s": 12}))
    assert config_from_env({CONFIG_ENV: f"@{path}"}).session_idle_timeout_s == 12


def test_a_bad_config_fails_at_construction(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(CONFIG_ENV, '{"nope": 1}')
    with pytest.raises(ValueError, match="MARS_GATEWAY_CONFIG: unknown key 'nope'"):
        MarsGatewayMiddleware(build_fake_engine_app())
    (tmp_path / "old.jsonl").write_text("")
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"stream_path": str(tmp_path / "old.jsonl")}))
    with pytest.raises(ValueError, match="MARS_GATEWAY_CONFIG stream_path .* already exists"):
        MarsGatewayMiddleware(build_fake_engine_app())
    monkeypatch.setenv(CONFIG_ENV, '{"replica": {"name": ""}}')
    with pytest.raises(ValueError, match="replica.name"):
        MarsGatewayMiddleware(build_fake_engine_app())


async def _slow_app(scope, receive, send) -> None:  # noqa: ANN001
    import asyncio

    await asyncio.sleep(5)


async def _crashing_app(scope, receive, send) -> None:  # noqa: ANN001
    await send({"type": "http.response.start", "status": 200, "headers": []})
    raise RuntimeError("boom")


async def _streaming_app(scope, receive, send) -> None:  # noqa: ANN001
    import asyncio

    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/x")]})
    for i in range(3):
        await send({"type": "http.response.body", "body": b"c%d" % i, "more_body": True})
        await asyncio.sleep(0.01)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_in_process_client_maps_timeouts_crashes_and_relays_streams() -> None:
    import asyncio

    from mars_openhands.control.inprocess import InProcessClient
    from mars_openhands.control.upstream import UpstreamBrokenError, UpstreamTimeoutError

    async def main() -> None:
        slow = InProcessClient(_slow_app, 0.05, {})
        with pytest.raises(UpstreamTimeoutError, match="within 0.05 s"):
            await slow.post(f"{IN_PROCESS_URL}/v1/completions", b"{}", {})
        crash = InProcessClient(_crashing_app, 1.0, {})
        resp = await crash.post(f"{IN_PROCESS_URL}/v1/completions", b"{}", {})
        with pytest.raises(UpstreamBrokenError, match="raised RuntimeError"):
            await resp.read()
        ok = InProcessClient(_streaming_app, 1.0, {})
        resp = await ok.post(f"{IN_PROCESS_URL}/v1/completions", b"{}", {})
        assert (resp.status_code, resp.content_type) == (201, "text/x")
        assert [c async for c in resp.iter_chunks()] == [b"c0", b"c1", b"c2"]

    asyncio.run(main())


def test_a_hang_up_reaches_a_handler_that_runs_in_its_own_task() -> None:
    """vLLM's non-streaming handlers run under ``with_cancellation``: a task of their own, cancelled
    only when ``receive`` says ``http.disconnect``. Hanging up must get there (not orphan it)."""
    import asyncio

    from mars_openhands.control.inprocess import InProcessClient

    handler_states: list[str] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        await receive()

        async def handler() -> None:
            try:
                await asyncio.sleep(30)  # a long generation
                handler_states.append("finished")
            except asyncio.CancelledError:
                handler_states.append("aborted")
                raise

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        work, listener = asyncio.create_task(handler()), asyncio.create_task(listen())
        done, pending = await asyncio.wait([work, listener], return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()

    async def main() -> None:
        client = InProcessClient(app, 60.0, {})
        call = asyncio.ensure_future(client.post(f"{IN_PROCESS_URL}/v1/completions", b"{}", {}))
        await asyncio.sleep(0.05)
        call.cancel()  # the agent went away (the proxy cancels its request)
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(50):
            if handler_states:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert handler_states == ["aborted"]


class _ApiKey:
    """Stands in for vLLM's AuthenticationMiddleware (inside ours, as vLLM orders them)."""

    def __init__(self, app, key: str) -> None:  # noqa: ANN001
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        from fastapi.responses import JSONResponse

        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode()
            if auth != f"Bearer {self.key}":
                await JSONResponse({"error": "Unauthorized"}, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def test_vllms_api_key_guards_the_gateway_before_admission(monkeypatch) -> None:
    monkeypatch.setenv(CONFIG_ENV, "{}")
    middleware = MarsGatewayMiddleware(_ApiKey(build_fake_engine_app(), "secret"))
    with _serving(middleware) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            refused = client.post("/v1/chat/completions", json=chat("intruder"))
            assert refused.status_code == 401 and "x-mars-turn" not in refused.headers
            assert middleware.gateway.sessions.get("intruder") is None  # never admitted or counted
            assert client.get("/mars/v1/state").status_code == 401
            assert client.post("/mars/v1/events", json={"events": [event("session_end", "x")]}).status_code == 401
            key = {"authorization": "Bearer secret"}
            ok = client.post("/v1/chat/completions", json=chat("agent"), headers=key)
            assert ok.status_code == 200 and ok.headers["x-mars-turn"] == "0"
            aggregate = client.get("/mars/v1/state", headers=key).json()  # no admin key set:
            assert aggregate["num_sessions"] == 1 and "sessions" not in aggregate  # no session ids
            assert client.get("/health").status_code == 200  # not guarded by vLLM, nor by us
            assert client.get("/mars/v1/healthz").status_code == 200  # nor the gateway's figures
            assert "mars_sessions_live 1" in client.get("/mars/v1/metrics").text
            # An event needs vLLM's key and the session's token; the token binds the session.
            assert client.post("/mars/v1/events", json=[event("tool_start", "agent", tool_name="t",
                               tool_call_id="c")], headers=key).status_code == 400  # no token
            assert post_events(client, [event("tool_start", "agent", tool_name="t", tool_call_id="c")],
                               headers=key).status_code == 200
            stolen = client.post("/v1/chat/completions", json=chat("agent"), headers=key)
            assert stolen.status_code == 403 and "x-mars-turn" not in stolen.headers
            assert client.post("/v1/chat/completions", json=chat("agent"),
                               headers={**key, **owner("agent")}).headers["x-mars-turn"] == "1"


def test_engine_headers_are_relayed_and_a_refused_turn_is_not_counted(in_process) -> None:
    url, middleware = in_process({})
    with httpx.Client(base_url=url, timeout=10) as client:
        ok = client.post("/v1/chat/completions", json=chat("s"), headers={"x-request-id": "req-1"})
        assert ok.headers["x-mars-turn"] == "0" and ok.headers["x-request-id"] == "req-1"
        streamed = client.post("/v1/chat/completions", json=chat("s", stream=True),
                               headers={"x-request-id": "req-2"})
        assert streamed.headers["x-mars-turn"] == "1" and streamed.headers["x-request-id"] == "req-2"
        client.post("/fake/config", json={"fail_status": 400})
        refused = client.post("/v1/chat/completions", json=chat("s"))
        assert refused.status_code == 400 and refused.headers["x-mars-turn"] == "2"
        client.post("/fake/config", json={"fail_status": 0})
        retried = client.post("/v1/chat/completions", json=chat("s"))
        assert retried.headers["x-mars-turn"] == "2"  # the refused turn did not count
        turns = [r["vllm_xargs"]["mars_turn"] for r in client.get("/fake/requests").json()["requests"]]
        assert turns == [0, 1, 2, 2]


def test_gateway_cli_prints_the_in_process_config(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    import argparse
    import shlex

    from mars_openhands.control.cli import add_gateway_subcommand

    parser = argparse.ArgumentParser()
    add_gateway_subcommand(parser.add_subparsers(dest="command"))

    def run(*flags: str) -> tuple[int, str, str]:
        args = parser.parse_args(["gateway", "--print-in-process-config", *flags])
        code = args.func(args)
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = run("--admission-window-max", "8", "--admission-window-init", "8",
                       "--replica", "http://ignored:1,events=ipc:///tmp/in.sock", "--no-is-admission-enabled")
    assert code == 0
    line, comment, flag = out.splitlines()
    assert line.startswith(f"{CONFIG_ENV}='") and flag.endswith("inprocess.MarsGatewayMiddleware")
    config = config_from_env({CONFIG_ENV: line.split("=", 1)[1].strip("'")})
    assert (config.admission.window_max, config.admission.window_init) == (8, 8)
    assert not config.is_admission_enabled and config.replicas[0].events_address == "ipc:///tmp/in.sock"
    assert config.replicas[0].url == IN_PROCESS_URL
    code, out, err = run("--replica", "http://a:1", "--replica", "http://b:1")
    assert code == 2 and not out and "serves one replica" in err
    code, out, err = run("--port", "9000")
    assert code == 2 and "--host/--port do not apply in-process" in err
    # A --replica without URL, a quote in a value, and a --config file's replica and port.
    code, out, _ = run("--replica", "events=ipc:///tmp/a.sock,name=x", "--stream-path", "/tmp/it's.jsonl")
    value = shlex.split(out.splitlines()[0])[0].split("=", 1)[1]  # as the shell reads the line
    config = config_from_env({CONFIG_ENV: value})
    assert (config.replicas[0].events_address, config.replicas[0].name) == ("ipc:///tmp/a.sock", "x")
    assert config.stream_path == "/tmp/it's.jsonl"
    path = tmp_path / "gw.json"
    path.write_text(json.dumps({"replicas": [{"url": "http://a:1", "events_address": "ipc:///f"}]}))
    code, out, _ = run("--config", str(path))
    assert code == 0 and '"events_address":"ipc:///f"' in out
    path.write_text(json.dumps({"replicas": [{"url": "http://a:1"}], "port": 9000}))
    code, out, err = run("--config", str(path))
    assert code == 2 and "host/port (from --config) do not apply" in err


def test_without_a_lifespan_the_first_requests_start_the_gateway_once(monkeypatch) -> None:
    import asyncio

    monkeypatch.setenv(CONFIG_ENV, json.dumps({"poll_interval_s": 0.05}))
    middleware = MarsGatewayMiddleware(build_fake_engine_app())
    starts: list[None] = []
    real_start = middleware.gateway.start

    async def counted_start() -> None:
        starts.append(None)
        await asyncio.sleep(0.05)  # concurrent first requests arrive while it starts
        await real_start()

    middleware.gateway.start = counted_start  # type: ignore[method-assign]

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(f"s{i}"))
                                               for i in range(3)))
        await middleware.gateway.stop()
        return [r.status_code for r in responses]

    assert asyncio.run(main()) == [200, 200, 200]
    assert len(starts) == 1


def test_the_config_checker_reports_before_vllm_starts(monkeypatch, tmp_path, capsys) -> None:
    from mars_openhands.control.inprocess import main

    stream = tmp_path / "s.jsonl"
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"stream_path": str(stream), "is_admission_enabled": False}))
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{CONFIG_ENV} ok: replicas: local=http://in-process; admission: off")
    assert not stream.exists()  # checking records nothing
    stream.write_text("")
    assert main([]) == 2
    assert f"{CONFIG_ENV}: stream_path {stream} already exists" in capsys.readouterr().err
    monkeypatch.setenv(CONFIG_ENV, '{"admission": {"window_mn": 2}}')
    assert main([]) == 2
    assert capsys.readouterr().err.strip() == (
        f"{CONFIG_ENV}: unknown key 'admission.window_mn'; did you mean 'window_min'? 'admission' takes: "
        "window_max, window_init, window_min, decrease_factor, increase_step, update_interval_s, "
        "cpu_set_backlog_ratio, cpu_clear_backlog_ratio, cpu_set_wait_s, cpu_clear_wait_s, kv_set_usage, "
        "kv_clear_usage, kv_usage_over_replicas, tool_wait_ema_alpha, tool_fraction_horizon_s, "
        "max_admission_wait_s")


@pytest.mark.parametrize(("value", "expected"), [
    ({"num_tool_workers": 0}, "num_tool_workers: Input should be greater than or equal to 1 (got 0)"),
    ({"replica": {"name": "", "evnts_address": "ipc:///tmp/x"}},
     "replica.name: String should have at least 1 character (got ''); unknown key 'replica.evnts_address'; "
     "did you mean 'events_address'? 'replica' takes: name, events_address, engine_source"),
    ({"rplica": {}}, "unknown key 'rplica'; did you mean 'replica'? the keys are: is_admission_enabled, "),
])
def test_config_errors_are_the_shared_formatters_lines(value, expected) -> None:
    """A bad value with its key and value, an unknown key with the keys it could have been (those
    refused in-process left out: replicas, host, port, api_key; replica.url and replica.api_key);
    was 'replica.name: String should have at least 1 character' and 'rplica: Extra inputs are not
    permitted'."""
    with pytest.raises(ValueError) as info:
        config_from_env({CONFIG_ENV: json.dumps(value)})
    message = str(info.value)
    assert message.startswith(f"{CONFIG_ENV}: {expected}")
    assert not any(f"{key}," in message or message.endswith(key)
                   for key in ("replicas", "host", "port", "api_key", "url"))


def test_no_key_value_is_printed_in_a_config_error() -> None:
    """An admin key of the wrong type or under a misspelt name: the error names it, never its value."""
    secret = "sk-never-print-1234"
    for value in ({"admin_key": [secret]}, {"admin_kee": secret}, {"admin_key": f"{secret} x"},
                  {"replica": {"api_kee": secret}}):
        with pytest.raises(ValueError) as info:
            config_from_env({CONFIG_ENV: json.dumps(value)})
        assert "admin_ke" in str(info.value) or "api_kee" in str(info.value)
        assert secret not in str(info.value), str(info.value)


def test_the_admin_key_opens_the_state_with_session_ids_in_process(monkeypatch) -> None:
    """In-process, vLLM's key is the API key and MARS_GATEWAY_ADMIN_KEY the admin key: the state
    with session ids needs the latter; vLLM's key alone gets 401 once an admin key is set."""
    monkeypatch.setenv(CONFIG_ENV, "{}")
    monkeypatch.setenv("MARS_GATEWAY_ADMIN_KEY", "admin-secret")
    middleware = MarsGatewayMiddleware(_ApiKey(build_fake_engine_app(), "secret"))
    with _serving(middleware) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            key = {"authorization": "Bearer secret"}
            assert client.post("/v1/chat/completions", json=chat("s"), headers=key).status_code == 200
            assert client.get("/mars/v1/state", headers=key).status_code == 401
            admin = client.get("/mars/v1/state", headers={"authorization": "Bearer admin-secret"})
            assert admin.status_code == 200 and admin.json()["sessions"]["s"]["turns"] == 1
            assert client.post("/v1/chat/completions", json=chat("s"), headers={
                "authorization": "Bearer admin-secret"}).status_code == 401  # not an API key


def test_an_admin_key_equal_to_vllms_api_key_opens_nothing(monkeypatch, capsys) -> None:
    """vLLM's ``--api-key`` is known only to vLLM's own check: an admin key that check takes (and
    that is not taken because vLLM has no key) would make every agent holding the API key an
    admin. The state then refuses that key; the stderr line says why."""
    monkeypatch.setenv(CONFIG_ENV, "{}")
    monkeypatch.setenv("MARS_GATEWAY_ADMIN_KEY", "secret")
    middleware = MarsGatewayMiddleware(_ApiKey(build_fake_engine_app(), "secret"))
    with _serving(middleware) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            key = {"authorization": "Bearer secret"}
            assert client.post("/v1/chat/completions", json=chat("s"), headers=key).status_code == 200
            for _ in range(2):  # asked once, remembered
                r = client.get("/mars/v1/state", headers=key)
                assert r.status_code == 401 and "sessions" not in r.text
        assert "the admin key is one of vLLM's API keys" in capsys.readouterr().err
    # Without a vLLM key every key passes vLLM's check: the admin key is the only one that opens.
    monkeypatch.setenv("MARS_GATEWAY_ADMIN_KEY", "admin-only")
    middleware = MarsGatewayMiddleware(build_fake_engine_app())
    with _serving(middleware) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.post("/v1/chat/completions", json=chat("t")).status_code == 200
            admin = client.get("/mars/v1/state", headers={"authorization": "Bearer admin-only"})
            assert admin.status_code == 200 and "t" in admin.json()["sessions"]
            assert "sessions" not in client.get("/mars/v1/state").json()


def test_the_in_process_gateway_does_not_check_the_standalone_port(monkeypatch, capsys) -> None:
    """In-process the gateway serves on vLLM's own port, which vLLM binds before it builds its
    middleware, by default 8000: the standalone gateway's default port. Checking that port made
    ``vllm serve --middleware ...`` on its default port refuse to start ("--port 8000 is in
    use")."""
    from mars_openhands.control.inprocess import main

    monkeypatch.setenv(CONFIG_ENV, "{}")
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 8000))
        taken.listen()
    except OSError:  # in use already: as good
        pass
    try:
        MarsGatewayMiddleware(build_fake_engine_app())
        assert main([]) == 0, capsys.readouterr().err
    finally:
        taken.close()


def test_api_keys_are_refused_in_the_in_process_config() -> None:
    with pytest.raises(ValueError, match="the admin key is one of vLLM's API keys"):
        config_from_env({CONFIG_ENV: "{}", "MARS_GATEWAY_ADMIN_KEY": "k", "VLLM_API_KEY": "k"})
    with pytest.raises(ValueError, match="the admin key is one of vLLM's API keys"):
        config_from_env({CONFIG_ENV: json.dumps({"admin_key": "k"}), "VLLM_API_KEY": "k"})
    with pytest.raises(ValueError, match="api_key cannot be set in-process"):
        config_from_env({CONFIG_ENV: json.dumps({"api_key": "k"})})
    with pytest.raises(ValueError, match="replica.api_key cannot be set in-process"):
        config_from_env({CONFIG_ENV: json.dumps({"replica": {"api_key": "k"}})})
    config = config_from_env({CONFIG_ENV: "{}", "MARS_GATEWAY_ADMIN_KEY": "a-key"})
    assert config.admin_key is not None and config.admin_key.get_secret_value() == "a-key"


def test_a_stream_slower_than_the_hold_bound_loses_no_byte_in_process(in_process) -> None:
    url, _ = in_process({"stream_hold_s": 0.2})
    httpx.post(f"{url}/fake/config", json={"delay_s": 1.0, "num_chunks": 3, "chunk_delay_s": 0.05})
    with httpx.Client(base_url=url, timeout=10) as client:
        t0 = time.monotonic()
        with client.stream("POST", "/v1/chat/completions", json=chat("slow", stream=True)) as r:
            headers_s = time.monotonic() - t0
            body = b"".join(r.iter_raw())
    assert r.status_code == 200 and 0.15 < headers_s < 0.9, headers_s
    assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")
    assert [body.count(b'"t%d"' % i) for i in range(3)] == [1, 1, 1]
