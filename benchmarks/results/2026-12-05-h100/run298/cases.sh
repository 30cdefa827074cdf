#!/bin/bash
P=/opt/torch/.venv/bin/python3
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
case_() { timeout 60 $P .dbg/dbg.py "$1" 2>>$OUT/dbg_err.txt | grep ^ROW | tee -a $OUT/dbg.txt; }
# correctness of the runtime-mask hypothesis at d=72
case_ '{"shape":[1,2,256,72],"cfg":[64,64,4,2],"lrt":true}'
case_ '{"shape":[1,2,256,72],"cfg":[64,64,4,2],"srt":true}'
case_ '{"shape":[1,2,256,72],"cfg":[64,64,4,2],"lrt":true,"srt":true}'
case_ '{"shape":[2,4,1000,72],"cfg":[128,64,8,3],"lrt":true,"srt":true}'
# PixArt shape, pointer form with runtime masks
case_ '{"shape":[2,16,4096,72],"cfg":[128,64,8,3],"lrt":true,"srt":true,"time":true}'
case_ '{"shape":[2,16,4096,72],"cfg":[128,128,8,2],"lrt":true,"srt":true,"time":true}'
# upper bound: the pointer form at d=80 (correct there; same 80 columns of work as 72 split)
case_ '{"shape":[2,16,4096,80],"cfg":[128,64,8,3],"time":true}'
case_ '{"shape":[2,16,4096,80],"cfg":[128,128,8,2],"time":true}'
case_ '{"shape":[2,16,4096,80],"cfg":[128,64,4,3],"time":true}'
case_ '{"shape":[2,16,4096,80],"cfg":[128,128,8,3],"time":true}'
case_ '{"shape":[2,16,4096,80],"cfg":[128,64,8,3],"f16":true,"time":true}'
case_ '{"shape":[2,16,4096,80],"cfg":[128,64,8,3],"lazy":true,"time":true}'
case_ '{"shape":[2,16,4096,80],"cfg":[128,64,8,3],"f16":true,"lazy":true,"time":true}'
# TMA form at 72 with the cheaper softmax options
case_ '{"shape":[2,16,4096,72],"cfg":[128,128,8,2],"tma":true,"time":true}'
case_ '{"shape":[2,16,4096,72],"cfg":[128,64,8,3],"tma":true,"f16":true,"lazy":true,"time":true}'
case_ '{"shape":[2,16,4096,72],"cfg":[128,128,8,3],"tma":true,"f16":true,"lazy":true,"time":true}'
echo "cases done $(( $(date +%s)-S ))s" | tee -a $OUT/dbg.txt
