#!/usr/bin/env bash
# A stand-in for ghcr.io/openhands/agent-server:1.34.0-python built with no registry of images:
# a Debian trixie root filesystem from Debian's packages (mmdebstrap) with the packages of
# requirements.txt (PyPI wheels for CPython 3.13, unpacked by uv on this host) in
# /agent-server/.venv, imported into the Docker daemon with `docker import`.
#
#   docker/agent-server-base/build.sh [--cache DIR] [--rootfs-only]
#
# Prints the image's name on its last line of stdout: mars-openhands/agent-server-base:<key>,
# where <key> hashes this file and requirements.txt (the image's whole recipe). Cached by that
# key: the daemon's image if it has it, else the root filesystem's tarball in
# --cache (default ${XDG_CACHE_HOME:-~/.cache}/mars-openhands/agent-server-base), else built
# (~2-4 min: Debian's packages and ~190 wheels downloaded). --rootfs-only builds or finds the
# tarball and prints its path, without a Docker daemon.
#
# The image has what the stock "-python" image's entrypoint and our docker/agent-server/Dockerfile
# use: /agent-server/.venv (CPython 3.13, agent-server/SDK/tools 1.34.0), uv in /bin, tini, bash,
# git, tmux, user openhands (10001) owning /agent-server and /workspace/project, the stock ENV
# and ENTRYPOINT. Not in it: the stock image's VS Code, VNC, Chromium, Docker, Node, compilers.
# Needs: mmdebstrap (Debian/Ubuntu: apt-get install mmdebstrap), root (or mmdebstrap's unshare
# mode), uv (MARS_UV, else `uv` or `python3 -m uv`), and network to a Debian mirror
# (MARS_DEBIAN_MIRROR, default http://deb.debian.org/debian) and to PyPI (uv's index settings).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/mars-openhands/agent-server-base"
rootfs_only=0
while (( $# )); do
  case "$1" in
    --cache) cache="$2"; shift 2 ;;
    --rootfs-only) rootfs_only=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "agent-server-base/build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

SUITE=trixie            # its python3 is 3.13, the stock image's Python
PYTHON_VERSION=3.13
UV_VERSION=0.11.6       # the stock image's
USER_ID=10001           # the stock image's user openhands
PACKAGES=passwd,python3,tini,bash,ca-certificates,git,tmux,procps
mirror="${MARS_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
case "$(uname -m)" in
  x86_64) platform=x86_64-manylinux_2_28 ;;
  aarch64|arm64) platform=aarch64-manylinux_2_28 ;;
  *) echo "agent-server-base/build.sh: no wheels for machine $(uname -m) (x86_64 or aarch64)" >&2; exit 1 ;;
esac
key="$(cat "$here/build.sh" "$here/requirements.txt" <(echo "$platform") | sha256sum | cut -c1-16)"
image="mars-openhands/agent-server-base:$key"
tarball="$cache/rootfs-$key.tar"
say() { echo "[agent-server-base] $*" >&2; }

find_uv() {
  if [[ -n "${MARS_UV:-}" ]]; then echo "$MARS_UV"; return; fi
  if command -v uv >/dev/null 2>&1; then command -v uv; return; fi
  local py
  for py in "$here/../../.venv-openhands-app/bin/python" "$here/../../.venv-openhands/bin/python" \
            "$here/../../.venv/bin/python" python3; do
    if "$py" -m uv --version >/dev/null 2>&1; then echo "$py -m uv"; return; fi
  done
  say "uv not found: pip install uv (or set MARS_UV)"; exit 1
}

# unpack_wheels DIR: requirements.txt's packages for CPython 3.13 on this machine's Linux, and uv.
unpack_wheels() {
  local dir="$1" uv
  uv="$(find_uv)"
  $uv pip install --quiet --no-deps --target "$dir/site-packages" --python-platform "$platform" \
    --python-version "$PYTHON_VERSION" -r "$here/requirements.txt"
  $uv pip install --quiet --no-deps --target "$dir/uv" --python-platform "$platform" \
    --python-version "$PYTHON_VERSION" "uv==$UV_VERSION"
  rm -rf "$dir/site-packages/bin"  # console scripts name this host's Python; the image runs modules
}

