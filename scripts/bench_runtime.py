"""Continuous batching at a fixed KV pool: a seeded Poisson stream, per policy, and transformers' peer.

    python scripts/bench_runtime.py --model smollm2-llava --out docs/benchmarks/runtime-cpu.md

For each configuration the same stream (mixed prompt lengths, 0–3 images, arrival times drawn from
a seeded Poisson process) runs through one :class:`~vlkv.runtime.scheduler.Scheduler` whose pool holds
``--pool-requests`` uncompressed requests; the report gives throughput (generated tokens/s), TTFT and
time per output token (p50/p99), how many requests ran at once, preemptions, and the K/V bytes a
decode step writes into the pool — beside what the wave-1 engine wrote for the same step (it
reallocated every edited layer to the kept size, copying every survivor), counted in the same run.

The peer: transformers' own continuous batching (``generate_batch``) on the same language-model
weights and the same token sequences (image rows become a placeholder token, since it takes ids
only), all requests at t = 0, against vlkv's full cache on the same offline batch: ratio of
generated tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from bench_common import add_device_args, check_device_args, torch_dtype  # scripts/ is sys.path[0]

from vlkv.runtime.cache import LayerKV
from vlkv.runtime.engine import Engine
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

CONFIGS = [
    ("full", {}),
    ("snapkv", {"budget": 0.5}),
    ("snapkv", {"budget": 0.2}),
    ("vlcache", {"budget": 0.2}),
    ("h2o", {"budget": 0.5}),
    ("h2o", {"budget": 0.2}),
    ("h2o", {"budget": 0.2, "evict_every": 8}),
    ("local", {"budget": 0.2}),
]


def _images(model: str) -> list:
    if model == "smollm2-llava":
        from vlkv.runtime.models.photos import real_photos

        return real_photos()
    return [f"builtin:{name}" for name in ("checkerboard", "gradient", "noise")]


def make_stream(model: str, n: int, rate: float, seed: int, max_new: int) -> list[tuple[float, Prompt, int]]:
    """``n`` requests ``(arrival_s, prompt, max_new_tokens)``: Poisson arrivals at ``rate``/s."""
    from vlkv.eval.corpus import paragraphs

    rng = random.Random(seed)
    words = " ".join(paragraphs()).split()
    imgs = _images(model)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        k = rng.randint(10, 160)
        start = rng.randint(0, len(words) - k)
        text = " ".join(words[start : start + k]) + " Summarise this."
        images = [imgs[rng.randrange(len(imgs))] for _ in range(rng.randint(0, 3))]
        out.append((t, Prompt(text, images), rng.randint(max_new // 2, max_new)))
    return out


class WaveOneCounter:
    """What the wave-1 engine wrote for the same edits: a reallocation to the kept size, per layer."""

    def __init__(self):
        self.bytes = 0
        self._select, self._merge = LayerKV.select, LayerKV.merge

    def __enter__(self):
        counter = self

        def select(layer, index, keep_len, spare=0, **kw):  # holes=, recycle=: passed through
            counter.bytes += index.shape[0] * index.shape[1] * (index.shape[2] + spare) * _row_bytes(layer)
            return counter._select(layer, index, keep_len, spare, **kw)

        def merge(layer, index, keep_len, assign, counts):
            counter.bytes += index.shape[0] * index.shape[1] * index.shape[2] * _row_bytes(layer)
            return counter._merge(layer, index, keep_len, assign, counts)

        LayerKV.select, LayerKV.merge = select, merge
        return self

    def __exit__(self, *exc):
        LayerKV.select, LayerKV.merge = self._select, self._merge


def _row_bytes(layer: LayerKV) -> int:
    """K + V bytes of one head's entry."""
    return layer.pool.spec.entry_bytes // layer.pool.spec.kv_heads


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def run_stream(engine, stream, name: str, kw: dict, pool_bytes: int) -> dict:
    policy = make_policy(name, **kw)
    sched = Scheduler(engine, pool_bytes)
    pending = list(stream)
    reqs, concurrency = [], []
    t0 = time.perf_counter()
    decode_written = decode_steps = 0
    with WaveOneCounter() as wave1:
        wave1_decode = 0
        while pending or sched.has_work:
            now = time.perf_counter() - t0
            while pending and pending[0][0] <= now:
                _t, prompt, m = pending.pop(0)
                r = Request(prompt, policy, m, stop_at_eos=False)
                reqs.append(sched.submit(r))
            if not sched.has_work:
                time.sleep(max(0.0, min(pending[0][0] - now, 0.05)))
                continue
            sched._resume()
            sched._admit()
            before_w, before_1 = sched.pool.bytes_written, wave1.bytes
            if sched.running:
                concurrency.append(len(sched.running))
                n_run = len(sched.running)
                sched._decode()
                decode_written += sched.pool.bytes_written - before_w
                wave1_decode += (
                    wave1.bytes - before_1 + n_run * sched.pool.spec.entry_bytes * sched.pool.spec.num_layers
                )
                decode_steps += 1
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in reqs)
    ttft = [r.ttft_s for r in reqs if r.ttft_s is not None]
    tpot = [(r.finish_s - r.first_token_s) / (len(r.tokens) - 1) for r in reqs if len(r.tokens) > 1]
    return {
        "policy": policy.name,
        "budget": float(policy.budget),
        "settings": kw,
        "requests": len(reqs),
        "failed": sum(r.error is not None for r in reqs),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5),
        "tpot_p99_s": _pct(tpot, 0.99),
        "max_concurrent": max(concurrency, default=0),
        "mean_concurrent": statistics.fmean(concurrency) if concurrency else 0.0,
        "preemptions": sum(r.preemptions for r in reqs),
        "decode_bytes_written_per_step": decode_written / max(decode_steps, 1),
        "wave1_bytes_written_per_step": wave1_decode / max(decode_steps, 1),
        "peak_pool_used_bytes": sched.peak_used_bytes,
    }


