#!/usr/bin/env bash
# Prepare what a GPU run of the benchmarks needs on the lent device machine (see BENCHMARKS.md).
#
# The device has torch/triton/numpy/transformers/... but no registry access and no ComfyUI. This
# script makes, in folders ignored by git (listed in .git/info/exclude and .gitignore):
#   .device/comfyui.tar.gz   the ComfyUI tree from $NEXFORT_HOST (default .host/ComfyUI) without
#                            tests, API nodes, models, outputs, caches (~7 MB)
#   .whl/                    cp312 manylinux wheels ComfyUI needs that the device image lacks:
#                            torchsde, trampoline (torchsde's dependency), av
#   .whltest/                pytest and its dependencies, to run the gpu-marked tests there
# Then a device call carries both: run(carry=[".device", ".whl"],
#   command='bash scripts/device_run.sh -- "--model sd21 --compiler none" ...').
#
# A newer ComfyUI tree (0.33+: comfy-kitchen, comfy-aimdo, simpleeval, blake3 besides the wheels
# above) goes into a folder of its own, with its packages pre-installed for the device's Python and
# packed as one xz tarball (comfy-kitchen's wheel alone is 58 MB, over the carry limit; without its
# ROCm backend and with xz it is ~21 MB):
#   NEXFORT_HOST=/path/to/newer/ComfyUI NEXFORT_DEVICE_DIR=.device33 scripts/device_bundle.sh
#   -> .device33/comfyui.tar.gz, .device33/site.tar.xz; then
#   run(carry=[".device33"], command='NEXFORT_DEVICE_DIR=.device33 bash scripts/device_run.sh -- ...')
#
# Usage: scripts/device_bundle.sh [--force]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOST="${NEXFORT_HOST:-$ROOT/.host/ComfyUI}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

# Wheels pinned to what the host venv runs (ComfyUI 0.3.75 works with these).
# and the pack's own requirements.txt (what ComfyUI-Manager installs with it): cuDNN's fp8 attention
WHEELS=(torchsde==0.2.6 trampoline==0.1.2 av==18.1.0 nvidia-cudnn-frontend==1.20.0)
# pure-Python wheels for running the gpu-marked tests there (.whltest/, carried only for that)
TEST_WHEELS=(pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1)

DIR="${NEXFORT_DEVICE_DIR:-.device}"
DIR="${DIR%/}"

cd "$ROOT"
if [ ! -f "$HOST/comfy/model_management.py" ]; then
    echo "no ComfyUI tree at $HOST: run 'make host' (scripts/setup_host.sh) or set NEXFORT_HOST" >&2
    exit 1
fi

# keep the bundles out of git (and so out of the tree the device call sends, except via carry)
mkdir -p .git/info
for d in /.device/ /.whl/ "/$DIR/"; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
mkdir -p "$DIR" .whl

# 1. ComfyUI tree
TAR="$DIR/comfyui.tar.gz"
if [ "$FORCE" = 1 ] || [ ! -s "$TAR" ] || [ "$HOST/comfyui_version.py" -nt "$TAR" ]; then
    parent="$(dirname "$HOST")"; name="$(basename "$HOST")"
    tar -C "$parent" -czf "$TAR.tmp" \
        --exclude="$name/tests" --exclude="$name/tests-unit" --exclude="$name/comfy_api_nodes" \
        --exclude="$name/models/*" --exclude="$name/output/*" --exclude="$name/input/*" \
        --exclude="$name/user/*" --exclude="$name/temp" --exclude="$name/custom_nodes/*" \
        --exclude="$name/extra_model_paths.yaml" --exclude="__pycache__" --exclude="*.pyc" --exclude=".git" \
        "$name"
    mv "$TAR.tmp" "$TAR"
fi
echo "ComfyUI tree: $TAR ($(du -h "$TAR" | cut -f1))"

if [ "$DIR" != ".device" ]; then
    # a tree of its own: every package the device lacks, installed for cp312 into one xz tarball
    extra=(alembic mako sqlalchemy greenlet simpleeval blake3)
    for pkg in comfy-kitchen comfy-aimdo; do
        pin="$(grep -iE "^${pkg}([=<>~ ]|$)" "$HOST/requirements.txt" | head -1 | tr -d ' ' || true)"
        [ -n "$pin" ] && extra+=("$pin")
    done
    SITE="$DIR/site.tar.xz"
    if [ "$FORCE" = 1 ] || [ ! -s "$SITE" ] || [ "$HOST/requirements.txt" -nt "$SITE" ]; then
        tmp="$(mktemp -d)"
        plat=(--only-binary=:all: --python-version 3.12 --implementation cp
              --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64
              --platform manylinux_2_12_x86_64)
        "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$tmp/wheels" "${WHEELS[@]}" "${extra[@]}"
        "$PY" -m pip install -q --no-deps --no-index --no-compile "${plat[@]}" --target "$tmp/site" "$tmp"/wheels/*.whl
        # ROCm kernels, headers, scripts: not for the device; then only Hopper's SASS in comfy-kitchen's
        # CUDA extension (the rest zeroed in place, scripts/strip_fatbin.py: 21 -> ~4 MB with xz)
        rm -rf "$tmp/site/comfy_kitchen/backends/hip" "$tmp/site/bin" "$tmp/site/include"
        for so in "$tmp"/site/comfy_kitchen/backends/cuda/*.so; do
            [ -f "$so" ] && "$PY" "$ROOT/scripts/strip_fatbin.py" "$so" --keep-sm 90
        done
        tar -C "$tmp/site" -cf - . | xz -9 -T0 > "$SITE.tmp" && mv "$SITE.tmp" "$SITE"
        rm -rf "$tmp"
    fi
    echo "packages: $SITE ($(du -h "$SITE" | cut -f1))"
    du -ch "$DIR" | tail -1 | sed 's/total/carried in total (limit 64 MiB)/'
    exit 0
fi

# 2. wheels for the device's Python 3.12 (x86_64 manylinux); one version of each
for spec in "${WHEELS[@]}"; do
    pkg="${spec%%==*}"; ver="${spec##*==}"; pkg="${pkg//-/_}"  # wheel file names use underscores
    if [ "$FORCE" = 0 ] && ls .whl/ 2>/dev/null | grep -qiE "^${pkg}-${ver}-"; then
        continue
    fi
    rm -f .whl/"${pkg}"-*.whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -1 .whl

# 3. pytest for the GPU-marked tests, kept apart (device_run.sh installs every .whl/*.whl):
#   run(carry=[".device", ".whl", ".whltest"], command='pip install -q --no-deps --target /tmp/pt
#       .whltest/*.whl; PYTHONPATH=/tmp/pt python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine')
mkdir -p .whltest
grep -qxF "/.whltest/" .git/info/exclude 2>/dev/null || echo "/.whltest/" >> .git/info/exclude
for spec in "${TEST_WHEELS[@]}"; do
    pkg="${spec%%==*}"; ver="${spec##*==}"
    ls .whltest/ 2>/dev/null | grep -qiE "^${pkg}-${ver}-" && [ "$FORCE" = 0 ] && continue
    rm -f .whltest/"${pkg}"-*.whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whltest "$spec"
done
du -ch .device .whl .whltest | tail -1 | sed 's/total/carried in total (limit 64 MiB with the tree)/'
