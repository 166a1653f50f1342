#!/usr/bin/env bash
# Build the OpenHands agent-server image with MARS tool events (docker/agent-server/Dockerfile).
#
#   scripts/build_agent_server_image.sh [--tag IMAGE:TAG] [--base IMAGE] [--pull | --offline]
#                                       [--cache DIR] [--context DIR] [--dry-run]
#
# Defaults: --base ghcr.io/openhands/agent-server:1.34.0-python (what openhands-ai 1.11 pins),
# --tag mars-openhands/agent-server:1.34.0-python (what `mars-openhands openhands app-env
# --sandbox docker` names). The build context is a temporary directory holding the Dockerfile and
# a wheel of this checkout, nothing else.
# Where the base comes from (the script says which it took):
#   --pull     the registry's image: the daemon's copy, else `docker pull` (fails if it cannot);
#   --offline  no registry of images: a stand-in built from Debian's packages and PyPI's wheels
#              (docker/agent-server-base/build.sh; cached by content in --cache), and the
#              image builds with no network (`docker build --network none`);
#   neither    the registry's image if the daemon has it or can pull it within
#              MARS_PULL_TIMEOUT_S (default 120) seconds, else the offline path.
# --dry-run prepares the context, prints the docker command and the context's files, and does
# not need a Docker daemon.
# Variables: MARS_PYTHON (interpreter that builds the wheel; default .venv-openhands, .venv, python3).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="ghcr.io/openhands/agent-server:1.34.0-python"
tag="mars-openhands/agent-server:1.34.0-python"
context=""
source_of_base=auto
cache_args=()
dry_run=0
while (( $# )); do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --pull) source_of_base=pull; shift ;;
    --offline) source_of_base=offline; shift ;;
    --cache) cache_args=(--cache "$2"); shift 2 ;;
    --context) context="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "build_agent_server_image.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

python="${MARS_PYTHON:-}"
for candidate in "$root/.venv-openhands/bin/python" "$root/.venv/bin/python" python3; do
  [[ -n "$python" ]] && break
  command -v "$candidate" >/dev/null 2>&1 && python="$candidate"
done
if [[ -z "$context" ]]; then  # ours: removed at exit, except after --dry-run (it shows it)
  context="$(mktemp -d -t mars-agent-server-XXXXXX)"
  (( dry_run )) || trap 'rm -rf "$context"' EXIT
fi
mkdir -p "$context"
rm -f "$context"/mars_openhands-*.whl
"$python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$context" "$root" >/dev/null
cp "$root/docker/agent-server/Dockerfile" "$context/Dockerfile"
if (( dry_run )); then
  echo "context: $context"
  (cd "$context" && ls -1)
  if [[ "$source_of_base" == offline ]]; then
    echo "base: a stand-in built by docker/agent-server-base/build.sh (offline path)"
    printf 'would run: docker build --network none --build-arg AGENT_SERVER_IMAGE=<stand-in> -t %q %q\n' "$tag" "$context"
  else
    printf 'would run:'; printf ' %q' docker build --build-arg "AGENT_SERVER_IMAGE=$base" -t "$tag" "$context"; echo
  fi
  exit 0
fi
command -v docker >/dev/null 2>&1 || { echo "build_agent_server_image.sh: docker not found (try --dry-run)" >&2; exit 1; }

# registry_base: 0 when the daemon has $base or pulled it (says so), 1 otherwise.
registry_base() {
  if docker image inspect "$base" >/dev/null 2>&1; then
    echo "[build] base: $base (in the daemon already; registry path)"; return 0
  fi
  local limit="${MARS_PULL_TIMEOUT_S:-120}" log
  log="$(mktemp)"
  if timeout "$limit" docker pull --quiet "$base" >"$log" 2>&1; then
    echo "[build] base: $base (pulled; registry path)"; rm -f "$log"; return 0
  fi
  echo "[build] could not pull $base (limit $limit s): $(tail -n 1 "$log")" >&2
  rm -f "$log"; return 1
}

network=()
if [[ "$source_of_base" == offline ]] || { [[ "$source_of_base" == auto ]] && ! registry_base; }; then
  start=$SECONDS
  base="$("$root/docker/agent-server-base/build.sh" ${cache_args[@]+"${cache_args[@]}"} | tail -n 1)"
  echo "[build] base: $base (offline path: Debian's packages and PyPI's wheels; $((SECONDS - start)) s)"
  network=(--network none)  # everything is in the context and the base: nothing to fetch
elif [[ "$source_of_base" == pull ]]; then
  registry_base || { echo "build_agent_server_image.sh: no base image $base (try --offline)" >&2; exit 1; }
fi
docker build ${network[@]+"${network[@]}"} --build-arg "AGENT_SERVER_IMAGE=$base" -t "$tag" "$context"
echo "built $tag FROM $base; now: mars-openhands openhands app-env --sandbox docker --gateway http://<gateway>:8000"
