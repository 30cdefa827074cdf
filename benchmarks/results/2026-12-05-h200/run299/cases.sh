#!/bin/bash
P=/opt/torch/.venv/bin/python3
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
case_() { timeout 60 $P .dbg/dbg.py "$1" 2>>$OUT/dbg_err.txt | grep ^ROW | tee -a $OUT/dbg.txt; }
# which access is wrong at d=72: clamped tail store / loads, loads without column masks
case_ '{"shape":[1,2,256,72],"cfg":[64,64,4,2],"cs":true}'
case_ '{"shape":[1,2,256,72],"cfg":[64,64,4,2],"cl":true}'
case_ '{"shape":[1,2,256,72],"cfg":[64,64,4,2],"cl":true,"cs":true}'
case_ '{"shape":[1,2,256,72],"cfg":[64,64,4,2],"nocol":true}'
case_ '{"shape":[1,2,256,72],"cfg":[64,64,4,2],"nocol":true,"cs":true}'
# PixArt shape, pointer form with each workaround, 4 and 8 warps
for W in '"cs":true' '"cl":true,"cs":true' '"nocol":true,"cs":true' '"nocol":true'; do
  case_ "{\"shape\":[2,16,4096,72],\"cfg\":[128,64,4,3],$W,\"time\":true}"
  case_ "{\"shape\":[2,16,4096,72],\"cfg\":[128,64,4,3],$W,\"f16\":true,\"time\":true}"
done
case_ '{"shape":[2,16,4096,72],"cfg":[128,64,8,3],"nocol":true,"cs":true,"f16":true,"time":true}'
case_ '{"shape":[2,16,4096,72],"cfg":[128,32,4,3],"nocol":true,"cs":true,"time":true}'
case_ '{"shape":[2,16,4096,72],"cfg":[128,64,4,4],"nocol":true,"cs":true,"time":true}'
case_ '{"shape":[2,16,4096,72],"cfg":[64,64,4,3],"nocol":true,"cs":true,"time":true}'
# upper bound at d=80, 4 warps
case_ '{"shape":[2,16,4096,80],"cfg":[128,64,4,3],"f16":true,"time":true}'
case_ '{"shape":[2,16,4096,80],"cfg":[128,64,4,4],"time":true}'
case_ '{"shape":[2,16,4096,80],"cfg":[128,32,4,3],"time":true}'
# the descriptor form at 4 warps
case_ '{"shape":[2,16,4096,72],"cfg":[128,64,4,3],"tma":true,"time":true}'
case_ '{"shape":[2,16,4096,72],"cfg":[128,64,4,3],"tma":true,"f16":true,"time":true}'
case_ '{"shape":[2,16,4096,72],"cfg":[128,64,4,2],"tma":true,"time":true}'
echo "cases done $(( $(date +%s)-S ))s" | tee -a $OUT/dbg.txt
