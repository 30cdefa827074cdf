#!/usr/bin/env bash
# run193: the cut weighed by kernels (new, the checkout) against the node-count cut (old, .old/tree = df48125)
# usage: bash .old/run193.sh a|b
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
  env "$@" timeout 200 python3 $tree/benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never \
    --compiler nexfort --model $model --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/$tag-$RANDOM \
    --repeat ${REPEAT:-1} ${EXTRA:-} --output-json $OUT/r/$tag.json > $OUT/r/$tag.log 2>&1
  echo "$tag rc=$? wall=$(( $(date +%s) - t0 ))s"
  python3 .old/summ.py $OUT/r/$tag.json | grep -v "^   late" | tee -a $OUT/r/summary.txt
}
case "${1:-a}" in
  a) one sdxl_new $R sdxl; one sdxl_old $R/.old/tree sdxl; one sd21_new $R sd21; one sd21_old $R/.old/tree sd21; one sdxl_new2 $R sdxl ;;
  b) shift; for t in "$@"; do case $t in *old*) tree=$R/.old/tree;; *) tree=$R;; esac; case $t in sdxl*) m=sdxl;; *) m=sd21;; esac; one $t $tree $m; done ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
