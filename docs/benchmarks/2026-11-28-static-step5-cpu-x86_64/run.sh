#!/usr/bin/env bash
# Ops, Triton launches and host syncs of a decode step, eager and static, for a plain step (full cache), a
# linked step (full cache, the first request linking an image record another request computed: keys
# pre-RoPE, rotated on read) and an AttentionPack step (rank 4 over one image per request: pre-RoPE
# low-rank factors, read by the static step through its factor stacks since session 17) (issue #28), on the
# path a CUDA device runs (the script re-executes itself with the Triton kernels forced under the
# interpreter and every CPU C++ kernel off). From the repository root, with the project's venv active.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD" OMP_NUM_THREADS=1
python scripts/count_static_step.py --batch 4 --layers 2 4 --steps 3 --policy full linked attnpack \
  > docs/benchmarks/2026-11-28-static-step5-cpu-x86_64/counts.jsonl
# after the factor edit's due became host-known (change 4): the attnpack rows again, recounted
python scripts/count_static_step.py --batch 4 --layers 2 4 --steps 3 --policy attnpack \
  > docs/benchmarks/2026-11-28-static-step5-cpu-x86_64/counts-host-due.jsonl
