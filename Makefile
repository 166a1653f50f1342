# mars-openhands: the commands a newcomer runs. `make test` sets everything up first.
PY      := .venv/bin/python
PY_OH   := .venv-openhands/bin/python
PYTEST  := -m pytest -q -p no:cacheprovider
# LiteLLM (pulled in by the OpenHands SDK) otherwise tries to fetch a model cost map at import.
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: setup compare test unit vllm-suite integration openhands-test openhands-app-test docker-test openhands-test-1.14 lint

setup:
	bash scripts/setup.sh

# The main job on a fresh machine: the engine env (.venv), then `mars-openhands compare` with no
# flags (every bundled session at full length, whole KV, both GPUs, every policy and the
# unbounded-KV reference; docs/compare.md). COMPARE_OUT is compare's own default folder.
COMPARE_OUT := runs/compare
compare:
	bash scripts/setup.sh engine
	.venv/bin/mars-openhands compare --out $(COMPARE_OUT)
	@echo "results in $(COMPARE_OUT)/: summary.md, results.parquet, run.json, plots"

# Fast unit tests, vLLM's own scheduler tests, then integration tests that start real vLLM servers,
# then the OpenHands env tests and the Docker sandbox tests.
test: setup lint unit vllm-suite integration openhands-test openhands-app-test docker-test

lint:
	$(PY) -m ruff check mars_openhands eval tests benchmarks scripts

unit:
	$(PY) $(PYTEST) -n 2 -m "not integration and not openhands"

# vLLM's own scheduler tests (from the pinned vLLM's sdist; scripts/setup.sh fetches them) against
# every scheduler class we ship, two classes at a time; failures must match
# tests/vllm_suite/expected_failures.toml (docs/schedulers.md, "vLLM's own scheduler tests").
vllm-suite:
	$(PY) tests/vllm_suite/run.py

# Two workers, one test file each at a time: the servers these tests start mostly wait, so two
# files at once halve the wall time on a 2-core machine (CI must stay well under 40 minutes).
integration:
	$(PY) $(PYTEST) -n 2 --dist loadfile --durations=8 -m "integration and not openhands"

# Two workers, one file each at a time (as integration: the servers and agents mostly wait).
# The agent-server image builds FROM the app's 1.34.0, so its test runs in openhands-app-test only.
openhands-test:
	$(PY_OH) $(PYTEST) -n 2 --dist loadfile --durations=5 -m openhands tests/openhands \
		--ignore=tests/openhands/test_docker_image.py

# The OpenHands app (openhands-ai 1.11) end to end, and our agent-server on the 1.34.0 it pins.
OH_APP_TESTS := tests/openhands/test_app_e2e.py tests/openhands/test_agent_server.py \
	tests/openhands/test_docker_image.py tests/openhands/test_patches.py tests/openhands/test_lifecycle.py
openhands-app-test:
	.venv-openhands-app/bin/python $(PYTEST) -n 2 --dist loadfile --durations=5 -m openhands $(OH_APP_TESTS)

# The Docker sandbox for real (tests/docker): a private dockerd of the tests' own (Debian's docker.io
# and mmdebstrap are installed when missing, as root; it fails in one line where they cannot be),
# our agent-server image built in it with no registry of images (--offline), SDK and app
# conversations in containers. One process: one engine and one image build for all of them.
docker-test:
	.venv-openhands-app/bin/python $(PYTEST) --durations=5 tests/docker

# The OpenHands adapter on the oldest supported SDK (1.14); CI runs the newest via openhands-test.
openhands-test-1.14:
	bash scripts/setup.sh openhands-1.14
	.venv-openhands-114/bin/python $(PYTEST) -m openhands tests/openhands
