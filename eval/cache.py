"""Content-hash cache of what ``compare`` derives from a workload: ideal times and knees.

A key is the SHA-256 of everything the value depends on: the workload (its sessions, turn by turn,
as JSON), the GPU profile, KV blocks and step-time model, the policy's engine settings, the search
parameters, and the *code*: the source of ``eval`` and ``mars_openhands`` and the installed vLLM
version (:func:`code_fingerprint`). Change any of them and the key changes, so a stale value is
never read; an unchanged rerun reads ideal times and knees instead of re-simulating them (the
FCFS knee search alone is ~5 full-workload runs per GPU).

Values are small JSON files ``<dir>/<kind>-<key[:24]>.json`` written atomically (rename). The
default folder is ``$XDG_CACHE_HOME/mars-openhands/compare`` (``~/.cache/...``); ``compare
--cache-dir DIR`` moves it, ``--no-cache`` neither reads nor writes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ResultCache", "code_fingerprint", "content_key", "default_cache_dir"]

_ROOT = Path(__file__).resolve().parents[1]
_CODE_DIRS = ("eval", "mars_openhands")


@functools.cache
def code_fingerprint() -> str:
    """SHA-256 over the ``*.py`` files of ``eval/`` and ``mars_openhands/`` (path + bytes, sorted)
    and the vLLM version. Cached per process (the source does not change under a running job)."""
    digest = hashlib.sha256()
    for folder in _CODE_DIRS:
        for path in sorted((_ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(_ROOT)).encode())
            digest.update(path.read_bytes())
    try:
        from importlib.metadata import version

        digest.update(version("vllm").encode())
    except Exception:  # noqa: BLE001 - no vllm: the sim cannot run anyway; the key still differs
        digest.update(b"no-vllm")
    return digest.hexdigest()


def content_key(*parts: Any) -> str:
    """SHA-256 hex of ``parts`` (JSON with sorted keys; pydantic models by ``model_dump``) + the code.

    Raises:
        TypeError: a part is neither JSON-serialisable nor a pydantic model / dataclass.
    """
    def default(value: Any) -> Any:
        if hasattr(value, "model_dump"):
            return value.model_dump(mode="json")
        if hasattr(value, "__dataclass_fields__"):
            return {"__type__": type(value).__qualname__, **{k: getattr(value, k) for k in value.__dataclass_fields__}}
        raise TypeError(f"cannot hash {type(value).__name__} into a cache key")

    text = json.dumps([code_fingerprint(), *parts], sort_keys=True, default=default)
    return hashlib.sha256(text.encode()).hexdigest()


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/mars-openhands/compare``, else ``~/.cache/mars-openhands/compare``."""
    base = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "mars-openhands" / "compare"


class ResultCache:
    """JSON values by content key under one folder; ``None`` folder = disabled (gets miss, puts drop).

    Mutates: the folder only (created on the first put).
    """

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.num_hits = 0

    def _path(self, kind: str, key: str) -> Path:
        assert self.directory is not None, "a disabled cache has no paths"
        return self.directory / f"{kind}-{key[:24]}.json"

    def get(self, kind: str, key: str) -> Any | None:
        """The value stored under ``(kind, key)``, or ``None`` (missing, disabled or unreadable)."""
        if self.directory is None:
            return None
        try:
            stored = json.loads(self._path(kind, key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None
        self.num_hits += 1
        return stored.get("value")

    def put(self, kind: str, key: str, value: Any) -> None:
        """Store ``value`` (JSON-serialisable) atomically; a write error is ignored (a cache is optional)."""
        if self.directory is None:
            return
        path = self._path(kind, key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "value": value}), encoding="utf-8")
            tmp.replace(path)
        except OSError:
            pass
