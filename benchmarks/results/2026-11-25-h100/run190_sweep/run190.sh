#!/usr/bin/env bash
# run190: the 16-combination sweep (4 resolutions x 2 step counts x 2 prompt lengths) on the cut graph, SD2.1 and SDXL O2 cold (cdb3abe)
R=$(pwd); W=/tmp/nexfort_device; P=190
ls $W/ComfyUI >/dev/null 2>&1 || BUDGET_S=60 MIN_LEFT_S=30 bash scripts/device_run.sh -- > $OUT/setup_log.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=$W/pycache
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/r/gpu_$P.txt; nproc >> $OUT/r/gpu_$P.txt
run() { # run <tree> <name> args...
  local tree=$1 name=$2; shift 2
  local t0=$(date +%s)
  (cd $tree && PYTHONPATH=$PWD:$W/site timeout ${T:-200} python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never "$@" --output-json $OUT/r/$name.json > $OUT/r/$name.log 2>&1)
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a $OUT/r/summary_$P.txt
  grep -a "^RESULT\|nexfort:.*\(fail\|fall\)" $OUT/r/$name.log | cut -c1-600 >> $OUT/r/summary_$P.txt
  python3 - $OUT/r/$name.json >> $OUT/r/summary_$P.txt 2>/dev/null <<'PY'
import json,sys
r=json.load(open(sys.argv[1]))["runs"][0]
print(" ", {k: r.get(k) for k in ("warmup_s","it_s","compile_parts","peak_mem_gib","compiles","recompiles","recompile_reasons","fallback_reasons")}); print("  sweep:", [(x.get("height"), x.get("width"), x.get("steps"), x.get("text_len"), x.get("new_compiles", x.get("compiles"))) for x in r.get("sweep", [])])
print("  it/s each:", [round(x["it_s"],2) for x in r["runs"]], "autotune:", (r.get("compile_phases_s") or {}).get("CachingAutotuner.benchmark_all_configs"))
PY
}
N='--compiler nexfort'
B='{"mode":"O2"}'
T=200 run $R sd21_sweep $N --model sd21 --compiler-config "$B" --cache-dir $W/cache/s --repeat 1 --run_multiple_resolutions
T=300 run $R sdxl_sweep $N --model sdxl --compiler-config "$B" --cache-dir $W/cache/x --repeat 1 --run_multiple_resolutions
cd $OUT/r && tar -czf ../r$P.tgz *.json *.log && rm -f *.log *.json
