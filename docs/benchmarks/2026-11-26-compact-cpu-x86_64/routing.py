"""A packed cache read by the in-place group (the plan's default) or by the kernel's table rows.

    python docs/benchmarks/2026-11-26-compact-cpu-x86_64/routing.py 8192 snapkv@0.2

One prompt prefilled once (``bench_decode_bound.Prefilled``, smollm2-llava, batch 4, 1 thread), then
per round, rotated: ``packed-default`` (packing on, the plan as it is: requests of >= 1024 entries
whose heads share their runs are read in place by runs, the appended tail gathered and merged),
``packed-rows`` (packing on, ``paged_cpu.INPLACE_MIN`` raised: every request read by its table rows),
``unpacked`` (packing off, the plan as it is). 4 timed decode steps each: step ms, the paged
attention calls' ms, aten ops of one more step.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

from bench_common import load_for_bench  # noqa: E402
from bench_decode import stats_for  # noqa: E402
from bench_decode_bound import Prefilled  # noqa: E402
from decode_reads import AttnTimer  # noqa: E402

import vlkv.plugins.paged_cpu as paged_cpu  # noqa: E402
import vlkv.runtime.kv.packing as packing  # noqa: E402
from vlkv.runtime.edits import apply_edits  # noqa: E402
from vlkv.runtime.engine import Engine  # noqa: E402
from vlkv.runtime.op_count import count_ops  # noqa: E402
from vlkv.runtime.policies import make_policy  # noqa: E402

torch.set_num_threads(1)
tokens, name = int(sys.argv[1]), sys.argv[2]
kind, budget = name.split("@")
eng = Engine(load_for_bench("smollm2-llava", "cpu", "fp32"))
pre = Prefilled(eng, "smollm2-llava", tokens, 4, {name: make_policy(kind, budget=float(budget))})
for rep in range(4):
    for cfg in ("packed-default", "packed-rows", "unpacked"):
        packing.PACK = cfg != "unpacked"
        paged_cpu.INPLACE_MIN = 10**9 if cfg == "packed-rows" else 1024
        pol = make_policy(kind, budget=float(budget))
        cache, ctx = pre.cache_copy(), eng.context(pre.batch)
        apply_edits(cache, pol.after_prefill(cache, stats_for(pre.stats, pre.alias.get(kind, kind)), ctx))
        tok, steps, reads = pre.first, [], []
        with AttnTimer() as timer:
            for step in range(5):
                timer.seconds = 0.0
                t0 = time.perf_counter()
                tok = eng.decode(tok, pre.batch, pol, cache, step + 1).logits.argmax(-1)
                if step:
                    steps.append(time.perf_counter() - t0)
                    reads.append(timer.seconds)
        with count_ops() as c:
            eng.decode(tok, pre.batch, pol, cache, 7)
        cache.release()
        step_ms, attn_ms = 1e3 * statistics.mean(steps), 1e3 * statistics.mean(reads)
        print(rep, cfg, f"step {step_ms:.1f} attn {attn_ms:.1f} ops {c.ops}", flush=True)
