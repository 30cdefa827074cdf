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
M=${M:-sd21}
probe() { # tag env...
  local tag=$1; shift
  local t0=$(date +%s)
  env "$@" timeout 300 python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never --compiler nexfort --model $M \
    --compiler-config '{"mode":"O2"}' --cache-dir $W/cache/$tag --repeat 1 --output-json $RD/$tag.json > $RD/$tag.log 2>&1 &
  for i in $(seq 1 60); do sleep 2; grep -q "^background: sampling" $RD/$tag.log && break; done
  P=$(pgrep -f "text_to_image.py.*cache/$tag" | head -1); echo "$tag pid $P at $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  if [ -z "${QUICK:-}" ]; then
  sleep 5; python3 .old/threads.py $P 2 | tee -a $RD/summary.txt
  py-spy dump --pid $P --native > $RD/$tag.dump1.txt 2>&1; head -c 300 $RD/$tag.dump1.txt
  sleep 10; python3 .old/threads.py $P 2 | tee -a $RD/summary.txt
  py-spy dump --pid $P > $RD/$tag.dump2.txt 2>&1
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
          "step", round(s.median([b["step_ms_median"] for b in bg]), 2) if bg else None, "host", round(s.median([b["host_step_ms_median"] for b in bg]), 2) if bg else None)
PY
  tar czf $OUT/r.tgz -C $W r
}
probe p1
QUICK=1 probe p_omp1 OMP_NUM_THREADS=1
