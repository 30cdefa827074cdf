#!/usr/bin/env bash
# run185: shipped parts (new code) measured on the GPU. Usage: bash .old/run185.sh a|b
R=$(pwd); W=/tmp/nexfort_device; P=$1
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
print(" ", {k: r.get(k) for k in ("warmup_s","it_s","compile_parts","compile_phases","peak_mem_gib","recompiles","fallback_reasons")})
PY
}
N='--compiler nexfort'
if [ "$1" = a ]; then
T=150 run $R sd21_new $N --model sd21 --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/sn --repeat 1
T=180 run $R sdxl_new $N --model sdxl --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/xn --repeat 1
T=60 run $R sd21_new_warm $N --model sd21 --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/sn --repeat 1 --warm-child
T=90 run $R sdxl_new_warm $N --model sdxl --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/xn --repeat 1 --warm-child
else
T=120 run $R sd21_w8 $N --model sd21 --compiler-config '{"mode":"O2","compile_workers":8}' --cache-dir $W/cache/s8 --repeat 1
T=140 run $R sd21_comfy --compiler comfy --model sd21 --cache-dir $W/cache/sc --repeat 1
T=150 run $R/.old sd21_old $N --model sd21 --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/so --repeat 1
T=150 run $R sdxl_w8 $N --model sdxl --compiler-config '{"mode":"O2","compile_workers":8}' --cache-dir $W/cache/x8 --repeat 1
fi
cd $OUT/r && tar -czf ../r185$P.tgz *.json *.log && rm -f *.log *.json
