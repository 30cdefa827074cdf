#!/usr/bin/env bash
# run216: background:true with intraop, memory across the static-first hand-over, static first on a VAE
set -uo pipefail
W=/tmp/nexfort_device
if [ ! -d "$W/ComfyUI" ] || [ ! -d "$W/site" ]; then t0=$(date +%s); bash scripts/device_run.sh -- > /dev/null 2>&1; echo "setup $(( $(date +%s) - t0 ))s"; fi
export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$W/pycache"
export PYTHONUNBUFFERED=1
RD=$W/r; mkdir -p $RD
probe() { # tag config env...
  local tag=$1 cfg=$2; shift 2
  case $tag in sdxl*) M=sdxl;; *) M=sd21;; esac
  local t0=$(date +%s)
  env "$@" timeout ${TMO:-300} python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never --compiler nexfort --model $M \
    --compiler-config "$cfg" --cache-dir $W/cache/$tag-$RANDOM --repeat 2 ${EXTRA:-} --output-json $RD/$tag.json > $RD/$tag.log 2>&1
  echo "$tag done $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  python3 - $RD/$tag.json <<'PY' | tee -a $RD/summary.txt
import json, sys, statistics as s
d = json.load(open(sys.argv[1]))
for r in d["runs"]:
    bg = [b for b in r.get("background_runs") or [] if b.get("step_ms_median")]
    print("  warmup", round(r.get("warmup_s", -1), 2), "it/s", [round(x.get("it_s") or 0, 2) for x in r.get("runs", [])], "until", r.get("background_until_compiled_s"),
          "bg n", len(bg), "median it/s", round(s.median([b["it_s"] for b in bg]), 1) if bg else None,
          "step", round(s.median([b["step_ms_median"] for b in bg]), 2) if bg else None, "host", round(s.median([b["host_step_ms_median"] for b in bg]), 2) if bg else None,
          "bg peak", round(max(b.get("peak_gib") or 0 for b in bg), 3) if bg else None, "dev used max", round(max(b.get("device_used_gib") or 0 for b in bg), 2) if bg else None,
          "compiles", r.get("compiles"), "recompiles", r.get("recompiles"), "fallbacks", r.get("fallbacks"), "peak", r.get("peak_mem_gib"), "eager_warmup", r.get("eager_warmup_s"), "bg", r.get("background"))
    if "first_image_s" in r:
        print("  first image", round(r["first_image_s"], 2), "vae first decode", round(r["vae_first_decode_s"], 2), "vae ms", r.get("vae_decode_ms"),
              "decodes meanwhile", [round(b["decode_s"], 3) for b in r.get("background_runs") or [] if b.get("decode_s")][:3], "...",
              [round(b["decode_s"], 3) for b in r.get("background_runs") or [] if b.get("decode_s")][-3:])
    sw = r.get("sweep") or []
    if sw:
        print("  sweep new compiles", sum(w.get("new_compiles", 0) for w in sw), "first_s max", round(max(w["first_s"] for w in sw), 2))
        for w in sw:
            print("   ", w["width"], w["height"], w["steps"], w["text_len"], "first", round(w["first_s"], 2), "it/s", round(w["it_s"] or 0, 1), "new", w["new_compiles"], "peak", round(w.get("peak_gib") or 0, 3), "reserved", round(w.get("reserved_gib") or 0, 3))
PY
  tar czf $OUT/r.tgz -C $W r
}
vae() { # tag options other
  local tag=$1 opts=$2; local t0=$(date +%s)
  timeout ${TMO:-300} python3 benchmarks/vae_decode.py --comfy-root $W/ComfyUI --cache-root $W/cache/$tag-$RANDOM --formats contiguous --repeat 5 --method ${METHOD:-decode} \
    --options "$opts" --other-size ${OTHER:-768} > $RD/$tag.jsonl 2> $RD/$tag.log
  echo "$tag done $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  cat $RD/$tag.jsonl | tee -a $RD/summary.txt
  tar czf $OUT/r.tgz -C $W r
}
comfy() { local tag=$1; local t0=$(date +%s)
  timeout 300 python3 benchmarks/text_to_image.py --comfy-root $W/ComfyUI --fp32-reference never --compiler comfy --model $2 --cache-dir $W/cache/$tag-$RANDOM --repeat 1 ${EXTRA:-} --output-json $RD/$tag.json > $RD/$tag.log 2>&1
  echo "$tag done $(( $(date +%s) - t0 ))s" | tee -a $RD/summary.txt
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print('  comfy warmup', round(r.get('warmup_s'),2), 'it/s', [round(x['it_s'],2) for x in r['runs']], 'first image', r.get('first_image_s'), 'vae ms', r.get('vae_decode_ms'))" $RD/$tag.json | tee -a $RD/summary.txt
  tar czf $OUT/r.tgz -C $W r
}
for t in "$@"; do EXTRA=""; case $t in *sweep*) EXTRA="--run-multiple-resolutions";; *_img*) EXTRA="--vae-decode";; esac
  case $t in
    venc_sf*) METHOD=encode vae $t '{"static_first": true}';;
    venc_dyn*) METHOD=encode vae $t '{}';;
    vae_sf0*) vae $t '{"static_first": false}';;
    vae_sf*) vae $t '{"static_first": true}';;
    vae_def*) vae $t '{}';;
    vae_dyn*) vae $t '{}';;
    sd21_comfy*) comfy $t sd21;;
    sdxl_comfy*) comfy $t sdxl;;
    *_bg_nq*) probe $t '{"mode":"O2","background":true}' NEXFORT_QUIET_OMP=0;;
    *_bgw8*) probe $t '{"mode":"O2","background":true,"compile_workers":8}';;
    *_bgw1*) probe $t '{"mode":"O2","background":true,"compile_workers":1}';;
    *_bg*) probe $t '{"mode":"O2","background":true}';;
    *_sf0*) probe $t '{"mode":"O2","static_first":false}';;
    *) probe $t '{"mode":"O2"}';;
  esac
done
