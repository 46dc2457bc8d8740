#!/usr/bin/env bash
# Before (main at the branch point) / after (this branch) ops and syncs per decode step, scheduler vs
# Engine.decode, on one prompt for every request (equal) and on prompts of different lengths (ragged),
# interleaved by layer count in one run. Usage: run.sh MAIN_CHECKOUT BRANCH_CHECKOUT
# (run from the branch checkout; each side's vlkv imported through PYTHONPATH, the same script).
set -u
main=$1 branch=$2
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
for path in gpu cpu; do
  flag=$([ $path = gpu ] && echo --gpu-path)
  for layers in 2 4; do
    for side in before after; do
      code=$([ $side = before ] && echo "$main" || echo "$branch")
      PYTHONPATH=$code python scripts/count_step_ops.py $flag --layers $layers --paths 8 \
        --shapes equal ragged --policies full h2o avl snapkv \
        | sed "s/^{/{\"code\": \"$side\", \"path\": \"$path\", /"
    done
  done
done
