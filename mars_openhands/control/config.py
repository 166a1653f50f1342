"""`GatewayConfig`: every parameter of the gateway service, in one frozen typed model (design.md §6).

The CLI flags (:mod:`mars_openhands.control.cli`) are generated from these fields and their
docstrings; nested models (``admission``, ``reorder``) become ``--admission-<field>`` flags.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from mars_openhands.cli_style import check_port_free, is_usable_key, redact_url
from mars_openhands.policy.admission import AdmissionParams
from mars_openhands.policy.placement import (
    DEFAULT_ROUTING_POLICY,
    live_routing_policies,
    routing_policy,
)
from mars_openhands.policy.reorder import ReorderParams
from mars_openhands.stream.transport import check_address

__all__ = ["ConfigError", "GatewayConfig", "ReplicaConfig", "check_runtime", "parse_replica",
           "stream_path_problem"]


def _check_http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(
            f"replica url must start with http:// or https://, got {redact_url(repr(value))}; "
            "e.g. --replica http://127.0.0.1:8001"
        )
    return value.rstrip("/")


def _check_zmq_address(value: str | None) -> str | None:
    """``value`` if it is a loopback-only ZeroMQ address (:func:`~mars_openhands.stream.transport.check_address`:
    what the gateway binds or connects at start-up), checked with the rest of the configuration."""
    if value is not None:
        check_address(value)  # ValueError naming the address and the two loopback forms
    return value


class ReplicaConfig(BaseModel):
    """One vLLM replica behind the gateway. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    url: str
    """Base URL of the replica's OpenAI server, without ``/v1`` (e.g. ``http://127.0.0.1:8001``)."""
    name: str | None = Field(None, min_length=1)
    """Name in metrics and logs; default ``r<index>``."""
    events_address: str | None = None
    """ZeroMQ address the replica's scheduler plugin binds a PULL socket on (``ipc://…`` or
    ``tcp://127.0.0.1:<port>``); the gateway PUSHes the CPU-plane events of the replica's sessions
    there (docs/gateway.md, "Engine contract"). ``None``: events are not forwarded."""
    engine_source: str | None = None
    """``source`` of this replica's GPU-plane events (``engine_step``); default ``engine:<index>``."""
    api_key: SecretStr | None = None
    """The replica's own ``--api-key``: the gateway sends it (``Authorization: Bearer``) in place of
    the agent's header, so agents, which do not hold it, cannot reach the replica around the
    gateway. ``None``: the agent's ``Authorization`` is forwarded as it came."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _check_http_url(value)

    @field_validator("events_address")
    @classmethod
    def _events_address(cls, value: str | None) -> str | None:
        return _check_zmq_address(value)

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, value: SecretStr | None) -> SecretStr | None:
        return _check_key(value, "replica api_key")


def _check_key(value: SecretStr | None, what: str) -> SecretStr | None:
    """``value`` if it is a usable key (non-empty, printable, no whitespace). Raises ValueError."""
    if value is None:
        return None
    key = value.get_secret_value()
    if not is_usable_key(key):
        raise ValueError(f"{what} must be non-empty printable text without whitespace "
                         f"({len(key)} characters given)")
    return value


def parse_replica(spec: str, environ: Mapping[str, str] | None = None) -> ReplicaConfig:
    """Parse ``URL[,events=ADDR][,name=NAME][,source=SRC][,key_env=VAR]`` (the ``--replica``
    flag). ``key_env`` names the environment variable holding the replica's API key (a key on the
    command line would be visible to every user of the machine in ``ps``).

    Raises:
        ValueError: an unknown key, a bad URL or an unset ``key_env`` variable; the message shows
            the accepted form.
    """
    url, *options = spec.split(",")
    fields: dict[str, str] = {"url": url}
    keys = {"events": "events_address", "name": "name", "source": "engine_source",
            "key_env": "api_key"}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in keys:
            raise ValueError(
                f"bad --replica option {option!r} in {redact_url(repr(spec))}; expected "
                "URL[,events=ADDR][,name=NAME][,source=SRC][,key_env=VAR]"
            )
        if key == "key_env":
            secret = (os.environ if environ is None else environ).get(value)
            if not secret:
                raise ValueError(f"--replica {redact_url(url)}: key_env={value} but ${value} is not set; export "
                                 "the replica's API key in it")
            value = secret
        fields[keys[key]] = value
    return ReplicaConfig(**fields)


class GatewayConfig(BaseModel):
    """Configuration of the MARS gateway. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    replicas: tuple[ReplicaConfig, ...] = Field(min_length=1)
    """vLLM replicas (``--replica URL[,events=ADDR][,name=NAME][,source=SRC]``, repeatable)."""
    host: str = "127.0.0.1"
    """Address the gateway listens on (loopback by default)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port the gateway listens on (0 = any free port)."""
    is_admission_enabled: bool = True
    """Run the AIMD session window; off = admit every session at once (baselines without MARS
    admission, design.md §5 fairness)."""
    admission: AdmissionParams = AdmissionParams()
    """AIMD window and pressure thresholds (design.md §6)."""
    reorder: ReorderParams = ReorderParams()
    """Order of the waiting sessions."""
    routing_policy: str = DEFAULT_ROUTING_POLICY
    """How sessions are placed across replicas: least-sessions (sticky, fewest sessions),
    sticky-hash, llm-d, prefix-affinity, thunderagent or mars-placement (the registry of
    mars_openhands/policy/placement.py; docs/compare.md, "Replicas and routers")."""
    num_tool_workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    """N_tool: tool workers of the agents (rho = in-flight tool calls / N_tool); default: CPU count."""
    tool_wait_idle_decay: bool = True
    """Feed a 0 s queue-wait sample to the EMA at each tick with no tool call queued, so a stale
    sample cannot hold the window shut after the queue drains (ours; the preview only updates on
    tool starts)."""
    session_idle_timeout_s: float = Field(300.0, gt=0.0)
    """Seconds without a request in flight, a tool call or any event after which a session releases
    its slot (its next request queues again)."""
    tool_call_timeout_s: float = Field(900.0, gt=0.0)
    """Default bound on one tool call, seconds from its ``tool_enqueued`` (or ``tool_start``): a
    call with no ``tool_end`` by then is closed as ``"interrupted"`` (its agent is presumed dead),
    so it stops counting as CPU backlog and its session can idle out. A session's
    ``session_start.tool_timeout_s`` or the call's own ``timeout_s`` overrides it. Default 15 min:
    longer than any bounded OpenHands tool call (the terminal's 30 s no-output soft timeout asks
    the agent; explicit ``timeout`` values are sent per call) and than a test suite run."""
    admission_wait_timeout_s: float = Field(600.0, gt=0.0)
    """Seconds a request may wait for admission before HTTP 503."""
    upstream_connect_timeout_s: float = Field(5.0, gt=0.0)
    """Seconds to connect to a replica before it counts as failed."""
    upstream_read_timeout_s: float = Field(600.0, gt=0.0)
    """Seconds between bytes from a replica before the request fails (HTTP 504)."""
    stream_hold_s: float = Field(120.0, ge=0.0)
    """Longest the gateway holds a streamed response's headers back waiting for its first chunk,
    seconds from the replica's headers. vLLM sends a stream's 200 headers before its first token;
    while they are held, a replica that dies (the turn queued or prefilling) is invisible to the
    agent: the turn is re-run on the next replica. Past the bound the headers go out, and a later
    failure ends the stream with an SSE ``error`` chunk. Default 120 s: past a turn's queueing and
    prefill on a loaded engine (tens of seconds for a 100k-token prompt), under the 300 s
    response-header timeout of Node's undici (the OpenAI Node SDK's fetch), the shortest header
    timeout among common clients (httpx, aiohttp and requests count headers in their read
    timeout). 0: relay the headers at once (the behaviour before this field)."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest request body accepted, bytes (larger: HTTP 413)."""
    max_events_per_post: int = Field(1024, ge=1)
    """Largest batch of events per ``POST /mars/v1/events``."""
    bytes_per_token: float = Field(4.0, gt=0.0)
    """Prompt bytes per token for the gateway's prefill estimate (no tokenizer in the gateway)."""
    block_size_tokens: int = Field(16, ge=1)
    """KV block size used for projections when the engine does not report it (vLLM default 16)."""
    poll_interval_s: float = Field(0.5, gt=0.0)
    """Seconds between polls of each replica's ``/metrics`` (KV usage, health)."""
    replica_failure_threshold: int = Field(2, ge=1)
    """Consecutive failed polls (or one failed request) after which a replica is marked down."""
    engine_step_max_age_s: float = Field(2.0, gt=0.0)
    """``engine_step`` events younger than this override the polled KV usage."""
    engine_events_address: str | None = None
    """ZeroMQ address the gateway binds a PULL socket on for GPU-plane events from the engines
    (``tcp://127.0.0.1:*`` picks a port); ``None``: no GPU-plane events (KV from polling only)."""
    stream_path: str | None = None
    """JSONL file recording the run's unified stream (every event through the gateway); ``None``:
    nothing is recorded."""
    admission_update_heartbeat_s: float = Field(10.0, gt=0.0)
    """An ``admission_update`` is recorded at a tick only when something changed (window, overload
    flags, admitted/waiting counts, a pressure signal beyond a small step) or at least this often,
    seconds (an idle gateway then writes ~100 bytes per heartbeat instead of one event per tick)."""
    stream_write_parquet: bool = False
    """Also write ``<stream>.parquet`` on shutdown (needs pandas and pyarrow)."""
    api_key: SecretStr | None = None
    """API key: the OpenAI routes (``/v1/*``) and ``POST /mars/v1/events`` need ``Authorization:
    Bearer <key>`` (else HTTP 401, vLLM's convention); ``None``: open. Prefer
    ``MARS_GATEWAY_API_KEY`` to the flag (a command line is visible to every user in ``ps``).
    In-process, vLLM's own ``--api-key`` plays this part."""
    admin_key: SecretStr | None = None
    """Admin key: ``GET /mars/v1/state`` with session ids needs ``Authorization: Bearer <key>``
    (else 401); ``None``: that route gives aggregate figures only. Also ``MARS_GATEWAY_ADMIN_KEY``."""
    session_token_keep_s: float = Field(3600.0, ge=0.0)
    """Seconds a session's token binding outlives its idle release: a client that crashed and
    comes back within it (a durable task resumes with its persisted ``X-Mars-Session-Token``)
    keeps its session, and nobody else can take the id meanwhile. Default 1 h: longer than a
    durable task's restart after a crash. A ``session_end`` forgets the binding at once."""

    @field_validator("api_key", "admin_key")
    @classmethod
    def _keys(cls, value: SecretStr | None) -> SecretStr | None:
        return _check_key(value, "the key")

    @field_validator("routing_policy")
    @classmethod
    def _known_routing_policy(cls, value: str) -> str:
        if routing_policy(value).pools_kv:  # raises on an unknown name, listing the known ones
            raise ValueError(f"routing policy {value!r} is the simulator's pooled-KV bound (one KV "
                             "pool shared by every replica), which live replicas cannot provide; "
                             f"use one of {', '.join(live_routing_policies())}")
        return value

    @field_validator("engine_events_address")
    @classmethod
    def _engine_events_address(cls, value: str | None) -> str | None:
        return _check_zmq_address(value)

    @field_validator("stream_path")
    @classmethod
    def _jsonl_stream(cls, value: str | None) -> str | None:
        if value is not None and value.endswith(".parquet"):
            raise ValueError(f"the stream is recorded as JSONL: give a .jsonl path, not {value!r} "
                             "(--stream-write-parquet adds the .parquet copy next to it)")
        return value

    @model_validator(mode="after")
    def _unique_replicas(self) -> Self:
        urls = [r.url for r in self.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError(f"replica URLs must be distinct, got {redact_url(str(urls))}")
        return self

    @model_validator(mode="after")
    def _distinct_keys(self) -> Self:
        # The admin key reads every session's id (GET /mars/v1/state); equal to the API key, every
        # agent holding the API key could read them and act as another session.
        if (self.api_key is not None and self.admin_key is not None
                and self.api_key.get_secret_value() == self.admin_key.get_secret_value()):
            raise ValueError("the admin key equals the API key: every agent that holds the API key "
                             "could read other sessions' ids; give the admin key its own value")
        return self

    def replica_name(self, index: int) -> str:
        """Name of replica ``index`` (its ``name`` or ``r<index>``)."""
        return self.replicas[index].name or f"r{index}"

    def replica_source(self, index: int) -> str:
        """``source`` of replica ``index``'s GPU-plane events (``engine:<index>`` by default)."""
        return self.replicas[index].engine_source or f"engine:{index}"


class ConfigError(ValueError):
    """A bad ``gateway`` configuration; ``str()`` is one line per problem, each naming the value
    and the fix."""


def check_runtime(config: GatewayConfig, is_in_process: bool = False) -> None:
    """Checks of the environment the config needs, done before anything starts.

    Args:
        config: the gateway's settings.
        is_in_process: the gateway runs inside vLLM's server, which listens on its own port
            (often 8000, the gateway's default, and already bound by vLLM itself): the port is
            not the gateway's to check.

    Raises:
        ConfigError: ``stream_path`` exists (one run, one stream), is a directory, or cannot be
            created (:func:`stream_path_problem`); ``host:port`` is taken by another server
            (named as ``--port``, not as uvicorn's ``[Errno 98]``).
    """
    busy = None if is_in_process else check_port_free(config.host, config.port)
    if busy is not None:
        raise ConfigError(busy)
    if config.stream_path is not None:
        problem = stream_path_problem(Path(config.stream_path))
        if problem is not None:
            raise ConfigError(problem)


def stream_path_problem(path: Path) -> str | None:
    """Why the gateway's recorder could not create its stream at ``path``, as one line naming
    ``--stream-path``; ``None`` when it can. The recorder creates the missing parent directories
    and then the file (``stream/recorder.py``), so this checks the nearest existing ancestor: a
    directory in which a file can be created (a probe file, removed at once: permission bits do
    not say it, as root or on /proc, /sys or a read-only mount).

    Mutates: creates and removes one empty file in that ancestor.
    """
    try:
        if path.is_dir():
            return (f"--stream-path {path} is a directory; pass a file path such as "
                    f"{path / 'stream.jsonl'}")
        if path.exists() or path.is_symlink():
            return (f"--stream-path {path} already exists (one run records one stream); pass a "
                    "new path or move the old stream away")
        ancestor = path.absolute().parent
        while not ancestor.exists() and not ancestor.is_symlink():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            return (f"--stream-path {path}: {ancestor} is not a directory; pass a path in a "
                    "directory (missing ones are created)")
    except OSError as e:  # a parent without search permission
        return (f"--stream-path {path}: cannot look at {e.filename or path} ({e.strerror or e}); "
                "pass a path in a writable directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mars-stream-check-", dir=ancestor)
    except OSError as e:  # no write permission, /proc, /sys, a read-only mount
        return (f"--stream-path {path}: cannot create files in {ancestor} ({e.strerror or e}); "
                "pass a path in a writable directory")
    os.close(fd)
    os.unlink(probe)
    return None