def run_offline_vlkv(engine, stream, max_new: int) -> dict:
    """Every request at t = 0, ``max_new`` tokens each (as the peer does), growable pool."""
    sched = Scheduler(engine)
    t0 = time.perf_counter()
    reqs = [sched.submit(Request(p, make_policy("full"), max_new, stop_at_eos=False)) for _, p, _m in stream]
    sched.run()
    wall = time.perf_counter() - t0
    return {"tokens": sum(len(r.tokens) for r in reqs), "wall_s": wall}


def run_offline_peer(engine, stream, workdir: Path) -> dict:
    """transformers ``generate_batch`` on the VLM's language model, same token sequences."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from vlkv.eval.peers import export_language_model

    lm = AutoModelForCausalLM.from_pretrained(
        export_language_model(engine, workdir / "lm"), dtype=torch.float32
    )
    lm.eval()
    placeholder = engine.pad_id
    inputs = []
    for _, p, _m in stream:
        ids = engine.encode([p]).input_ids[0].tolist()
        img = engine.loaded.image_token_id if hasattr(engine.loaded, "image_token_id") else None
        inputs.append([placeholder if t == img else t for t in ids])
    max_new = max(m for _, _, m in stream)
    cfg = GenerationConfig(
        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=placeholder
    )
    lm.generate_batch(inputs[:2], generation_config=cfg, progress_bar=False)  # warm-up (sizing, first run)
    t0 = time.perf_counter()
    out = lm.generate_batch(inputs, generation_config=cfg, progress_bar=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "wall_s": wall, "max_new": max_new}


def to_markdown(rows: list[dict], peer: dict | None, args, machine: str) -> str:
    lines = [
        f"# Continuous batching at a fixed KV pool — `{args.model}`",
        "",
        f"Machine: {machine}. Stream: {args.requests} requests, Poisson arrivals at {args.rate}/s (seed {args.seed}), "
        f"10–160 words of corpus text + 0–3 images each, {args.max_new // 2}–{args.max_new} new tokens (greedy, no eos). "
        f"Pool: {rows[0]['pool_bytes'] / 2**20:.1f} MiB = {args.pool_requests} uncompressed requests. "
        "All configurations ran in one process, one after the other; compare ratios, not absolute times.",
        "",
        "| policy | budget | tok/s | vs full | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | max / mean running | preempted | KV B written per decode step | wave-1 engine | ratio |",
        "|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    base = rows[0]["tokens_per_s"]
    for r in rows:
        ratio = r["wave1_bytes_written_per_step"] / max(r["decode_bytes_written_per_step"], 1)
        lines.append(
            f"| {r['policy']} | {r['budget']:g} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {1000 * r['tpot_p50_s']:.0f} / {1000 * r['tpot_p99_s']:.0f} | "
            f"{r['max_concurrent']} / {r['mean_concurrent']:.1f} | {r['preemptions']} | "
            f"{r['decode_bytes_written_per_step'] / 1024:.1f} KiB | {r['wave1_bytes_written_per_step'] / 1024:.1f} KiB | {ratio:.1f}× |"
        )
    if peer is not None:
        ours = peer["vlkv"]["tokens"] / peer["vlkv"]["wall_s"]
        theirs = peer["transformers"]["tokens"] / peer["transformers"]["wall_s"]
        lines += [
            "",
            "## Peer: transformers `generate_batch` (continuous batching), same LM weights and token sequences",
            "",
            f"All {args.requests} requests at t = 0, full cache, greedy. vlkv: {peer['vlkv']['tokens']} tokens in "
            f"{peer['vlkv']['wall_s']:.1f} s ({ours:.1f} tok/s); transformers {peer['transformers_version']}: "
            f"{peer['transformers']['tokens']} tokens in {peer['transformers']['wall_s']:.1f} s ({theirs:.1f} tok/s). "
            f"**vlkv / transformers = {ours / theirs:.2f}×** tokens/s. Both "
            "generate max_new tokens for every request (one max_new_tokens per batch there); image rows "
            "are a placeholder token there (it takes ids only), so its prompts cost the same attention but no "
            "vision tower.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--pool-requests", type=float, default=3.0, help="pool size in uncompressed requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    add_device_args(ap)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    check_device_args(ap, args)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device=args.device, dtype=torch_dtype(args.dtype))
    engine = Engine(loaded)
    stream = make_stream(args.model, args.requests, args.rate, args.seed, args.max_new)
    be = engine.backend
    entry = 2 * be.num_kv_heads * be.head_dim * torch.empty((), dtype=be.dtype).element_size() * be.num_layers
    mean_len = statistics.fmean(engine.encode([p]).lengths.item() + m for _, p, m in stream)
    pool_bytes = int(args.pool_requests * mean_len * entry)
    run_stream(engine, stream[:2], "full", {}, pool_bytes)  # warm-up
    rows = []
    for name, kw in CONFIGS:
        row = run_stream(engine, stream, name, kw, pool_bytes)
        row["pool_bytes"] = pool_bytes
        rows.append(row)
        print(json.dumps(row))
    peer = None
    if not args.no_peer:
        import tempfile

        import transformers

        with tempfile.TemporaryDirectory() as tmp:
            peer = {
                "vlkv": run_offline_vlkv(engine, stream, args.max_new),
                "transformers": run_offline_peer(engine, stream, Path(tmp)),
                "transformers_version": transformers.__version__,
            }
        print(json.dumps(peer))
    machine = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU ({platform.machine()}, {args.threads} threads, 2-core VM, 24 GB, no GPU)"
    )
    md = to_markdown(rows, peer, args, machine)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
        out.with_suffix(".json").write_text(
            json.dumps({"rows": rows, "peer": peer, "args": vars(args)}, indent=1)
        )


if __name__ == "__main__":
    main()
