#!/usr/bin/env bash
# The paged low-rank read's bytes per decode layer, before (contiguous splits, each meeting the factored
# span loading the bases) and after (the span's own splits) at the 7B models' shapes: bytes.py, counted
# from the tables, no timing. From the repository root, with the project's venv active.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD" OMP_NUM_THREADS=1
D=docs/benchmarks/2026-11-28-lowrank-splits-cpu-x86_64
python $D/bytes.py > $D/bytes.jsonl
