#!/usr/bin/env bash
# Install what the browser test (tests/test_web_status.py) needs on a fresh Debian machine:
# Debian's chromium (apt) and a font, and the Python `playwright` client in the venv (the pack's
# `test` extra already lists it). Playwright drives the system chromium through executable_path;
# no browser is ever downloaded (`playwright install` is never run).
#
# Idempotent: a second run finds chromium and playwright and returns at once.
# Needs root or passwordless sudo for apt; without either it says so and exits 0, and the browser
# test then skips with that reason. Prints the chromium path as its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NEXFORT_VENV:-$ROOT/.venv}"
VPY="$VENV/bin/python"
CONSTRAINTS="$ROOT/scripts/constraints.txt"

log() { printf '[setup_browser] %s\n' "$*" >&2; }

find_chromium() {
  if [ -n "${NEXFORT_CHROMIUM:-}" ] && [ -x "$NEXFORT_CHROMIUM" ]; then
    echo "$NEXFORT_CHROMIUM"; return 0
  fi
  local c
  for c in chromium chromium-browser google-chrome-stable google-chrome; do
    if command -v "$c" >/dev/null 2>&1; then command -v "$c"; return 0; fi
  done
  return 1
}

# 1. Chromium (+ a font so text renders) from Debian.
if ! find_chromium >/dev/null; then
  if [ "$(id -u)" = 0 ]; then SUDO=""
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"
  else
    log "chromium is missing and apt needs root (no passwordless sudo): browser tests will skip"
    exit 0
  fi
  log "installing chromium from apt"
  $SUDO apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
    chromium fonts-dejavu-core >&2
fi
CHROMIUM="$(find_chromium)" || { log "chromium not found after install"; exit 1; }

# 2. The Python playwright client (driver only; never `playwright install`).
if [ -x "$VPY" ] && ! "$VPY" -c "import playwright.sync_api" 2>/dev/null; then
  log "installing the playwright python client into $VENV"
  if [ -f "$CONSTRAINTS" ]; then
    "$VPY" -m pip install -q -c "$CONSTRAINTS" "playwright>=1.40" >&2
  else
    "$VPY" -m pip install -q "playwright>=1.40" >&2
  fi
fi

log "chromium: $("$CHROMIUM" --version 2>/dev/null | tail -n1)"
echo "$CHROMIUM"
