#!/usr/bin/env bash
# run186: Inductor's runtime autotuning of pointwise kernels off vs on, cold SD2.1 and SDXL O2 (one machine)
R=$(pwd); W=/tmp/nexfort_device; P=186
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
print("  it/s each:", [round(x["it_s"],2) for x in r["runs"]], "autotune:", (r.get("compile_phases_s") or {}).get("CachingAutotuner.benchmark_all_configs"))
PY
}
N='--compiler nexfort'
A='{"mode":"O2"}'
B='{"mode":"O2","options":{"triton.autotune_pointwise":false}}'
T=110 run $R sd21_a $N --model sd21 --compiler-config "$A" --cache-dir $W/cache/sa --repeat 3
T=110 run $R sd21_b $N --model sd21 --compiler-config "$B" --cache-dir $W/cache/sb --repeat 3
T=150 run $R sdxl_b $N --model sdxl --compiler-config "$B" --cache-dir $W/cache/xb --repeat 3
T=150 run $R sdxl_a $N --model sdxl --compiler-config "$A" --cache-dir $W/cache/xa --repeat 3
cd $OUT/r && tar -czf ../r$P.tgz *.json *.log && rm -f *.log *.json
