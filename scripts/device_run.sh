#!/usr/bin/env bash
# Run benchmark commands on the lent GPU machine (fresh and offline each session).
#
# Needs what scripts/device_bundle.sh made, carried with the call: .device/comfyui.tar.gz and .whl/.
#   run(carry=[".device", ".whl"], timeout_s=600,
#       command='bash scripts/device_run.sh -- "--model sd21 --compiler none" "--model sd21 --compiler nexfort"')
#
# Each quoted argument after `--` is one benchmarks/text_to_image.py command line (without
# --comfy-root/--output-json, added here; a --cache-dir is added unless given). Steps:
#   1. unpack ComfyUI to /tmp, install the wheels with --target, link this pack into custom_nodes/
#   2. smoke: GPU, torch, triton, ComfyUI imports (printed to the log)
#   3. each command in turn, within a time budget (BUDGET_S, default 540 s of the 600 s call):
#      a command that would start with under MIN_LEFT_S (default 45 s) left is skipped and logged
#   4. after every command, $OUT is refreshed: results.json (all runs), report.md, speedup.png,
#      log.txt - so a call cut off at its limit still returns what finished
#   5. options: --keep-cache puts the compile caches in $OUT/caches.tar.gz if that is under
#      CACHE_MAX_MB (default 15); --restore-cache unpacks .device/caches.tar.gz first (then
#      "warm-up with compilation" is no longer cold - say so when reporting)
# NEXFORT_DEVICE_DIR (default .device) names the carried folder: another ComfyUI tree and its
# packages (site.tar.xz, see device_bundle.sh) come that way, unpacked under their own $WORK.
# Results and compile caches are per call ($WORK/results/<call>, $WORK/cache/<call>): a later call
# on a machine still warm from an earlier one neither merges the earlier rows into its results.json
# nor finds their compiled graphs (that made run74's results carry a row of run73).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out/device}"
BUDGET_S="${BUDGET_S:-540}"
MIN_LEFT_S="${MIN_LEFT_S:-45}"
CACHE_MAX_MB="${CACHE_MAX_MB:-15}"
KEEP_CACHE=0
RESTORE_CACHE=0
START=$(date +%s)

while [ $# -gt 0 ]; do
    case "$1" in
        --keep-cache) KEEP_CACHE=1; shift ;;
        --restore-cache) RESTORE_CACHE=1; shift ;;
        --) shift; break ;;
        *) echo "unknown option $1 (usage: device_run.sh [--keep-cache] [--restore-cache] -- 'ARGS' ...)" >&2; exit 2 ;;
    esac
done

# 1. ComfyUI + wheels + the pack (sets ROOT, DEVDIR, WORK, COMFY, PY, PYTHONPATH; scripts/device_env.sh)
source "$ROOT/scripts/device_env.sh" || exit 1

CALL="call-$START-$$"
RESULTS="$WORK/results/$CALL"
CACHE="$WORK/cache/$CALL"
mkdir -p "$OUT" "$RESULTS" "$CACHE"
LOG="$WORK/log.txt"
: > "$LOG"
log() { echo "$*" | tee -a "$LOG"; }
if [ "$RESTORE_CACHE" = 1 ] && [ -f "$ROOT/$DEVDIR/caches.tar.gz" ]; then
    tar -xzf "$ROOT/$DEVDIR/caches.tar.gz" -C "$CACHE" && log "restored caches from $DEVDIR/caches.tar.gz"
fi

# 2. smoke
{
    echo "== smoke $(date -u +%FT%TZ)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    "$PY" - "$COMFY" <<'EOF' 2>&1
import sys, time
t = time.time()
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "cudnn", torch.backends.cudnn.version(),
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:  # newer ComfyUI's kernels (0.33+): which backends loaded
    import comfy_kitchen
    print("comfy-kitchen backends:", {k: v.get("available") for k, v in comfy_kitchen.list_backends().items()})
except ImportError:
    pass
sys.path.insert(0, sys.argv[1])
import comfy.cli_args
comfy.cli_args.args.cpu = not torch.cuda.is_available()
import comfy.model_management, comfy.sample, comfy.supported_models  # noqa
import comfy_api.torch_helpers  # noqa
import comfyui_version
print("comfyui", comfyui_version.__version__, "imports ok in %.1fs" % (time.time() - t))
EOF
} | tee -a "$LOG"

refresh_out() {
    if ls "$RESULTS"/*.json >/dev/null 2>&1; then
        "$PY" "$ROOT/benchmarks/report.py" "$RESULTS"/*.json --markdown "$OUT/report.md" \
            --chart "$OUT/speedup.png" --merged-json "$OUT/results.json" > /dev/null 2>> "$LOG"
    fi
    # the log: last 15 MB at most (the file limit is 16 MiB)
    tail -c 15000000 "$LOG" > "$OUT/log.txt"
}

# 3. the benchmark commands
i=0
for cmd in "$@"; do
    i=$((i + 1))
    now=$(date +%s); left=$((START + BUDGET_S - now))
    if [ "$left" -lt "$MIN_LEFT_S" ]; then
        log "== [$i] SKIPPED (only ${left}s of the ${BUDGET_S}s budget left): $cmd"
        continue
    fi
    eval "args=($cmd)"
    extra=()
    case " $cmd " in *" --cache-dir"*) ;; *) extra+=(--cache-dir "$CACHE/run$i") ;; esac
    json="$RESULTS/$(printf '%02d' "$i").json"
    log "== [$i] (${left}s left) text_to_image.py $cmd"
    t0=$(date +%s)
    timeout --signal=INT --kill-after=10 "$left" "$PY" "$ROOT/benchmarks/text_to_image.py" --comfy-root "$COMFY" \
        "${args[@]}" "${extra[@]}" --output-json "$json" 2>&1 | tee -a "$LOG" | grep -E "^(RESULT|sweep|warm-cache|Traceback|[A-Za-z]*Error)" 
    rc=${PIPESTATUS[0]}
    log "== [$i] rc=$rc in $(( $(date +%s) - t0 ))s"
    refresh_out
done

# 4. caches, only if small
if [ "$KEEP_CACHE" = 1 ]; then
    tar -czf "$WORK/caches.tar.gz" -C "$CACHE" . 2>/dev/null
    size=$(stat -c %s "$WORK/caches.tar.gz" 2>/dev/null || echo 0)
    if [ "$size" -le $((CACHE_MAX_MB * 1024 * 1024)) ]; then
        cp "$WORK/caches.tar.gz" "$OUT/caches.tar.gz"
        log "caches: $OUT/caches.tar.gz ($((size / 1024)) KiB)"
    else
        log "caches: $((size / 1024 / 1024)) MiB compressed, over ${CACHE_MAX_MB} MiB: not returned"
    fi
fi
refresh_out
echo
echo "== summary"
grep -A 200 "^### Summary" "$OUT/report.md" 2>/dev/null | sed '/^Environment/q'
grep -h "^RESULT" "$LOG"
