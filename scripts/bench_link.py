"""Linking stored images into new prompts: TTFT and fidelity per method, against full recompute.

    python scripts/bench_link.py --model tiny-qwen2-vl --images 1 2 5 10 --out docs/benchmarks/link-tiny-qwen2-vl-cpu.md

For each image count, a first request computes the images (its records go to the store); the
measured request asks something else about the same images, with *another* system text before them
and the images in another order, so no prefix is shared. Per method (``none``, ``prefix``,
``full-reuse``, ``cacheblend`` at several r, ``mpic`` at several k) the report gives time to first token (median of repeats,
methods interleaved), the tokens recomputed, and fidelity to full recompute over ``--tokens``
teacher-forced steps (top-1 agreement, mean KL). Methods marked ``@b`` link records written
compressed (``--store-budget b``: a share ``b`` of each image's entries kept). One image's store hit
(load from disk + link) is timed against recomputing it, with the bytes a hit moves, dense and
compressed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import add_device_args, check_device_args, torch_dtype  # scripts/ is sys.path[0]

from vlkv.runtime.engine import Engine
from vlkv.runtime.link.gate import _forced
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

SYSTEMS = ("You are a careful assistant.", "Answer briefly and precisely, please.")


def _images(model: str, n: int) -> list:
    if model == "smollm2-llava":
        from vlkv.runtime.models.photos import real_photos

        pool = real_photos()
    else:
        pool = [f"builtin:{k}" for k in ("checkerboard", "gradient", "noise")]
    from vlkv.runtime.models.images import load_image

    out = []
    for i in range(n):  # distinct images: rotate / flip the few built-ins
        img = load_image(pool[i % len(pool)])
        out.append(img.rotate(90 * (i // len(pool))) if i >= len(pool) else img)
    return out


def _prompts(images: list) -> tuple[Prompt, Prompt]:
    """The request that makes the records, and the measured one: other text, images reversed."""
    first = Prompt(f"{SYSTEMS[0]} Describe these pictures.", images)
    later = Prompt(f"{SYSTEMS[1]} Which of these pictures is brightest?", images[::-1])
    return first, later


def measure(engine, images, specs, tokens: int, repeats: int) -> list[dict]:
    pool = engine.new_cache(engine.encode([Prompt("x")])).pool
    first, later = _prompts(images)
    batch = engine.encode([later])
    want = engine.generate([later], make_policy("full"), tokens, stop_at_eos=False).samples[0].token_ids
    full_cache = engine.new_cache(batch, pool=pool)
    ref = _forced(engine, batch, full_cache, engine.prefill(batch, make_policy("full"), full_cache), want)
    full_cache.release()
    rows = {spec: {"ttft": []} for spec in specs}
    stores = {}
    for spec in specs:  # records (and the first prompt's prefix) exist before the measured request
        store = SegmentStore(pool)
        source = RecordSource.for_engine(engine, store)
        b1 = engine.encode([first])
        c1 = engine.new_cache(b1, pool=pool)
        link_prefill(engine, b1, first.images, c1, spec, source)
        c1.release()
        stores[spec] = source
    for _ in range(repeats):
        for spec in specs:  # interleaved
            cache = engine.new_cache(batch, pool=pool)
            known = set(stores[spec].segments.prefixes)
            t0 = time.perf_counter()
            out, st = link_prefill(engine, batch, later.images, cache, spec, stores[spec])
            first_token = int(out.logits.argmax(-1))  # noqa: F841 - the first token is the end of TTFT
            rows[spec]["ttft"].append(time.perf_counter() - t0)
            rows[spec]["stats"] = st
            if "fidelity" not in rows[spec]:
                got = _forced(engine, batch, cache, out, want)
                agree = sum(float(r.argmax() == g.argmax()) for r, g in zip(ref, got)) / len(ref)
                kl = sum(float((r.exp() * (r - g)).sum()) for r, g in zip(ref, got)) / len(ref)
                rows[spec]["fidelity"] = (agree, kl)
            cache.release()
            for key in set(stores[spec].segments.prefixes) - known:  # every repeat is a first visit
                stores[spec].segments.prefixes.pop(key).release()
    out = []
    for spec in specs:
        r = rows[spec]
        out.append(
            {
                "method": _name(spec),
                "ttft_s": statistics.median(r["ttft"]),
                "recomputed": r["stats"].recomputed_tokens,
                "reused": r["stats"].reused_tokens,
                "agreement": r["fidelity"][0],
                "kl": r["fidelity"][1],
                "prompt_tokens": int(batch.lengths[0]),
            }
        )
    return out


def _name(spec: LinkSpec) -> str:
    if spec.method == "mpic":
        name = f"mpic-{spec.k}"
    else:
        name = f"cacheblend-{spec.r:g}" if spec.method == "cacheblend" else spec.method
    return name if spec.store_budget >= 1.0 else f"{name} @{spec.store_budget:g}"


def hit_vs_recompute(engine, image, repeats: int, budget: float = 1.0) -> dict:
    """One image: load its record (kept at ``budget``) from a disk store, against computing it alone."""
    from vlkv.runtime.link.linker import standalone_segment
    from vlkv.runtime.store import ContextStore

    prompt = Prompt("Describe.", [image])
    batch = engine.encode([prompt])
    pool = engine.new_cache(batch).pool
    span = batch.spans[0].image_spans[0]
    with tempfile.TemporaryDirectory() as tmp:
        store = ContextStore.open(tmp, host_bytes=0)
        src = RecordSource.for_engine(engine, SegmentStore(pool), store)
        emb = engine.backend.embed(batch)
        seg = standalone_segment(engine, batch, emb, span, pool)
        if budget < 1.0:
            from vlkv.runtime.link.compress import compress_segment

            seg = compress_segment(seg, budget)
        src.remember(src.identity(image), seg, emb[0, span[0] : span[1]])
        hit, compute = [], []
        for _ in range(repeats):
            fresh = RecordSource.for_engine(engine, SegmentStore(pool), ContextStore.open(tmp, host_bytes=0))
            t0 = time.perf_counter()
            got = fresh.lookup(fresh.identity(image))
            hit.append(time.perf_counter() - t0)
            got.release()
            t0 = time.perf_counter()
            e = engine.backend.embed(batch)
            standalone_segment(engine, batch, e, span, pool).release()
            compute.append(time.perf_counter() - t0)
        return {
            "tokens": span[1] - span[0],
            "hit_s": statistics.median(hit),
            "recompute_s": statistics.median(compute),
            "bytes": fresh.loaded_bytes,  # one hit: each repeat reads through a fresh source
        }


def load_overlap(engine, images: list, repeats: int) -> dict:
    """TTFT of a prompt whose first image is new and the rest are on disk: store reads in order vs on
    loader threads while the new image computes (fresh pool and store copy per run, modes interleaved)."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from vlkv.runtime.store import ContextStore

    prompt = Prompt("Compare the new picture with the others.", images)
    batch = engine.encode([prompt])
    spec = LinkSpec("mpic", 32)
    times: dict[str, list[float]] = {"in order": [], "load ‖ compute": []}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as loader:
        base = Path(tmp) / "base"
        pool = engine.new_cache(batch).pool
        seed = RecordSource.for_engine(engine, SegmentStore(pool), ContextStore.open(base, host_bytes=0))
        b0 = engine.encode([Prompt("Look.", images[1:])])
        link_prefill(engine, b0, images[1:], engine.new_cache(b0, pool=pool), spec, seed)
        for rep in range(repeats):
            for mode in times:
                copy = Path(tmp) / f"{rep}-{len(mode)}"
                shutil.copytree(base, copy)
                src = RecordSource.for_engine(
                    engine, SegmentStore(engine.new_cache(batch).pool), ContextStore.open(copy, host_bytes=0)
                )
                src.loader = loader if mode != "in order" else None
                cache = engine.new_cache(batch, pool=src.segments.pool)
                t0 = time.perf_counter()
                out, st = link_prefill(engine, batch, images, cache, spec, src)
                int(out.logits.argmax(-1))
                times[mode].append(time.perf_counter() - t0)
                assert st.misses >= 1 and st.hits >= 1, "the first image must be new, some others stored"
    return {**{mode: statistics.median(t) for mode, t in times.items()}, "hits": st.hits, "misses": st.misses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 2, 5, 10])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 8, 16, 32, 64])
    ap.add_argument("--r", type=float, nargs="*", default=[0.15], help="CacheBlend fractions")
    ap.add_argument("--budget", type=float, nargs="*", default=[0.5], help="compressed-record budgets")
    ap.add_argument("--overlap", type=int, default=0, help="images in the load ‖ compute timing (0: skip)")
    ap.add_argument("--budget-k", type=int, nargs="*", default=[8], help="MPIC k run on compressed records")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    add_device_args(ap)
    args = ap.parse_args()
    check_device_args(ap, args)
    torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device))
    specs = [LinkSpec("none"), LinkSpec("prefix"), LinkSpec("full-reuse")]
    specs += [LinkSpec("cacheblend", r=r) for r in args.r] + [LinkSpec("mpic", k) for k in args.k]
    for b in args.budget:
        specs += [LinkSpec("full-reuse", store_budget=b)] + [
            LinkSpec("mpic", k, store_budget=b) for k in args.budget_k
        ]
    lines = [
        f"# Linking stored images — `{args.model}`",
        "",
        f"Machine: CPU ({platform.machine()}, {args.threads} thread(s), 2-core VM, 24 GB, no GPU). Median of "
        f"{args.repeats} repeats, methods interleaved; fidelity over {args.tokens} teacher-forced tokens of full "
        "recompute's greedy continuation. The measured prompt has other text than the one that made the "
        "records and its images in reverse order, so a prefix match ends at the first image at the latest.",
        "",
        "| images | prompt tokens | method | TTFT (s) | vs none | vs prefix | recomputed | reused | top-1 agreement | mean KL |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in args.images:
        rows = measure(engine, _images(args.model, n), specs, args.tokens, args.repeats)
        base = rows[0]["ttft_s"]
        prefix = rows[1]["ttft_s"]
        for r in rows:
            lines.append(
                f"| {n} | {r['prompt_tokens']} | {r['method']} | {r['ttft_s']:.3f} | {r['ttft_s'] / base:.2f} | "
                f"{r['ttft_s'] / prefix:.2f} | {r['recomputed']} | {r['reused']} | {r['agreement']:.3f} | {r['kl']:.4f} |"
            )
        print("\n".join(lines[-len(rows) :]), flush=True)
    image = _images(args.model, 1)[0]
    h = hit_vs_recompute(engine, image, args.repeats)
    lines += [
        "",
        f"One image ({h['tokens']} tokens): store hit (disk read, verify, load into the pool) {h['hit_s'] * 1e3:.1f} ms "
        f"vs recompute (vision tower + prefill alone) {h['recompute_s'] * 1e3:.1f} ms — "
        f"{h['recompute_s'] / h['hit_s']:.1f}× faster; a hit moves {h['bytes'] / 1024:.1f} KiB (dense record).",
    ]
    if args.overlap:
        stored = _images(args.model, args.overlap - 1)
        imgs = [stored[0].rotate(45), *stored]  # a picture no record holds, then stored ones
        o = load_overlap(engine, imgs, args.repeats)
        seq, par = o["in order"], o["load ‖ compute"]
        lines.append(
            f"Load ‖ compute ({args.overlap} images: {o['misses']} computed, {o['hits']} read from disk; mpic-32): "
            f"TTFT {seq:.3f} s with reads in order vs {par:.3f} s with reads on 2 loader threads while "
            f"the new image computes — {par / seq:.2f}×."
        )
    for b in args.budget:
        c = hit_vs_recompute(engine, image, args.repeats, b)
        lines.append(
            f"Compressed at {b:g} (keynorm): a hit moves {c['bytes'] / 1024:.1f} KiB, "
            f"{c['bytes'] / h['bytes']:.2f}× the dense bytes (K/V scale with the budget, the embeddings "
            f"stay whole); hit {c['hit_s'] * 1e3:.1f} ms ({c['hit_s'] / h['hit_s']:.2f}× the dense hit)."
        )
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        Path(args.out).write_text(md)


if __name__ == "__main__":
    main()
