#!/usr/bin/env bash
# Warm starts with and without the prewarm (nexfort_engine.prewarm), alternated on one machine: one
# cold run fills a compile cache, then ROUNDS pairs of the bench's warm child (a new process on that
# cache) run with the prewarm and with --no-prewarm, in turn. Writes, under $OUT:
#   <name>_cold.json              the cold run
#   <name>_warm_<i>_<on|off>.json each child's result (warmup_s, compile phases, prewarm state)
#   <name>_warm_ab.txt            one line per child
# Usage (repository root, after scripts/device_run.sh set up ComfyUI in $NEXFORT_DEVICE_WORK):
#   bash benchmarks/warm_start_ab.sh NAME 'BENCH ARGS' [ROUNDS]   e.g. flux "--model flux --compiler-config '{\"mode\": \"O3\"}'" 2
# AB_MODES="on" runs only the "on" children (the default, e.g. with the precompiled graphs on).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${NEXFORT_DEVICE_WORK:-/tmp/nexfort_device}"
OUT="${OUT:-$ROOT/out/device}"
PY="${PYTHON:-python3}"
name="$1"; eval "args=($2)"; rounds="${3:-2}"
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE  # as scripts/device_run.sh: bytecode cached like a pip install's
export PYTHONPYCACHEPREFIX="$WORK/pycache"
cache="$WORK/cache/ab_$name"
mkdir -p "$OUT" "$cache"
bench=("$PY" "$ROOT/benchmarks/text_to_image.py" --comfy-root "$WORK/ComfyUI" --compiler nexfort "${args[@]}"
       --fp32-reference never --cache-dir "$cache")
"${bench[@]}" --repeat 1 --output-json "$OUT/${name}_cold.json" 2>&1 | grep -E "^RESULT|Error|precompiled"
for i in $(seq 1 "$rounds"); do
    for mode in ${AB_MODES:-on off}; do
        flag=(); [ "$mode" = off ] && flag=(--no-prewarm)
        out="$OUT/${name}_warm_${i}_${mode}.json"
        "${bench[@]}" --warm-child --repeat 0 "${flag[@]}" --output-json "$out" > /dev/null 2>&1
        "$PY" - "$out" "$mode" >> "$OUT/${name}_warm_ab.txt" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
ph = r.get("compile_phases_s") or {}
keep = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler")
print(f"prewarm={sys.argv[2]} warmup_s={r.get('warmup_s'):.2f} prewarm_at_first_call={r.get('prewarm_at_first_call')} "
      f"phases={ {k: ph.get(k) for k in keep} } compiles={r.get('compiles')} hits={r.get('cache_hits')} "
      f"fallbacks={r.get('fallbacks')} {r.get('fallback_reasons') or ''}")
PYEOF
    done
done
cat "$OUT/${name}_warm_ab.txt"