# build_rootfs OUT: Debian's packages, the user, the venv (the wheels unpacked above, compiled).
build_rootfs() {
  local out="$1"
  command -v mmdebstrap >/dev/null 2>&1 \
    || { say "mmdebstrap not found (Debian/Ubuntu: apt-get install mmdebstrap)"; exit 1; }
  # Globals, for the trap: removed at exit, also when a step fails (set -e exits the script).
  work="$(mktemp -d -t mars-agent-server-base-XXXXXX)" partial="$out.partial.tar"
  trap 'rm -rf "${work:-}" "${partial:-}"' EXIT
  say "unpacking requirements.txt's wheels for CPython $PYTHON_VERSION ($platform)"
  unpack_wheels "$work"
  local venv=/agent-server/.venv site="/agent-server/.venv/lib/python$PYTHON_VERSION/site-packages"
  # Imports what the agent-server and a conversation import (a check, and their bytecode is
  # written once here instead of at every container's start; compiling all of it: 2x slower).
  local warm_up="LITELLM_LOCAL_MODEL_COST_MAP=True OPENHANDS_SUPPRESS_BANNER=1 $venv/bin/python -c \
'import openhands.agent_server.api, openhands.tools.preset.default, openhands.tools.browser_use, litellm'"
  say "building Debian $SUITE's root filesystem from $mirror"
  mmdebstrap --quiet --variant=essential --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --customize-hook="copy-in $work/uv/bin/uv $work/uv/bin/uvx /usr/bin" \
    --customize-hook="chroot \"\$1\" groupadd -g $USER_ID openhands" \
    --customize-hook="chroot \"\$1\" useradd -m -u $USER_ID -g $USER_ID -s /bin/bash openhands" \
    --customize-hook="chroot \"\$1\" mkdir -p /workspace/project" \
    --customize-hook="chroot \"\$1\" uv venv --quiet --no-cache --python /usr/bin/python$PYTHON_VERSION $venv" \
    --customize-hook="copy-in $work/site-packages/. $site" \
    --customize-hook="chroot \"\$1\" env -u PYTHONDONTWRITEBYTECODE $warm_up" \
    --customize-hook="chroot \"\$1\" chown -R openhands:openhands /agent-server /workspace" \
    "$SUITE" "$partial" "$mirror" >&2  # the name's ending makes it a tarball
  mv "$partial" "$out"
}

mkdir -p "$cache"
if (( ! rootfs_only )) && docker image inspect "$image" >/dev/null 2>&1; then
  say "cached in the daemon: $image"; echo "$image"; exit 0
fi
exec 9>"$cache/rootfs-$key.lock"
flock 9  # one build per key at a time: a second waits, then finds the tarball
if [[ -f "$tarball" ]]; then
  say "cached root filesystem: $tarball"
else
  start=$SECONDS
  build_rootfs "$tarball"
  say "built $tarball in $((SECONDS - start)) s ($(du -h "$tarball" | cut -f1))"
fi
if (( rootfs_only )); then echo "$tarball"; exit 0; fi
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LC_ALL=C.UTF-8' --change 'ENV LANG=C.UTF-8' \
  --change 'ENV OH_ENABLE_VNC=false' --change 'ENV LOG_JSON=true' \
  --change 'USER openhands' --change 'WORKDIR /' --change 'EXPOSE 8000' \
  --change 'ENTRYPOINT ["tini", "--", "/agent-server/.venv/bin/python", "-m", "openhands.agent_server"]' \
  "$tarball" "$image" >/dev/null
say "imported $image"
echo "$image"
