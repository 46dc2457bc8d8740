#!/usr/bin/env bash
# Ops and host syncs of AttentionPack's eager decode step (low-rank factors read in place by the paged
# low-rank kernel) at 1, 2 and 4 attnpack requests, before (commit e38bb19, extracted with git archive into
# a temporary folder) and after (this tree), with the same script and arguments:
# scripts/count_static_step.py on the path a CUDA device runs (Triton forced under the interpreter, CPU C++
# kernels off). Counts are dispatched ops, not times: the machine's load does not change them. From the
# repository root, with the project's venv active.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/benchmarks/2026-11-28-attnpack-stacks-cpu-x86_64/counts.jsonl
before=$(mktemp -d)
trap 'rm -rf "$before"' EXIT
git archive e38bb19 | tar -x -C "$before"
export OMP_NUM_THREADS=1
: > "$out"
for code in before after; do
  root=$PWD
  [ "$code" = before ] && root=$before
  for batch in 1 2 4; do
    (cd "$root" && PYTHONPATH="$root" python scripts/count_static_step.py --layers 2 4 --steps 3 \
      --batch "$batch" --policy attnpack) |
      python -c 'import json,sys
for line in sys.stdin:
    if line.startswith("{"):
        row = json.loads(line); row["code"] = sys.argv[1]; row["requests"] = int(sys.argv[2]); print(json.dumps(row))' \
        "$code" "$batch" >> "$out"
  done
done
