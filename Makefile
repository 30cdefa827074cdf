# The README's contract: `make demo` and `make test` on a fresh machine.
SHELL := /bin/bash
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
HOST ?= $(CURDIR)/.host/ComfyUI
export NEXFORT_HOST := $(HOST)
# The suite runs in TEST_WORKERS pytest processes side by side: tests/engine in one, the rest (and
# any engine files scripts/run_tests.sh moves to balance the halves) in the other.
# tests/conftest.py sets OMP_WAIT_POLICY=PASSIVE for pytest and all it starts: libgomp's spinning
# idle threads made a tiny model's sampling 10x slower beside a second busy process (the soak test:
# 0.5-1 s per prompt alone, 5-10 s beside the other pytest).
TEST_WORKERS ?= 2

.PHONY: host demo test test-fast lint clean-host

host:
	@scripts/setup_host.sh
	@scripts/setup_browser.sh >/dev/null

demo: host
	$(PY) scripts/demo.py --host $(HOST)

test: host
	$(PY) -m ruff check .
	PY=$(PY) TEST_WORKERS=$(TEST_WORKERS) PYTEST_ARGS="$(PYTEST_ARGS)" scripts/run_tests.sh

test-fast: host
	$(PY) -m pytest -ra -m "not inductor and not integration and not browser" $(PYTEST_ARGS)

lint: host
	$(PY) -m ruff check .

clean-host:
	rm -rf .venv .host
