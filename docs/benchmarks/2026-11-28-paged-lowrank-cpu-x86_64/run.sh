#!/usr/bin/env bash
# AttentionPack's eager decode step on the path a CUDA device runs (Triton kernels forced under the
# interpreter, CPU C++ kernels off: scripts/count_static_step.py re-executes itself so), counted with its
# factored rows rebuilt densely (VLKV_PAGED_FACTORS=0: LowRank.fill, the path before this change) and read
# in place by the paged low-rank kernel (VLKV_PAGED_FACTORS=1); then the byte table (bytes.py).
# From the repository root, with the project's venv active.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD" OMP_NUM_THREADS=1
D=docs/benchmarks/2026-11-28-paged-lowrank-cpu-x86_64
for on in 0 1; do
  VLKV_PAGED_FACTORS=$on python scripts/count_static_step.py --batch 4 --layers 2 4 --steps 3 \
    --policy attnpack | sed "s/^{/{\"paged_factors\": $on, /"
done > $D/counts.jsonl
python $D/bytes.py > $D/bytes.jsonl
