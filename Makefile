# elastrain — the two commands that matter: `make run` and `make test`.
# Both bootstrap .venv themselves (Python >= 3.11, packages from PyPI; torch is the pinned CPU wheel).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest processes of make test (pytest-xdist; 0: in pytest's own process). Three on two cores:
# many tests wait on processes they started, so a third keeps the cores busier
TEST_WORKERS ?= 3

.PHONY: wrk venv run test test-installed test-gpu lint types unit integration bench faults deploy-sync clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m scripts.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check service worker tests benchmarks scripts
	$(VENV)/bin/ruff format --check service worker tests benchmarks scripts

types: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

integration: $(STAMP)
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

# Each test runs once: the installed-distribution subset (the unit tests and a few launches, see
# scripts/test_installed.py) against the wheel, everything else from the tree. Every benchmark's
# short run (`make bench QUICK=1`, numbers not kept) runs beside them at a lower priority (nice),
# so that a benchmark that breaks fails the suite; its output goes to build/bench-quick.log and
# is shown when one fails.
BENCH_LOG := build/bench-quick.log
test: lint types wrk
	@mkdir -p build; nice -n 10 $(PY) -m benchmarks.run_all --quick --no-table >$(BENCH_LOG) 2>&1 & bench=$$!; failed=0; \
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadscope $$($(PY) -m scripts.test_installed --rest) $(PYTEST_ARGS) || failed=1; \
	$(PY) -m scripts.test_installed -n $(TEST_WORKERS) --dist loadscope || failed=1; \
	echo "waiting for the benchmarks' short runs ($(BENCH_LOG))"; \
	if wait $$bench; then tail -n 1 $(BENCH_LOG); else tail -n 80 $(BENCH_LOG); echo "a benchmark failed: $(BENCH_LOG)"; failed=1; fi; \
	exit $$failed

# Part of the suite against the distribution users install: a wheel of this tree, installed (not
# editable) into build/installed/venv, run from a copy of tests/ with no service/ or worker/
# beside it and no PYTHONPATH (see scripts/test_installed.py).
test-installed: $(STAMP)
	$(PY) -m scripts.test_installed $(PYTEST_ARGS)

# The worker's GPU paths (tests/gpu: NCCL, AMP's scaler on CUDA, resume bit for bit on the device),
# on a machine with a CUDA GPU and a CUDA build of torch in .venv; not part of `make test` (the
# test machines have none). Without a visible GPU each test fails saying so.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/gpu $(PYTEST_ARGS)

# Every benchmark, then docs/benchmarks.md's table rewritten from their results; QUICK=1: each in
# its short mode (rough numbers, marked so). wrk (Debian package) is the low-CPU load generator of
# benchmarks/service_api.py; installed with apt-get when missing and we are root, otherwise that
# benchmark says it ran without it.
QUICK ?=
bench: $(STAMP) wrk
	$(PY) -m benchmarks.run_all $(if $(QUICK),--quick)

wrk:
	@command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		echo "installing Debian's wrk for the API load benchmark" && \
		(apt-get install -y -q wrk >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q wrk >/dev/null)); } || true

# The fault matrix, each row TRIALS times with recorded seeds; writes a results table.
TRIALS ?= 1
faults: $(STAMP)
	$(PY) -m scripts.faults --trials $(TRIALS)
	ELASTRAIN_SCHEMATHESIS_EXAMPLES=500 $(PY) -m pytest -q -p no:cacheprovider tests/integration/service/test_svc_schemathesis.py

# Copy deploy/prometheus and deploy/grafana into the chart and re-render deploy/k8s.
deploy-sync: $(STAMP)
	$(PY) -m scripts.deploy_tools sync

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build
