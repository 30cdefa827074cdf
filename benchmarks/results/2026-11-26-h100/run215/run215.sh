#!/usr/bin/env bash
# run208: which threads of the sampling process are busy while the static-first child compiles
set -uo pipefail
W=/tmp/nexfort_device
if [ ! -d "$W/ComfyUI" ] || [ ! -d "$W/site" ]; then t0=$(date +%s); bash scripts/device_run.sh -- > /dev/null 2>&1; echo "setup $(( $(date +%s) - t0 ))s"; fi
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .old/whl2/*.whl; export PATH=/tmp/pyspy/bin:$PATH
export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$W/pycache"
export PYTHONUNBUFFERED=1
RD=$W/r; rm -rf $RD; mkdir -p $RD
probe() { # tag env...
  local tag=$1; shift
  case $tag in sdxl*) M=sdxl;; *) M=sd21;; esac
  local t0=$(date +%s)
  env "$@" python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never --compiler nexfort --model $M \
    --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/$tag-$RANDOM --repeat 2 ${EXTRA:-} --output-json $RD/$tag.json > $RD/$tag.log 2>&1 &
  P=$!
  for i in $(seq 1 60); do sleep 2; grep -q "^background: sampling" $RD/$tag.log && break; done
  echo "$tag pid $P at $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  if [ -z "${QUICK:-}" ]; then
  sleep 5; python3 .old/threads.py $P 2 | tee -a $RD/summary.txt
  py-spy record --pid $P --native -d 4 -r 200 -f raw -o $RD/$tag.raw.txt > $RD/$tag.spy.log 2>&1
  grep -c . $RD/$tag.raw.txt; grep -i "gomp\|parallel" $RD/$tag.raw.txt | head -c 600
  fi
  wait
  echo "$tag done $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  python3 - $RD/$tag.json <<'PY' | tee -a $RD/summary.txt
import json, sys, statistics as s
d = json.load(open(sys.argv[1]))
for r in d["runs"]:
    bg = [b for b in r.get("background_runs") or [] if b.get("step_ms_median")]
    print("  warmup", round(r.get("warmup_s", -1), 2), "it/s", [round(x.get("it_s") or 0, 2) for x in r.get("runs", [])], "until", r.get("background_until_compiled_s"),
          "bg n", len(bg), "median it/s", round(s.median([b["it_s"] for b in bg]), 1) if bg else None,
          "step", round(s.median([b["step_ms_median"] for b in bg]), 2) if bg else None, "host", round(s.median([b["host_step_ms_median"] for b in bg]), 2) if bg else None,
          "compiles", r.get("compiles"), "recompiles", r.get("recompiles"), "fallbacks", r.get("fallbacks"), "peak", r.get("peak_mem_gib"), "bg", r.get("background"))
    sw = r.get("sweep") or []
    if sw:
        print("  sweep new compiles", sum(w.get("new_compiles", 0) for w in sw), "first_s max", max(w["first_s"] for w in sw), [round(w["it_s"], 1) for w in sw])
PY
  tar czf $OUT/r.tgz -C $W r
}
warm() { # tag cache
  local tag=$1 c=$2
  python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never --compiler nexfort --model sd21 \
    --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/$c --repeat 40 --output-json $RD/$tag.json > $RD/$tag.log 2>&1 &
  P=$!
  sleep 30; python3 .old/threads.py $P 2 | tee -a $RD/summary.txt
  py-spy record --pid $P --native -d 4 -r 200 -f raw -o $RD/$tag.raw.txt > $RD/$tag.spy.log 2>&1
  wait
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print('$tag warmup', r.get('warmup_s'), 'it/s', sorted(round(x['it_s'],1) for x in r['runs']))" $RD/$tag.json | tee -a $RD/summary.txt
  tar czf $OUT/r.tgz -C $W r
}
comfy() { local tag=$1; local t0=$(date +%s)
  timeout 300 python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never --compiler comfy --model $2 --cache-dir $W/cache/$tag-$RANDOM --repeat 1 --output-json $RD/$tag.json > $RD/$tag.log 2>&1
  echo "$tag done $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print('  comfy warmup', round(r.get('warmup_s'),2), 'it/s', [round(x['it_s'],2) for x in r['runs']])" $RD/$tag.json | tee -a $RD/summary.txt
  tar czf $OUT/r.tgz -C $W r
}
for t in "$@"; do EXTRA=""; case $t in *sweep*) EXTRA="--run-multiple-resolutions";; esac; case $t in sd21_comfy*) comfy $t sd21;; sdxl_comfy*) comfy $t sdxl;; *_ow1*) QUICK=1 probe $t NEXFORT_WORKER_OMP_THREADS=1;; *_nq*) QUICK=1 probe $t NEXFORT_QUIET_OMP=0;; *_probe*) probe $t;; *passive*) QUICK=1 probe $t OMP_WAIT_POLICY=PASSIVE;; warm*) warm $t sd21_def;; *inherit*) probe $t NEXFORT_CHILD_OMP_THREADS=inherit;; *proto*) probe $t NEXFORT_PROTO_OMP1=1;; *all1*) QUICK=1 probe $t OMP_NUM_THREADS=1;; *) QUICK=1 probe $t;; esac; done
