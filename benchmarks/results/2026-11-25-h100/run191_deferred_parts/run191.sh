#!/usr/bin/env bash
# run191: the split's parts collected after Dynamo built its guards (new, HEAD) vs before (old, .old = HEAD~2)
# usage: bash .old/run191.sh a|b|c
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
    --repeat ${REPEAT:-2} ${EXTRA:-} --output-json $OUT/r/$tag.json > $OUT/r/$tag.log 2>&1
  echo "$tag rc=$? wall=$(( $(date +%s) - t0 ))s"
  python3 .old/summ.py $OUT/r/$tag.json | tee -a $OUT/r/summary.txt; grep -a "^sweep" $OUT/r/$tag.log | tail -17
}
case "${1:-a}" in
  a) one sd21_new $R sd21; one sd21_old $R/.old sd21; one sdxl_old $R/.old sdxl; one sdxl_new $R sdxl ;;
  b) one sdxl_new2 $R sdxl; one sdxl_share07 $R sdxl NEXFORT_OWN_PART_SHARE=0.7; one sdxl_old2 $R/.old sdxl ;;
  c) one sd21_old2 $R/.old sd21; EXTRA=--warm-cache-check one sd21_new2 $R sd21; one sd21_share07 $R sd21 NEXFORT_OWN_PART_SHARE=0.7; one sd21_old3 $R/.old sd21 ;;
esac
if [ "${1:-}" = d ]; then
  EXTRA=--run_multiple_resolutions one sdxl_sweep $R sdxl
  one sdxl_old3 $R/.old sdxl
  EXTRA=--run_multiple_resolutions one sd21_sweep $R sd21
fi
if [ "${1:-}" = e ]; then
  export REPEAT=1
  one sdxl_e_new1 $R sdxl; one sdxl_e_old1 $R/.old sdxl; one sdxl_e_new2 $R sdxl; one sdxl_e_old2 $R/.old sdxl
fi
