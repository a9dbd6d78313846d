# The two commands: `make run` (the demo, or POLICY=path for real replicas) and `make test`.
# `make lint`: ruff, mypy (files and options in pyproject's [tool.mypy]) and the import contracts.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Installs are pinned to constraints.txt (exact versions), so a routine upgrade of a library
# whose internals the code relies on never lands unnoticed.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
POLICY ?=

.PHONY: run test bench bench-clients fuzz soak lint venv compiled clean

venv: $(STAMP)

# The request path compiled with mypyc (proxy/compiled.py): built when missing or stale, in
# about two minutes; nothing to do when current. Without a C compiler the gateway runs
# interpreted. TOKENLANE_INTERPRETED=1 runs it interpreted whatever is built.
compiled: venv
	$(PY) scripts/compile.py

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

run: compiled
ifeq ($(POLICY),)
	$(PY) -m proxy demo --policy config/policy.demo.yaml
else
	$(PY) -m proxy serve --config $(POLICY)
endif

test: compiled
	@scripts/system-deps.sh
	$(PY) -m pytest $(PYTEST_ARGS)

bench: compiled
	$(PY) -m loadtest.bench_overhead
	$(PY) -m loadtest.bench_overhead --peer --workers 2
	$(PY) -m loadtest.bench_floor
	$(PY) -m loadtest.bench_segments
	$(PY) -m loadtest.bench_workers --workers 2 --hold
	@for b in loadtest/bench_parse.py loadtest/bench_sim.py loadtest/bench_stall.py loadtest/bench_overload.py loadtest/bench_cache.py; do \
	  if [ -f $$b ]; then $(PY) -m loadtest.$$(basename $$b .py) || exit 1; fi; done

# inference-perf (installed on first use into its own virtualenv, Python >= 3.12) through the
# demo in its chat, completion and Anthropic Messages modes; its TTFT against the access log's.
bench-clients: compiled
	$(PY) -m loadtest.bench_clients

# 10,000 generated bodies through a gateway and two simulators (`make test` sends 500);
# TOKENLANE_FUZZ_SEED=N for other bodies.
fuzz: compiled
	TOKENLANE_FUZZ_BODIES=$${TOKENLANE_FUZZ_BODIES:-10000} $(PY) -m pytest tests/test_fuzz.py --reruns 0 -s -q

# Streaming load through the demo fleet with a rotating fault every minute, 30 minutes
# (MINUTES=N for a shorter run).
soak: compiled
	$(PY) -m loadtest.bench_soak --minutes $${MINUTES:-30}

lint: venv
	$(VENV)/bin/ruff check proxy loadtest tests scripts
	$(VENV)/bin/ruff format --check proxy loadtest tests scripts
	$(VENV)/bin/mypy
	$(PY) -m pytest -q tests/test_layers.py tests/test_sim_imports.py tests/test_internals.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
