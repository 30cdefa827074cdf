#!/usr/bin/env bash
# run196: parts cut while tracing (stream.py) against the finished graph cut (NEXFORT_STREAM_PARTS=0), compile workers, ComfyUI's compile
# usage: bash .old/run196.sh tag...   tags: {sdxl,sd21}_{new,ns (NEXFORT_STREAM_PARTS=0),rb,off,wN,comfy,old}[suffix]
set -uo pipefail
W=/tmp/nexfort_device
R=$(pwd)
if [ ! -d "$W/ComfyUI" ] || [ ! -d "$W/site" ]; then t0=$(date +%s); bash scripts/device_run.sh -- > /dev/null 2>&1; echo "setup $(( $(date +%s) - t0 ))s"; fi
export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$W/pycache"
export PYTHONUNBUFFERED=1
RD=$W/r; rm -rf $RD; mkdir -p $RD
T0=$(date +%s)
BUDGET=${BUDGET:-500}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $RD/gpu.txt
nproc
one() { # tag tree model compiler config [env...]
  local tag=$1 tree=$2 model=$3 compiler=$4 config=$5; shift 5
  local t0=$(date +%s)
  env "$@" timeout ${TMO:-200} python3 $tree/benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never \
    --compiler $compiler --model $model --compiler-config "$config" --cache-dir $W/cache/$tag-$RANDOM \
    --repeat 1 ${EXTRA:-} --output-json $RD/$tag.json > $RD/$tag.log 2>&1
  echo "$tag rc=$? wall=$(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  python3 .old/summ.py $RD/$tag.json | grep -v "^   late" | tee -a $RD/summary.txt
  [ -n "${KPROBE:-}" ] && for d in $W/cache/$tag-*; do python3 .old/kprobe.py $d | tee -a $RD/summary.txt; done
}
for t in "$@"; do
  if (( $(date +%s) - T0 > BUDGET )); then echo "$t skipped: over budget" | tee -a $RD/summary.txt; continue; fi
  case $t in sdxl*) m=sdxl;; pixart*) m=pixart;; flux*) m=flux;; *) m=sd21;; esac
  tree=$R; envs=(); cfg='{"mode":"O2"}'; comp=nexfort
  case $t in *_old*) tree=$R/.old/tree;; esac
  case $t in *off*) envs+=(NEXFORT_TRACE_STAND_INS=0);; esac
  case $t in *_rb*) envs+=(NEXFORT_RUN_AS_COMPILED=0);; esac
  case $t in *_ns*) envs+=(NEXFORT_STREAM_PARTS=0);; esac
  if [[ $t =~ _w([0-9]+) ]]; then cfg="{\"mode\":\"O2\",\"compile_workers\":${BASH_REMATCH[1]}}"; fi
  if [[ $t =~ _s([0-9.]+) ]]; then envs+=(NEXFORT_OWN_PART_SHARE=${BASH_REMATCH[1]}); fi
  if [[ $t =~ _t([0-9]+) ]]; then envs+=(NEXFORT_STREAM_TAIL_WORKERS=${BASH_REMATCH[1]}); fi
  if [[ $t =~ _n([0-9]+) ]]; then envs+=(NEXFORT_WORKER_NICE=${BASH_REMATCH[1]}); fi
  case $t in *_nb*) cfg='{"mode":"O2","options":{"overrides.conv_benchmark":false}}';; esac
  extra=""
  case $t in *_sweep*) extra="--run-multiple-resolutions";; esac
  case $t in *_nw*) extra="--background-wait 0";; esac
  case $t in *_wc*) extra="--warm-cache-check";; esac
  case $t in *_sf0*) cfg='{"mode":"O2","static_first":false}';; esac
  case $t in *_st*) cfg='{"mode":"O2","dynamic":false}';; esac
  case $t in *comfy*) comp=comfy; cfg='{}';; esac
  if [[ $t == *prof* ]]; then
    t0=$(date +%s)
    env "${envs[@]}" timeout 250 python3 -m cProfile -o $RD/$t.prof $tree/benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never \
      --compiler $comp --model $m --compiler-config "$cfg" --cache-dir $W/cache/$t-$RANDOM --repeat 1 --output-json $RD/$t.json > $RD/$t.log 2>&1
    echo "$t rc=$? wall=$(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
    python3 .old/summ.py $RD/$t.json | grep -v "^   late" | tee -a $RD/summary.txt
    continue
  fi
  EXTRA=$extra TMO=$([ $comp = comfy ] && echo 300 || echo 300) one $t $tree $m $comp "$cfg" "${envs[@]}"
  tar czf $OUT/r.tgz -C $W r  # after every run: what a timeout leaves still comes back
done
