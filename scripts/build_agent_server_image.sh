#!/usr/bin/env bash
# Build the OpenHands agent-server image with MARS tool events (docker/agent-server/Dockerfile).
#
#   scripts/build_agent_server_image.sh [--tag IMAGE:TAG] [--base IMAGE] [--context DIR] [--dry-run]
#
# Defaults: --base ghcr.io/openhands/agent-server:1.34.0-python (what openhands-ai 1.11 pins),
# --tag mars-openhands/agent-server:1.34.0-python (what `mars-openhands openhands app-env
# --sandbox docker` names). The build context is a temporary directory holding the Dockerfile and
# a wheel of this checkout, nothing else. --dry-run prepares the context, prints the docker
# command and the context's files, and does not need a Docker daemon.
# Variables: MARS_PYTHON (interpreter that builds the wheel; default .venv-openhands, .venv, python3).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="ghcr.io/openhands/agent-server:1.34.0-python"
tag="mars-openhands/agent-server:1.34.0-python"
context=""
dry_run=0
while (( $# )); do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --context) context="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "build_agent_server_image.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

python="${MARS_PYTHON:-}"
for candidate in "$root/.venv-openhands/bin/python" "$root/.venv/bin/python" python3; do
  [[ -n "$python" ]] && break
  command -v "$candidate" >/dev/null 2>&1 && python="$candidate"
done
if [[ -z "$context" ]]; then context="$(mktemp -d -t mars-agent-server-XXXXXX)"; fi
mkdir -p "$context"
rm -f "$context"/mars_openhands-*.whl
"$python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$context" "$root" >/dev/null
cp "$root/docker/agent-server/Dockerfile" "$context/Dockerfile"
cmd=(docker build --build-arg "AGENT_SERVER_IMAGE=$base" -t "$tag" "$context")
if (( dry_run )); then
  echo "context: $context"
  (cd "$context" && ls -1)
  printf 'would run:'; printf ' %q' "${cmd[@]}"; echo
  exit 0
fi
command -v docker >/dev/null 2>&1 || { echo "build_agent_server_image.sh: docker not found (try --dry-run)" >&2; exit 1; }
"${cmd[@]}"
echo "built $tag; now: mars-openhands openhands app-env --sandbox docker --gateway http://<gateway>:8000"
