# The README's contract: `make demo` and `make test` on a fresh machine.
SHELL := /bin/bash
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
HOST ?= $(CURDIR)/.host/ComfyUI
export NEXFORT_HOST := $(HOST)

.PHONY: host demo test test-fast lint clean-host

host:
	@scripts/setup_host.sh
	@scripts/setup_browser.sh >/dev/null

demo: host
	$(PY) scripts/demo.py --host $(HOST)

test: host
	$(PY) -m ruff check .
	$(PY) -m pytest -ra $(PYTEST_ARGS)

test-fast: host
	$(PY) -m pytest -ra -m "not inductor and not integration and not browser" $(PYTEST_ARGS)

lint: host
	$(PY) -m ruff check .

clean-host:
	rm -rf .venv .host
