#!/usr/bin/env bash
# The GPU benchmarks whose results are in bench/results/, with the exact commands. From the repository root:
#   bench/gpu.sh two-gpus    # on a machine with two GPUs: data-parallel training and the split target
#   bench/gpu.sh one-gpu     # extraction by length and batch, training by batch and length
#   bench/gpu.sh varlen      # training on packed rows and on data of varying length from process start
#   bench/gpu.sh online      # extraction in bf16 and FP8; offline against online training, epoch by epoch
#   bench/gpu.sh variants    # a training step of each variant: TTT positions, EAGLE-3.1, Muon
#   bench/gpu.sh specforge   # epoch 1 from process start against SpecForge v0.2's trainer on the bench's own
#                            # lengths, each cold (SPECFORGE_DIR: ../shared/anchors' files); the bare step at 8,192 and
#                            # 16,384 tokens and where its GPU time goes (bench/profile_train_step.py)
#   bench/gpu.sh specforge-start  # the cold start against SpecForge alone (cold, travelling and warm compile cache)
# SIZE=tiny runs the same commands at the tiny scale (a check of the script; results to $OUT_DIR).
set -euo pipefail
size=${SIZE:-8b}
out=${OUT_DIR:-bench/results}
python=${PYTHON:-python3}
run() { echo "+ $*" >&2; "$@"; }
case ${1:?two-gpus, one-gpu, varlen, online, variants, specforge or specforge-start} in
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
  specforge|specforge-start)
    sf=${SPECFORGE_DIR:?the folder holding specforge_bench.py and specforge-v0.2-*.tar.gz}
    work=$(mktemp -d)
    mkdir -p "$work/sf/specforge_src" && cp "$sf/specforge_bench.py" "$work/sf/"
    tar -xzf "$sf"/specforge-v0.2-*.tar.gz -C "$work/sf/specforge_src"
    "$python" -c "import json; from eagle3ops.benchmark.sizes import SIZES; from eagle3ops.benchmark.varlen import \
varlen_lengths; print(json.dumps(varlen_lengths(SIZES['$size']())))" > "$work/lengths.json"
    TORCHINDUCTOR_CACHE_DIR="$work/sf-cache/i" TRITON_CACHE_DIR="$work/sf-cache/t" \
      run "$python" "$work/sf/specforge_bench.py" varlen --lengths-file "$work/lengths.json" --epochs 2 \
      --out "$out/specforge-varlen.json"
    if [ "$1" = specforge-start ]; then  # the cold start alone: cold, travelling and warm runs beside SpecForge's
      run "$python" -m eagle3ops.cli bench --size "$size" --parts train-varlen --work-dir "$work/bench" \
          --out "$out/train-varlen.json"
      exit 0
    fi
    run "$python" -m eagle3ops.cli bench --size "$size" --parts train train-varlen --kernels flex \
        --train-shapes 1x8192 1x16384 --work-dir "$work/bench" --out "$out/train-varlen.json"
    run "$python" bench/profile_train_step.py --lengths 8192 16384 --out "$out/train-profile.json" ;;
  *) echo "usage: bench/gpu.sh two-gpus|one-gpu|varlen|online|variants|specforge|specforge-start" >&2; exit 2 ;;
esac
