#!/usr/bin/env bash
# The GPU benchmarks whose results are in bench/results/, with the exact commands. From the repository root:
#   bench/gpu.sh two-gpus    # on a machine with two GPUs: data-parallel training and the split target
#   bench/gpu.sh one-gpu     # extraction by length and batch, training by batch and length
#   bench/gpu.sh varlen      # training on packed rows and on data of varying length from process start
#   bench/gpu.sh online      # extraction in bf16 and FP8; offline against online training, epoch by epoch
#   bench/gpu.sh variants    # a training step of each variant: TTT positions, EAGLE-3.1, Muon
# SIZE=tiny runs the same commands at the tiny scale (a check of the script; results to $OUT_DIR).
set -euo pipefail
size=${SIZE:-8b}
out=${OUT_DIR:-bench/results}
python=${PYTHON:-python3}
run() { echo "+ $*" >&2; "$@"; }
case ${1:?two-gpus, one-gpu, varlen, online or variants} in
  two-gpus)
    run "$python" -m torch.distributed.run --standalone --nproc-per-node 2 -m eagle3ops.cli bench --size "$size" \
        --parts train --out "$out/h200x2-ddp-train.json"
    run "$python" -m eagle3ops.cli bench --size "$size" --parts extract-split --out "$out/h200x2-extract-split.json" ;;
  one-gpu)
    run "$python" -m eagle3ops.cli bench --size "$size" --parts extract --out "$out/h200-extract-scaling.json"
    run "$python" -m eagle3ops.cli bench --size "$size" --parts train --kernels flex \
        --train-shapes 1x1024 1x2048 2x2048 4x2048 1x4096 1x8192 1x16384 --out "$out/h200-train-fused.json" ;;
  varlen)
    run "$python" -m eagle3ops.cli bench --size "$size" --parts train train-varlen --kernels flex \
        --train-shapes 1x2048 4x2048 1x8192 1x16384 --out "$out/h200-train-varlen.json" ;;
  online)
    run "$python" -m eagle3ops.cli bench --size "$size" --parts online --out "$out/h200-online.json" ;;
  variants)
    run "$python" -m eagle3ops.cli bench --size "$size" --parts train-variants --out "$out/h200-train-variants.json" ;;
  *) echo "usage: bench/gpu.sh two-gpus|one-gpu|varlen|online|variants" >&2; exit 2 ;;
esac
