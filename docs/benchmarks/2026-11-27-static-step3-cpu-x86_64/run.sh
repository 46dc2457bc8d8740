#!/usr/bin/env bash
# Ops, Triton launches and host syncs of a decode step, eager and static, for a plain step (full cache), a
# statistics step (h2o at 0.5), a hole step (kvzip at 0.5: per-head holes) and a selection step (A-VL at 0.5,
# core=0.3, one image per request: its core steps) (issue #28), on the path a CUDA
# device runs (the script re-executes itself with the Triton kernels forced under the interpreter and every
# CPU C++ kernel off). From the repository root, with the project's venv active.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD" OMP_NUM_THREADS=1
python scripts/count_static_step.py --batch 4 --layers 2 4 --steps 3 --policy full h2o kvzip avl-core \
  > docs/benchmarks/2026-11-27-static-step3-cpu-x86_64/counts.jsonl
