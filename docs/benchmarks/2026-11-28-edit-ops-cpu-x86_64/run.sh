#!/usr/bin/env bash
# Ops and host syncs of AttentionPack's factor edit (issue #28: the per-request rank setting, batched) at
# 1, 2 and 4 attnpack requests, and of a linked request's eager paged read beside a full request (the
# rotary table form), before (commit 27cdd47, extracted with git archive into a temporary folder) and
# after (this tree), with the same script and arguments: scripts/count_static_step.py on the path a CUDA
# device runs (Triton forced under the interpreter, CPU C++ kernels off). Counts are dispatched ops, not
# times: the machine's load does not change them. From the repository root, with the project's venv active.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/benchmarks/2026-11-28-edit-ops-cpu-x86_64/counts.jsonl
before=$(mktemp -d)
trap 'rm -rf "$before"' EXIT
git archive 27cdd47 | tar -x -C "$before"
export OMP_NUM_THREADS=1
: > "$out"
for code in before after; do
  root=$PWD
  [ "$code" = before ] && root=$before
  for args in "--batch 1 --policy attnpack" "--batch 2 --policy attnpack" "--batch 4 --policy attnpack" \
              "--batch 2 --policy linked"; do
    # shellcheck disable=SC2086
    (cd "$root" && PYTHONPATH="$root" python scripts/count_static_step.py --layers 2 4 --steps 3 $args) |
      python -c 'import json,sys
for line in sys.stdin:
    if line.startswith("{"):
        row = json.loads(line); row["code"] = sys.argv[1]; row["args"] = sys.argv[2]; print(json.dumps(row))' \
        "$code" "$args" >> "$out"
  done
done
