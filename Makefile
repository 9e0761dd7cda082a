# The two commands: `make run` (the main job) and `make test` (all tests). Both install what is
# missing first (scripts/install.sh, quick when nothing changed).
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= examples/calc.toml
RUN_ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test chaos install proto proto-check lint up down status clean sglang-contract

run: install
	$(VENV)/bin/rlfleet run $(CONFIG) $(RUN_ARGS)

test: install
	$(PY) -m pytest -m "not gpu and not chaos" $(PYTEST_ARGS)

# Every service, NATS and Redis SIGKILLed once in one run; prints the recovery table (CHAOS_SEED=random
# draws the kill order and moments).
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

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/gen_proto.py --check

up: install
	$(VENV)/bin/rlfleet up --detach

down:
	$(VENV)/bin/rlfleet down

status:
	$(VENV)/bin/rlfleet status

clean:
	rm -rf runs .pytest_cache
