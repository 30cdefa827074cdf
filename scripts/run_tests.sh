#!/usr/bin/env bash
# `make test`'s pytest: two pytest processes side by side on CI's two cores, tests/engine in one and
# every other test in the other, each in collection order (files share state within a process:
# session fixtures, the one ComfyUI server the integration and reliability tests take turns on,
# Dynamo's and the engine's counters, so the split is by these two groups and never finer).
# Each writes its own log; both are printed and the exit status is the first failure's.
# TEST_WORKERS=1, or any PYTEST_ARGS, runs one plain pytest instead.
set -uo pipefail
PY=${PY:?the venv python}
if [[ "${TEST_WORKERS:-2}" == "1" || -n "${PYTEST_ARGS:-}" ]]; then
  exec "$PY" -m pytest -ra ${PYTEST_ARGS:-}
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/nexfort-tests.XXXXXX")
"$PY" -m pytest -ra -p no:cacheprovider --basetemp="$tmp/engine" tests/engine >"$tmp/engine.log" 2>&1 &
a=$!
"$PY" -m pytest -ra -p no:cacheprovider --basetemp="$tmp/host" tests --ignore=tests/engine >"$tmp/host.log" 2>&1 &
b=$!
wait $a; ra=$?
echo "=== pytest tests/engine (exit $ra) ==="; cat "$tmp/engine.log"
wait $b; rb=$?
echo "=== pytest tests --ignore=tests/engine (exit $rb) ==="; cat "$tmp/host.log"
rm -rf "$tmp"
if [[ $ra -ne 0 ]]; then exit $ra; fi
exit $rb
