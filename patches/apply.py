"""Apply (or revert, or check) a patch of ``patches/`` to the OpenHands packages of one environment.

Never run by default: setup, the CLI and the tests never call it, except the OpenHands-app test
environment's setup target, which asks for the process-sandbox patch by name (see README.md).

Usage::

    python patches/apply.py [--python PY] [--check | --revert] NAME [NAME ...]
    python patches/apply.py --list

``PY`` is the interpreter of the environment to patch (default: this one). The patch is applied
with ``git apply`` inside that environment's site-packages, after checking that the installed
distribution's version is one the patch was written for. Applying twice is a no-op; exit 0 when
every named patch is (now) applied (``--check``: would apply or is applied; ``--revert``: is not
applied), 1 when one does not fit, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent


class PatchSpec(NamedTuple):
    """One patch: the distribution it changes, its file per version written for, and what it does."""

    distribution: str
    files: dict[str, str]
    """installed version -> patch file (in this folder)."""
    what: str


PATCHES: dict[str, PatchSpec] = {
    "openhands-ai-process-sandbox": PatchSpec(
        "openhands-ai", {"1.11.0": "openhands-ai-1.11-process-sandbox.patch"},
        "app process sandbox: an idle agent-server is RUNNING (was STARTING forever), reached at "
        "127.0.0.1 (the app rewrote localhost when it runs in a container), 120 s to start"),
    "openhands-sdk-tool-enqueue-time": PatchSpec(
        "openhands-sdk", {"1.34.0": "openhands-sdk-1.34.0-tool-enqueue-time.patch",
                          "1.58.2": "openhands-sdk-1.58.2-tool-enqueue-time.patch"},
        "SDK: ParallelToolExecutor records when each batch of tool calls reached it, so "
        "tool_enqueued / queue_wait_s include the resource-lock and worker waits"),
}


def _env_info(python: str, distribution: str) -> tuple[Path, str | None]:
    code = ("import sys, sysconfig, importlib.metadata as m\n"
            "print(sysconfig.get_paths()['purelib'])\n"
            "try:\n    print(m.version(sys.argv[1]))\nexcept m.PackageNotFoundError:\n    print('')\n")
    out = subprocess.run([python, "-c", code, distribution], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return Path(out[0]), out[1] or None


def _git_apply(site: Path, patch: Path, *flags: str) -> bool:
    # Outside any repository (an env inside a checkout would make git apply repo-relative paths).
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(site.parent)}
    return subprocess.run(["git", "apply", *flags, str(patch)], cwd=site, env=env,
                          capture_output=True).returncode == 0


def run(name: str, python: str, mode: str) -> tuple[bool, str]:
    """Apply / check / revert one patch. Returns ``(ok, one-line message)``."""
    spec = PATCHES[name]
    site, version = _env_info(python, spec.distribution)
    if version not in spec.files:
        return False, (f"{name}: {spec.distribution} {version or 'is not installed'} in {python}; "
                       f"the patch is for {', '.join(spec.files)}")
    patch = HERE / spec.files[version]
    is_applied = _git_apply(site, patch, "--reverse", "--check")
    if mode == "revert":
        if not is_applied:
            return True, f"{name}: not applied in {site}"
        return _git_apply(site, patch, "--reverse"), f"{name}: reverted in {site}"
    if is_applied:
        return True, f"{name}: already applied in {site}"
    if not _git_apply(site, patch, "--check"):
        return False, f"{name}: does not apply to {spec.distribution} {version} in {site}"
    if mode == "check":
        return True, f"{name}: would apply to {spec.distribution} {version} in {site}"
    return _git_apply(site, patch), f"{name}: applied to {spec.distribution} {version} in {site}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="patches/apply.py", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"one of {sorted(PATCHES)}")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the env to patch")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="only check that it applies")
    group.add_argument("--revert", action="store_true", help="undo the patch")
    group.add_argument("--list", action="store_true", help="list the patches")
    args = parser.parse_args(argv)
    if args.list:
        for name, spec in PATCHES.items():
            print(f"{name}: {spec.distribution} {'/'.join(spec.files)}: {spec.what}")
        return 0
    unknown = [n for n in args.names if n not in PATCHES]
    if not args.names or unknown:
        parser.error(f"name one or more of {sorted(PATCHES)} (got {unknown or 'none'})")
    mode = "check" if args.check else "revert" if args.revert else "apply"
    results = [run(name, args.python, mode) for name in args.names]
    for _, message in results:
        print(message)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
