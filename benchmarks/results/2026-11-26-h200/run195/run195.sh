#!/usr/bin/env bash
# run195: trace stand-ins on/off, 8 compile workers, ComfyUI's compile, SD2.1 new vs old (df48125 in .old/tree)
# usage: bash .old/run195.sh tag...   tags: {sdxl,sd21}_{new,rb (NEXFORT_RUN_AS_COMPILED=0),off,wN,comfy,old}[suffix]
set -uo pipefail
W=/tmp/nexfort_device
R=$(pwd)
if [ ! -d "$W/ComfyUI" ] || [ ! -d "$W/site" ]; then t0=$(date +%s); bash scripts/device_run.sh -- > /dev/null 2>&1; echo "setup $(( $(date +%s) - t0 ))s"; fi
export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$W/pycache"
export PYTHONUNBUFFERED=1
mkdir -p $OUT/r
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/r/gpu.txt
nproc
one() { # tag tree model compiler config [env...]
  local tag=$1 tree=$2 model=$3 compiler=$4 config=$5; shift 5
  local t0=$(date +%s)
  env "$@" timeout ${TMO:-200} python3 $tree/benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never \
    --compiler $compiler --model $model --compiler-config "$config" --cache-dir $W/cache/$tag-$RANDOM \
    --repeat 1 --output-json $OUT/r/$tag.json > $OUT/r/$tag.log 2>&1
  echo "$tag rc=$? wall=$(( $(date +%s) - t0 ))s" | tee -a $OUT/r/summary.txt
  python3 .old/summ.py $OUT/r/$tag.json | grep -v "^   late" | tee -a $OUT/r/summary.txt
  [ -n "${KPROBE:-}" ] && for d in $W/cache/$tag-*; do python3 .old/kprobe.py $d | tee -a $OUT/r/summary.txt; done
}
for t in "$@"; do
  case $t in sdxl*) m=sdxl;; pixart*) m=pixart;; flux*) m=flux;; *) m=sd21;; esac
  tree=$R; envs=(); cfg='{"mode":"O2"}'; comp=nexfort
  case $t in *_old*) tree=$R/.old/tree;; esac
  case $t in *off*) envs+=(NEXFORT_TRACE_STAND_INS=0);; esac
  case $t in *_rb*) envs+=(NEXFORT_RUN_AS_COMPILED=0);; esac
  if [[ $t =~ _w([0-9]+) ]]; then cfg="{\"mode\":\"O2\",\"compile_workers\":${BASH_REMATCH[1]}}"; fi
  if [[ $t =~ _s([0-9.]+) ]]; then envs+=(NEXFORT_OWN_PART_SHARE=${BASH_REMATCH[1]}); fi
  case $t in *comfy*) comp=comfy; cfg='{}';; esac
  if [[ $t == *prof* ]]; then
    t0=$(date +%s)
    env "${envs[@]}" timeout 250 python3 -m cProfile -o $OUT/r/$t.prof $tree/benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never \
      --compiler $comp --model $m --compiler-config "$cfg" --cache-dir $W/cache/$t-$RANDOM --repeat 1 --output-json $OUT/r/$t.json > $OUT/r/$t.log 2>&1
    echo "$t rc=$? wall=$(( $(date +%s) - t0 ))s" | tee -a $OUT/r/summary.txt
    python3 .old/summ.py $OUT/r/$t.json | grep -v "^   late" | tee -a $OUT/r/summary.txt
    continue
  fi
  TMO=$([ $comp = comfy ] && echo 300 || echo 200) one $t $tree $m $comp "$cfg" "${envs[@]}"
done
cd $OUT && tar czf r.tgz r && rm -rf r
