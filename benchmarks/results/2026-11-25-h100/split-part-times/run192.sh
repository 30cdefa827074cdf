#!/usr/bin/env bash
# run192: every part's compile time and contents (compile_parts.each), to fit the cut's cost model
# usage: bash .old/run192.sh a|b
set -uo pipefail
W=/tmp/nexfort_device
R=$(pwd)
if [ ! -d "$W/ComfyUI" ] || [ ! -d "$W/site" ]; then bash scripts/device_run.sh -- > /dev/null 2>&1; fi
export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$W/pycache"
export PYTHONUNBUFFERED=1
mkdir -p $OUT/r
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/r/gpu.txt
nproc
one() { # tag tree model [env...]
  local tag=$1 tree=$2 model=$3; shift 3
  local t0=$(date +%s)
  env "$@" timeout 280 python3 $tree/benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never \
    --compiler nexfort --model $model --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/$tag-$RANDOM \
    --repeat ${REPEAT:-1} ${EXTRA:-} --output-json $OUT/r/$tag.json > $OUT/r/$tag.log 2>&1
  echo "$tag rc=$? wall=$(( $(date +%s) - t0 ))s"
  python3 .old/summ.py $OUT/r/$tag.json | tee -a $OUT/r/summary.txt
}
case "${1:-a}" in
  a) one sdxl_a $R sdxl; one sd21_a $R sd21; one sdxl_s10 $R sdxl NEXFORT_OWN_PART_SHARE=1.0 ;;
  b) shift; one "$@" ;;
  c) P="PYTHONPATH=$W/site:$R/benchmarks/probe_site NX_PROBE_OUT=$OUT/r/probe.jsonl NX_PROBE_CUT=$OUT/r/cut"
     one sdxl_c $R sdxl $P; one sd21_c10 $R sd21 $P NEXFORT_OWN_PART_SHARE=1.0 ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
