#!/usr/bin/env bash
# Source on the lent GPU machine: ComfyUI unpacked from the carried .device/comfyui.tar.gz, the
# carried wheels installed under $WORK/site, this pack linked into custom_nodes/. Exports COMFY
# (the tree), WORK and PYTHONPATH; scripts/device_run.sh and one-off commands share it:
#   run(carry=[".device", ".whl"], command='source scripts/device_env.sh && python3 -m benchmarks.per_image --comfy-root $COMFY ...')
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVDIR="${NEXFORT_DEVICE_DIR:-.device}"
DEVDIR="${DEVDIR%/}"
if [ "$DEVDIR" = ".device" ]; then WORK="${NEXFORT_DEVICE_WORK:-/tmp/nexfort_device}"
else WORK="${NEXFORT_DEVICE_WORK:-/tmp/nexfort_device_${DEVDIR#.}}"; fi
PY="${PYTHON:-python3}"
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
# The device image sets PYTHONDONTWRITEBYTECODE=1 and ships torch without __pycache__, so every new
# process compiled torch's, ComfyUI's and our sources to bytecode again. A pip-installed torch has
# its .pyc files: measure like that.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$WORK/pycache"
if [ ! -f "$ROOT/$DEVDIR/comfyui.tar.gz" ]; then
    echo "missing $DEVDIR/comfyui.tar.gz: run scripts/device_bundle.sh here and carry $DEVDIR (and .whl)" >&2
    return 1 2>/dev/null || exit 1
fi
if [ ! -d "$WORK/ComfyUI" ]; then
    tar -xzf "$ROOT/$DEVDIR/comfyui.tar.gz" -C "$WORK" || { echo "unpacking ComfyUI failed" >&2; return 1 2>/dev/null || exit 1; }
fi
export COMFY="$WORK/ComfyUI"
if [ -f "$ROOT/$DEVDIR/site.tar.xz" ]; then
    if [ ! -f "$WORK/site/.unpacked" ]; then
        mkdir -p "$WORK/site" && tar -xJf "$ROOT/$DEVDIR/site.tar.xz" -C "$WORK/site" && touch "$WORK/site/.unpacked"
    fi
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
elif ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    if [ ! -f "$WORK/site/.installed" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
            "$ROOT"/.whl/*.whl 2>&1 | tail -3 && touch "$WORK/site/.installed"
    fi
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "warning: no .whl/*.whl carried (ComfyUI needs torchsde, trampoline, av)" >&2
fi
mkdir -p "$COMFY/custom_nodes"
ln -sfn "$ROOT" "$COMFY/custom_nodes/nexfort"
