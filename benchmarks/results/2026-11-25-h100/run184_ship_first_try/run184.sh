#!/usr/bin/env bash
# run184: shipped parts (new) vs traced in every child (old, 6e5d547), SD2.1 and SDXL O2 auto, cold; warm children of new
R=$(pwd); W=/tmp/nexfort_device
ls $W/ComfyUI >/dev/null 2>&1 || BUDGET_S=60 MIN_LEFT_S=30 bash scripts/device_run.sh -- > $OUT/setup_log.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=$W/pycache
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/r/gpu.txt; nproc >> $OUT/r/gpu.txt
run() { # run <tree> <name> args...
  local tree=$1 name=$2; shift 2
  local t0=$(date +%s)
  (cd $tree && PYTHONPATH=$PWD:$W/site timeout ${T:-200} python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --compiler nexfort --fp32-reference never "$@" --output-json $OUT/r/$name.json > $OUT/r/$name.log 2>&1)
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a $OUT/r/summary.txt
  tail -n 2 $OUT/r/$name.log | cut -c1-600 >> $OUT/r/summary.txt
}
C='{"mode":"O2"}'
T=150 run $R/.old sd21_old --model sd21 --compiler-config "$C" --cache-dir $W/cache/so --repeat 1
T=150 run $R sd21_new --model sd21 --compiler-config "$C" --cache-dir $W/cache/sn --repeat 1
T=180 run $R sdxl_new --model sdxl --compiler-config "$C" --cache-dir $W/cache/xn --repeat 1
T=200 run $R/.old sdxl_old --model sdxl --compiler-config "$C" --cache-dir $W/cache/xo --repeat 1
T=90 run $R sdxl_new_warm --model sdxl --compiler-config "$C" --cache-dir $W/cache/xn --repeat 1 --warm-child
T=60 run $R sd21_new_warm --model sd21 --compiler-config "$C" --cache-dir $W/cache/sn --repeat 1 --warm-child
cd $OUT/r && tar -czf ../r184.tgz *.json *.log && rm -f *.log
