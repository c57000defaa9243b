#!/usr/bin/env bash
# The GPU-sized embedded default (preset zoo-gpu; PRESET=smollm2 for SmolLM2-135M-Instruct) as one DVC experiment on a GPU machine that cannot reach the
# team's tracking server, and what to bring back from it (docs/runs.md, "A hardware variant").
#
#   bench/gpu_pipeline.sh NAME [dvc exp run options, e.g. -S generate.max_conversations=1024]
#   PRESET=smollm2 bench/gpu_pipeline.sh smollm2-h200 -S target.dtype=bfloat16
#
# Every stage run goes to the outbox (.eagle3ops/outbox/) since MLFLOW_TRACKING_URI names a server this machine
# cannot reach. A run stopped midway (a time limit) is continued by the same command: DVC skips the stages it
# finished and their records stay in the outbox. At the end, RESULTS_DIR/NAME.tar.gz holds what the experiment
# produced for the record: params.yaml, dvc.lock, metrics.json, metrics/, plots/, reports/ and the finished outbox
# entries, their copies of the drafter weights left out (the weights are DVC outputs: `dvc push` carries them).
set -uo pipefail
name=${1:?usage: bench/gpu_pipeline.sh NAME [dvc exp run options]}
shift
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-http://127.0.0.1:5000}
results=${RESULTS_DIR:-bench/results/gpu-pipeline}

eagle3ops preset "${PRESET:-zoo-gpu}" >/dev/null || exit 1
# A `dvc exp run` stopped midway leaves its files staged; the next one would fail to apply its stash over them.
git reset -q 2>/dev/null
# Where vLLM is not installed (the lent GPU machines carry none), the decoder measures alone and the export is not
# served; measure those drafters on vLLM afterwards on a machine that has it, from their weights (DVC outputs)
engine=()
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" || engine=(-S eval.engine=null -S export.serve=false)
dvc exp run -n "$name" "${engine[@]}" "$@" || exit 1

pack=$(mktemp -d)
mkdir -p "$pack/$name/outbox" "$results"
cp params.yaml dvc.lock metrics.json "$pack/$name/"
cp -r metrics plots reports "$pack/$name/"
for entry in .eagle3ops/outbox/*/; do
    grep -q "\"pipeline_key\": \"$name\"" "$entry/run.json" || continue  # another experiment's
    grep -q '"status": "RUNNING"' "$entry/run.json" && continue  # a stage killed midway: DVC ran it again
    cp -r "$entry" "$pack/$name/outbox/"
done
find "$pack/$name/outbox" -path '*/files/model' -prune -exec rm -rf {} +
tar -czf "$results/$name.tar.gz" -C "$pack" "$name"
rm -rf "$pack"
ls -l "$results/$name.tar.gz"
