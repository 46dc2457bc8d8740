"""Image records stored as low-rank factors (``--store-rank R``): bytes a hit moves vs fidelity.

    VLKV_CACHE=... python scripts/bench_record_rank.py --ranks 8 16 32 64 \
        --out docs/benchmarks/<date>-cpu-x86_64-2t/record-rank.md

Per real photo, a first request computes the image and writes its record to a fresh disk store;
a second request asks another question about the same image and links the record read back from
disk (``full-reuse``: every image entry comes from the record, so the record alone decides the
fidelity). Per rank: the record's bytes on disk and the bytes the hit moved, as ratios to the dense
record, and fidelity over ``--tokens`` teacher-forced steps (top-1 agreement, mean KL) against
linking the dense record and against full recompute.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_device_args, add_threads_arg, check_device_args, load_for_bench  # noqa: E402

from vlkv.runtime.engine import Engine  # noqa: E402
from vlkv.runtime.link.gate import _forced  # noqa: E402
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource  # noqa: E402
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec  # noqa: E402
from vlkv.runtime.policies import make_policy  # noqa: E402
from vlkv.runtime.prompt import Prompt  # noqa: E402
from vlkv.runtime.store import ContextStore  # noqa: E402

FIRST, LATER = "Describe this photo.", "What colours stand out in this photo, and where?"


def _linked(engine, prompt, spec, root: Path):
    """Link ``prompt``'s image from a fresh store object over ``root``: (batch, cache, out, stats)."""
    batch = engine.encode([prompt])
    pool = engine.new_cache(batch).pool
    source = RecordSource.for_engine(engine, SegmentStore(pool), ContextStore.open(root, host_bytes=0))
    cache = engine.new_cache(batch, pool=pool)
    out, stats = link_prefill(engine, batch, prompt.images, cache, spec, source)
    return batch, cache, out, stats


def _compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    top1 = sum(float(r.argmax() == g.argmax()) for r, g in zip(ref, got)) / len(ref)
    kl = sum(float((r.exp() * (r - g)).sum()) for r, g in zip(ref, got)) / len(ref)
    return top1, kl


def run(args) -> dict:
    from vlkv.runtime.models.photos import real_photos

    engine = Engine(load_for_bench(args.model, args.device, args.dtype))
    rows: dict[str, dict[str, list[float]]] = {}
    photos = real_photos()[: args.images]
    for i, photo in enumerate(photos):
        first, later = Prompt(FIRST, [photo]), Prompt(LATER, [photo])
        batch = engine.encode([later])
        full_cache = engine.new_cache(batch)
        full_out = engine.prefill(batch, make_policy("full"), full_cache)
        tokens = (
            engine.generate([later], make_policy("full"), args.tokens, stop_at_eos=False).samples[0].token_ids
        )
        full = _forced(engine, batch, full_cache, full_out, tokens)
        dense = None
        for rank in [0, *args.ranks]:
            spec = LinkSpec("full-reuse", store_rank=rank)
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                _linked(engine, first, spec, root)  # writes the record
                on_disk = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
                b, cache, out, stats = _linked(engine, later, spec, root)
                if stats.hits != 1:
                    raise RuntimeError(f"rank {rank}: the second request missed the record")
                got = _forced(engine, b, cache, out, tokens)
            if rank == 0:
                dense = {"disk": on_disk, "loaded": stats.bytes_loaded, "logp": got}
            label = "dense record" if rank == 0 else f"rank {rank}"
            row = rows.setdefault(
                label, {k: [] for k in ("disk", "loaded", "top1_dense", "kl_dense", "top1_full", "kl_full")}
            )
            row["disk"].append(on_disk / dense["disk"])
            row["loaded"].append(stats.bytes_loaded / dense["loaded"])
            t, k = _compare(dense["logp"], got)
            row["top1_dense"].append(t)
            row["kl_dense"].append(k)
            t, k = _compare(full, got)
            row["top1_full"].append(t)
            row["kl_full"].append(k)
            print(i, label, {n: round(v[-1], 4) for n, v in row.items()}, flush=True)
        rows.setdefault("_dense_bytes", {"disk": [], "loaded": []})
        rows["_dense_bytes"]["disk"].append(dense["disk"])
        rows["_dense_bytes"]["loaded"].append(dense["loaded"])
    mean = {label: {k: sum(v) / len(v) for k, v in r.items()} for label, r in rows.items()}
    return {
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads, no GPU",
        "model": args.model,
        "photos": len(photos),
        "tokens": args.tokens,
        "rows": mean,
    }


def write(result: dict, out: Path) -> None:
    dense = result["rows"].get("_dense_bytes", {})
    lines = [
        f"# Image records stored as low-rank factors on {result['model']}",
        "",
        f"Machine: {result['machine']}. {result['photos']} real photos, {result['tokens']} teacher-forced"
        " tokens, generated by `scripts/bench_record_rank.py`. The second request links the image record"
        " read back from a disk store (`full-reuse`: every image entry comes from the record). Bytes are"
        f" ratios to the dense record (mean {dense.get('disk', 0) / 2**20:.2f} MiB on disk, hit moves"
        f" {dense.get('loaded', 0) / 2**20:.2f} MiB).",
        "",
        "| record | bytes on disk / dense | bytes a hit moves / dense | top-1 vs dense record | KL vs dense record | top-1 vs full recompute | KL vs full recompute |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in result["rows"].items():
        if label.startswith("_"):
            continue
        lines.append(
            f"| {label} | {r['disk']:.3f} | {r['loaded']:.3f} | {r['top1_dense']:.3f} | {r['kl_dense']:.4f} |"
            f" {r['top1_full']:.3f} | {r['kl_full']:.4f} |"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/record-rank-smollm2-llava-cpu.md"))
    add_device_args(ap)
    add_threads_arg(ap)
    args = ap.parse_args()
    check_device_args(ap, args)
    if args.images < 1 or args.tokens < 2 or any(r < 1 for r in args.ranks):
        ap.error("--images must be >= 1, --tokens >= 2 and every rank >= 1")
    write(run(args), args.out)


if __name__ == "__main__":
    main()
