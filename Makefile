# The two commands: `make run` (the main job) and `make test` (all tests). Both install what is
# missing first (scripts/install.sh, quick when nothing changed).
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= examples/calc.toml
RUN_ARGS ?=
PYTEST_ARGS ?=

.PHONY: run run-code test chaos install proto proto-check lint typecheck-count up down status clean sglang-contract image compose-up compose-down

run: install
	$(VENV)/bin/rlfleet run $(CONFIG) $(RUN_ARGS)

# The second job: a coding agent on the repo suite, every episode in a fresh sandbox (examples/code.toml).
run-code: install
	$(VENV)/bin/rlfleet run examples/code.toml $(RUN_ARGS)

# The chaos run (tests/integration/test_chaos.py, 1.5-8 minutes here) is part of it. The 25 slowest tests
# are listed at the end, so that a CI run that takes longer says where the time went.
test: install
	$(PY) -m pytest -m "not gpu" --durations=25 $(PYTEST_ARGS)

# The chaos run alone: every service, NATS and Redis SIGKILLed once in one run; prints the recovery
# table (CHAOS_SEED=random draws the kill order and moments).
chaos: install
	CHAOS_SEED=$${CHAOS_SEED:-7} $(PY) -m pytest -m chaos -s tests/integration/test_chaos.py $(PYTEST_ARGS)

install:
	@bash scripts/install.sh

proto: install
	$(PY) scripts/gen_proto.py

proto-check: install
	$(PY) scripts/gen_proto.py --check

# Regenerates contracts/sglang-<version>.json from SGLang's own wheel (a throwaway venv, ~2.6 GB, PyPI).
sglang-contract:
	python3.11 scripts/sglang_contract.py

# The packages mypy checks in `make lint` ([tool.mypy] in pyproject.toml is its config): every package
# of libs/ and services/, a new one as soon as it exists. The generated rlfleet.api is left out (its
# .pyi stubs type it for the others). `make typecheck-count` counts the errors per package.
ALL_PACKAGES := $(filter-out %/api,$(wildcard libs/*/src/rlfleet/* services/*/src/rlfleet/*))
TYPED := $(ALL_PACKAGES)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy $(TYPED)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/gen_proto.py --check

typecheck-count: install
	-$(VENV)/bin/mypy $(ALL_PACKAGES) | grep -E '^(libs|services)/[^:]+:[0-9]+: error' | cut -d/ -f1-2 | sort | uniq -c

up: install
	$(VENV)/bin/rlfleet up --detach

down:
	$(VENV)/bin/rlfleet down

status:
	$(VENV)/bin/rlfleet status

clean:
	rm -rf runs .pytest_cache

# docker compose (deploy/compose): one image built with no registry, the config `rlfleet up` would
# write, generated into $(COMPOSE_DIR) with free loopback ports; see the README's "Docker compose".
COMPOSE_DIR ?= runs/compose
COMPOSE_ARGS ?=
COMPOSE := docker-compose --env-file $(COMPOSE_DIR)/compose.env -f deploy/compose/compose.yaml

image: install
	bash deploy/docker/build.sh

compose-up: image
	$(VENV)/bin/rlfleet compose-config --config deploy/compose/rlfleet.toml --out $(COMPOSE_DIR) $(COMPOSE_ARGS)
	$(COMPOSE) up -d
	$(COMPOSE) ps

compose-down:
	@if [ -f $(COMPOSE_DIR)/compose.env ]; then $(COMPOSE) down --volumes --remove-orphans; \
	else docker-compose -f deploy/compose/compose.yaml down --volumes --remove-orphans; fi
