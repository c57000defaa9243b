#!/usr/bin/env bash
# Whether the embedded default's lineage comes out byte-identical on this machine as it is and as an AVX2-only
# machine with one core would compute it (cpu_reproducible: true, the default). Two git worktrees of HEAD, each with
# an empty DVC cache, run `dvc repro` up to the given stages: one as this machine is; the other on one core, with
# numpy's AVX-512 code paths disabled (NPY_DISABLE_CPU_FEATURES) and glibc's AVX-512 variants masked
# (GLIBC_TUNABLES), from before Python starts; torch's, MKL's and oneDNN's kernels the mode pins itself. Then every
# output's md5 in the two dvc.lock files is compared. From the repository root, its venv active:
#
#   bench/same_bits.sh                                 # up to the trained drafters (about 40 minutes on 2 cores)
#   bench/same_bits.sh eval@scratch eval@warm_start    # further: the evaluations too
#
# Prints one line per output (wall-time records, metrics/ and the report, are not expected to match) and writes
# bench/results/same_bits-<date>.json (WORK=DIR keeps the worktrees there).
set -euo pipefail
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(train@scratch train@warm_start)
work=${WORK:-$(mktemp -d)}
out=${OUT:-bench/results/same_bits-$(date +%Y%m%d-%H%M).json}
avx512=(AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR)
as_avx2=(env "NPY_DISABLE_CPU_FEATURES=${avx512[*]}"
         "GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F,-AVX512CD,-AVX512BW,-AVX512DQ,-AVX512VL" taskset -c 0)
for side in host avx2-one-core; do
    git worktree add -q --detach "$work/$side" HEAD
    prefix=()
    [ "$side" = host ] || prefix=("${as_avx2[@]}")
    start=$SECONDS
    # the worktree's own code, whichever checkout the venv's package points to
    (cd "$work/$side" && PYTHONPATH="$work/$side/src${PYTHONPATH:+:$PYTHONPATH}" \
        MLFLOW_TRACKING_URI="sqlite:///$work/$side/mlflow.db" "${prefix[@]}" dvc repro "${stages[@]}") \
        > "$work/$side.log" 2>&1 || { echo "dvc repro failed on the $side side: $work/$side.log" >&2; exit 1; }
    echo "$side: ${stages[*]} in $((SECONDS - start)) s" >&2
    echo $((SECONDS - start)) > "$work/$side.seconds"
done
python - "$work" "$out" "${stages[@]}" <<'EOF'
import json, sys
from pathlib import Path
from eagle3ops.runs.reproduce import output_kind
from eagle3ops.tracking.lineage import load_yaml, lock_outputs
work, out, stages = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
host, avx2 = (lock_outputs(work / side / "dvc.lock") for side in ("host", "avx2-one-core"))
params = load_yaml((work / "host" / "params.yaml").read_text())
rows = [{"path": path, "kind": output_kind(path, params), "host": md5, "avx2_one_core": avx2.get(path),
         "identical": avx2.get(path) == md5} for path, md5 in sorted(host.items())]
for row in rows:
    verdict = "same" if row["identical"] else "DIFFERENT" if row["kind"] == "result" else "(timing)"
    print(f"{verdict:9} {row['host']}  {row['avx2_one_core']}  {row['path']}")
seconds = {side: int((work / f"{side}.seconds").read_text()) for side in ("host", "avx2-one-core")}
results = [row for row in rows if row["kind"] == "result"]
same = all(row["identical"] for row in results)
print(f"\n{sum(r['identical'] for r in results)} of {len(results)} results identical; seconds {seconds}")
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({"stages": stages, "identical": same, "seconds": seconds, "outputs": rows}, indent=2) + "\n")
sys.exit(0 if same else 1)
EOF
