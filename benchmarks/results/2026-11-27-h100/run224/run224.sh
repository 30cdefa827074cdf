#!/usr/bin/env bash
# run224+: torch 2.11's AOTAutograd cache with linspace-specialised graphs (CPU, GPU), the new torch.compile-path
# test on the device's CPU, a background child's exit on the GPU (old vs exit_now), Flux compiled whole over the sweep
set -uo pipefail
W=/tmp/nexfort_device
if [ ! -d "$W/ComfyUI" ] || [ ! -d "$W/site" ]; then t0=$(date +%s); bash scripts/device_run.sh -- > /dev/null 2>&1; echo "setup $(( $(date +%s) - t0 ))s"; fi
export PYTHONPATH="$PWD:$W/site${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$W/pycache"
export PYTHONUNBUFFERED=1
export NEXFORT_HOST=$W/ComfyUI
RD=$W/r; mkdir -p $RD
flux() { # tag config
  local tag=$1 cfg=$2; local t0=$(date +%s)
  timeout ${TMO:-500} python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never --compiler nexfort --model flux \
    --compiler-config "$cfg" --cache-dir $W/cache/$tag-$RANDOM --repeat 1 --run-multiple-resolutions --output-json $RD/$tag.json > $RD/$tag.log 2>&1
  echo "$tag done $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  python3 - $RD/$tag.json <<'PY' | tee -a $RD/summary.txt
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["runs"]:
    print("  warmup", round(r.get("warmup_s", -1), 2), "it/s", [round(x.get("it_s") or 0, 2) for x in r.get("runs", [])],
          "compiles", r.get("compiles"), "recompiles", r.get("recompiles"), "fallbacks", r.get("fallbacks"), "peak", r.get("peak_mem_gib"), "err", r.get("err_vs_eager"))
    sw = r.get("sweep") or []
    if sw:
        print("  sweep new compiles", sum(w.get("new_compiles", 0) for w in sw), "first_s max", round(max(w["first_s"] for w in sw), 2))
        for w in sw:
            print("   ", w["width"], w["height"], w["steps"], w["text_len"], "first", round(w["first_s"], 2), "it/s", round(w["it_s"] or 0, 1), "new", w["new_compiles"], "peak", round(w.get("peak_gib") or 0, 3))
PY
  tar czf $OUT/r.tgz -C $W r
}
for t in "$@"; do t0=$(date +%s)
  case $t in
    aot_cpu_nocache*) TORCHINDUCTOR_AUTOGRAD_CACHE=0 TORCHINDUCTOR_CACHE_DIR=$W/ind-$t-$RANDOM timeout 300 python3 .old/aot_bug.py cpu > $RD/$t.out 2> $RD/$t.log;;
    aot_cpu*) TORCHINDUCTOR_CACHE_DIR=$W/ind-$t-$RANDOM timeout 300 python3 .old/aot_bug.py cpu > $RD/$t.out 2> $RD/$t.log;;
    aot_cuda*) TORCHINDUCTOR_CACHE_DIR=$W/ind-$t-$RANDOM timeout 300 python3 .old/aot_bug.py cuda > $RD/$t.out 2> $RD/$t.log;;
    exit_old*) timeout 200 python3 .old/exit_gpu.py old > $RD/$t.out 2> $RD/$t.log;;
    exit_new*) timeout 200 python3 .old/exit_gpu.py new > $RD/$t.out 2> $RD/$t.log;;
    sym*) timeout 200 python3 .old/sym_probe.py > $RD/$t.out 2> $RD/$t.log;;
    pt_all*) [ -d /tmp/pt ] || pip install -q --no-deps --target /tmp/pt .whltest/*.whl > /dev/null 2>&1
       PYTHONPATH=/tmp/pt:$PYTHONPATH timeout 400 python3 -m pytest -q -p no:cacheprovider --log-level=DEBUG tests/nodes/test_patcher_families.py tests/engine/test_trace_ops.py \
         -k "linspace" > $RD/$t.out 2> $RD/$t.log;;
    pt_tc*) [ -d /tmp/pt ] || pip install -q --no-deps --target /tmp/pt .whltest/*.whl > /dev/null 2>&1
       PYTHONPATH=/tmp/pt:$PYTHONPATH timeout 400 python3 -m pytest -q -p no:cacheprovider --log-level=DEBUG tests/nodes/test_patcher_families.py \
         -k "torch_compile_gets" > $RD/$t.out 2> $RD/$t.log;;
    tflux*) timeout 400 python3 .old/flux_gpu.py ${VARIANTS:-} > $RD/$t.out 2> $RD/$t.log;;
    flux_whole*) flux $t '{"mode": "O2", "regional": false}';;
    flux_o3whole*) flux $t '{"mode": "O3", "regional": false}';;
    flux_reg*) flux $t '{"mode": "O2"}';;
  esac
  echo "$t done $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  tail -c 3000 $RD/$t.out 2>/dev/null | tail -8 | tee -a $RD/summary.txt
  tar czf $OUT/r.tgz -C $W r
done
