#!/usr/bin/env bash
# The training objectives (train.loss: kl, lk_alpha, lk_lambda) on the GPU-sized zoo: tau at eval.temperature (0)
# and eval.sampled_temperature (1.0), three seeds each (docs/training.md, "The objective").
#
#   bench/gpu_objectives.sh [OUT]     # default OUT: bench/results/variants-tau-zoo-gpu.json
#
# On a GPU machine, in a checkout of its own (it rewrites params.yaml): applies the preset zoo-gpu with
# generate.max_conversations=${CONVERSATIONS:-1024} (the share bench/results/h200-pipeline/h200-1k trained on), runs
# the pipeline to the hidden states (`dvc repro extract@offline`: the zoo builds in 4.2 minutes on an H100), then
# bench/variants_tau.py's three objective rows, three runs at a time (--lanes 3: the small zoo leaves the GPU idle
# between kernels). Stopped midway, the same command continues: DVC skips the stages it finished. The stage runs go
# to the outbox where MLFLOW_TRACKING_URI names no server that answers (`eagle3ops sync` uploads them later).
set -euo pipefail
out=${1:-bench/results/variants-tau-zoo-gpu.json}
eagle3ops preset zoo-gpu >/dev/null
sed -i "s/^  max_conversations: [0-9a-z]*/  max_conversations: ${CONVERSATIONS:-1024}/" params.yaml
grep -q "^  max_conversations: ${CONVERSATIONS:-1024}" params.yaml || { echo "generate.max_conversations not set" >&2; exit 1; }
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-http://127.0.0.1:5000}
dvc repro extract@offline
python3 bench/variants_tau.py --rows defaults-scratch lk-alpha lk-lambda --seeds 0 1 2 --lanes 3 --out "$out"
