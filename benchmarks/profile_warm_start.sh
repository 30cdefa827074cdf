#!/usr/bin/env bash
# Profile a warm start on the device machine: one cold run fills a compile cache, then the bench's
# warm child (a new process on that cache) runs under cProfile. Writes, under $OUT:
#   <name>_warm.prof       the raw profile (python -m pstats)
#   <name>_warm.txt        top functions by cumulative time: all, and the pack's own code
#   <name>_child.json      the child's result (warm-up time, compile phases)
# Usage (repository root, after scripts/device_run.sh set up ComfyUI in $NEXFORT_DEVICE_WORK):
#   bash benchmarks/profile_warm_start.sh NAME 'BENCH ARGS'   e.g. flux "--model flux --compiler-config '{\"mode\": \"O3\"}'"
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${NEXFORT_DEVICE_WORK:-/tmp/nexfort_device}"
OUT="${OUT:-$ROOT/out/device}"
PY="${PYTHON:-python3}"
name="$1"; eval "args=($2)"
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE  # as scripts/device_run.sh: bytecode cached like a pip install's
export PYTHONPYCACHEPREFIX="$WORK/pycache"
cache="$WORK/cache/profile_$name"
mkdir -p "$OUT" "$cache"
"$PY" "$ROOT/benchmarks/text_to_image.py" --comfy-root "$WORK/ComfyUI" --compiler nexfort "${args[@]}" \
    --fp32-reference never --repeat 1 --cache-dir "$cache" --output-json "$OUT/${name}_cold.json" 2>&1 | grep -E "^RESULT|Error"
"$PY" -m cProfile -o "$OUT/${name}_warm.prof" "$ROOT/benchmarks/text_to_image.py" --comfy-root "$WORK/ComfyUI" \
    --compiler nexfort "${args[@]}" --warm-child --repeat 0 --fp32-reference never --cache-dir "$cache" \
    --output-json "$OUT/${name}_child.json" > /dev/null 2>&1
"$PY" - "$OUT/${name}_warm.prof" > "$OUT/${name}_warm.txt" <<'PYEOF'
import pstats, sys
st = pstats.Stats(sys.argv[1])
st.sort_stats("cumulative").print_stats(70)
st.print_stats("nexfort_engine|nodes/", 40)
st.sort_stats("tottime").print_stats(40)
PYEOF
"$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print('$name warm-up', r.get('warmup_s'), r.get('compile_phases_s'))" "$OUT/${name}_child.json"
