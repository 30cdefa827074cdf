#!/usr/bin/env bash
# run207: why host-bound steps slow while a child compiles: per-step medians, pmon/top, burners beside a warm process
set -uo pipefail
W=/tmp/nexfort_device
R=$(pwd)
if [ ! -d "$W/ComfyUI" ] || [ ! -d "$W/site" ]; then t0=$(date +%s); bash scripts/device_run.sh -- > /dev/null 2>&1; echo "setup $(( $(date +%s) - t0 ))s"; fi
export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$W/pycache"
export PYTHONUNBUFFERED=1
RD=$W/r; rm -rf $RD; mkdir -p $RD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $RD/gpu.txt
nproc; lscpu | grep -i "thread\|core\|socket\|model name" | tee $RD/cpu.txt
M=${M:-sd21}
C=$W/cache/s207-$M
bench() { # tag extra...
  local tag=$1; shift
  local t0=$(date +%s)
  timeout 300 python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never --compiler nexfort --model $M \
    --compiler-config '{"mode":"O2"}' --cache-dir $C "$@" --output-json $RD/$tag.json > $RD/$tag.log 2>&1
  echo "$tag rc=$? wall=$(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  python3 - $RD/$tag.json <<'PY' | tee -a $RD/summary.txt
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["runs"]:
    print("  warmup", round(r.get("warmup_s", -1), 2), "it/s", [round(x.get("it_s") or 0, 2) for x in r.get("runs", [])],
          "host_ms", [round(x.get("host_ms_per_step") or 0, 2) for x in r.get("runs", [])], "until", r.get("background_until_compiled_s"))
    for b in r.get("background_runs") or []:
        print("   bg", b.get("start_s"), round(b.get("it_s") or 0, 1), "step", b.get("step_ms_median"), "host", b.get("host_step_ms_median"))
PY
}
(nvidia-smi pmon -s um -d 1 > $RD/pmon.txt 2>&1 &)
(top -b -d 2 -w 250 | grep --line-buffered -A14 "PID USER" > $RD/top.txt 2>&1 &)
bench cold --repeat 1
pkill -f "nvidia-smi pmon"; pkill top
tar czf $OUT/r.tgz -C $W r
bench warm_alone --repeat 3
python3 .old/burn.py cpu 16 & B=$!; sleep 2
bench warm_cpu16 --repeat 3
kill -- $B; pkill -f "burn.py"; sleep 1
python3 .old/burn.py cpu 14 2 & B=$!; sleep 2
bench warm_cpu14pin --repeat 3
kill -- $B; pkill -f "burn.py"; sleep 1
python3 .old/burn.py gpu & B=$!; sleep 5
bench warm_gpu --repeat 3
kill -- $B; pkill -f "burn.py"; sleep 1
bench warm_alone2 --repeat 3
tar czf $OUT/r.tgz -C $W r
