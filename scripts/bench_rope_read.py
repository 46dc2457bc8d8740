"""What RoPE-on-read costs: reading linked (pre-RoPE) entries vs private (post-RoPE) ones.

    python scripts/bench_rope_read.py --model smollm2-llava --out docs/benchmarks/rope-read-cpu.md

For each context length, one request's prompt is prefilled (private entries, stored rotated) and the
same entries are also stored as a shared segment and linked into a second cache (stored pre-RoPE,
rotated on every read). The report times ``attention_kv`` for all layers in both caches, and one
whole decode step on each, interleaved in one run, and gives the ratios.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from bench_common import add_device_args, check_device_args, torch_dtype  # scripts/ is sys.path[0]

from vlkv.runtime.backend import StepInputs
from vlkv.runtime.engine import Engine
from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


def _time(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(engine, words: int, repeats: int) -> dict:
    from vlkv.eval.corpus import paragraphs

    text = " ".join(" ".join(paragraphs()).split()[:words])
    batch = engine.encode([Prompt(text)])
    n = int(batch.lengths[0])
    private = engine.new_cache(batch)
    engine.backend.step(
        StepInputs(
            batch.input_ids, batch.positions, batch.modality, batch.lengths, engine.backend.embed(batch)
        ),
        private,
    )
    seg = SharedSegment.from_cache(private, 0, n)
    linked = engine.new_cache(batch, pool=private.pool)
    seg.link(linked, batch.positions[0])
    linked.processed += n

    def read(cache):
        return lambda: [layer.attention_kv() for layer in cache.layers]

    policy, token = make_policy("full"), torch.tensor([1])

    def step(cache):
        def run():
            engine.decode(token, batch, policy, cache, 1)
            for layer in cache.layers:  # drop the appended entry so every repeat sees n entries
                layer.select(torch.arange(n)[None, None].expand(1, layer.kv_heads, n), torch.tensor([n]))
            cache.processed -= 1
            cache.next_position -= 1

        return run

    rp, rl = _time(read(private), repeats), _time(read(linked), repeats)
    sp, sl = _time(step(private), repeats), _time(step(linked), repeats)
    return {
        "entries": n,
        "read_private_ms": 1e3 * rp,
        "read_linked_ms": 1e3 * rl,
        "step_private_ms": 1e3 * sp,
        "step_linked_ms": 1e3 * sl,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--words", type=int, nargs="+", default=[100, 400, 1200])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    add_device_args(ap)
    args = ap.parse_args()
    check_device_args(ap, args)
    torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device))
    rows = [measure(engine, w, args.repeats) for w in args.words]
    machine = f"CPU ({platform.machine()}, {args.threads} thread(s), 2-core VM, 24 GB, no GPU)"
    lines = [
        f"# RoPE on read — `{args.model}`",
        "",
        f"Machine: {machine}. Median of {args.repeats} repeats, private and linked caches interleaved in one run.",
        "",
        "| entries | read K/V, private (ms) | read K/V, linked + rotate (ms) | read ratio | decode step, private (ms) | decode step, linked (ms) | step ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['entries']} | {r['read_private_ms']:.2f} | {r['read_linked_ms']:.2f} | "
            f"{r['read_linked_ms'] / r['read_private_ms']:.2f} | {r['step_private_ms']:.2f} | "
            f"{r['step_linked_ms']:.2f} | {r['step_linked_ms'] / r['step_private_ms']:.2f} |"
        )
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        Path(args.out).write_text(md)


if __name__ == "__main__":
    main()
