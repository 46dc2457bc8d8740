"""AttentionPack: image-KV bytes vs fidelity on real photos, against eviction at equal bytes.

    VLKV_CACHE=... python scripts/bench_attnpack.py --out docs/benchmarks/attnpack-smollm2-llava-cpu.md

For every photo the full cache first generates ``--new`` greedy tokens. Each configuration then
(1) replays those tokens (teacher forcing) and compares its next-token distribution with the full
cache's at every step: top-1 agreement and KL(full ‖ config); (2) generates freely: greedy agreement
is the fraction of positions whose token equals the full cache's. Decode-step time is a ratio to a
full-cache replay run right before it (interleaved). Image-KV bytes: the image entries' dense bytes
(full) vs the factor bytes held after prefill.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from vlkv.runtime.cache import Modality
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_device_args, add_threads_arg, check_device_args, load_for_bench  # noqa: E402

QUESTION = "Describe this photo in detail."


def image_bytes(cache) -> int:
    """Bytes held for image entries: dense image slots plus every layer's factors."""
    total = 0
    for layer in cache.layers:
        img = (layer.modality == int(Modality.IMAGE)) & layer.valid_mask()[:, None, :] & (layer.slots >= 0)
        total += int(img.sum()) * layer.pool.spec.entry_bytes // layer.kv_heads
        total += layer.lowrank.nbytes() if layer.lowrank is not None else 0
    return total


def replay(engine, batch, policy, tokens: list[int]):
    """Teacher-forced run: ``(steps, V)`` fp32 log-probs, image bytes after prefill, decode seconds."""
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, policy, cache)
    held = image_bytes(cache)
    logits = [out.logits.reshape(1, -1, out.logits.shape[-1])[0, -1].float()]
    t0 = time.perf_counter()
    for step, tok in enumerate(tokens[:-1], start=1):
        out = engine.decode(torch.tensor([tok]), batch, policy, cache, step)
        logits.append(out.logits.reshape(-1, out.logits.shape[-1])[-1].float())
    return torch.log_softmax(torch.stack(logits), -1), held, time.perf_counter() - t0, cache.kv_bytes()


def configs(ranks, budgets, paths=("a",), text: bool = False) -> list[tuple[str, str, dict]]:
    out = []  # the full cache is the reference every row is compared with
    extra = {"compress_text": True} if text else {}
    for r in ranks:
        for path in paths:
            tag = "" if path == "a" else " path=b"
            out.append((f"attnpack r={r}{tag}", "attnpack", {"rank": r, "rank_lo": r, "path": path, **extra}))
            out.append(
                (
                    f"attnpack r={r} aware (lo={max(1, r // 4)}){tag}",
                    "attnpack",
                    {"rank": r, "path": path, **extra},
                )
            )
    for b in budgets:
        for name in ("snapkv", "h2o"):
            out.append((f"{name} budget={b}", name, {"budget": b}))
    return out


def text_prompts(n: int, words: int = 400) -> list[Prompt]:
    """``n`` passages of about ``words`` words from the bundled corpus, each with a question."""
    from vlkv.eval.corpus import paragraphs

    out, cur = [], []
    for para in paragraphs():
        cur.append(para)
        if sum(len(p.split()) for p in cur) >= words:
            out.append(Prompt("\n\n".join(cur) + "\n\nSummarise the passage above in detail.", []))
            cur = []
            if len(out) == n:
                break
    return out


def run(args) -> dict:
    engine = Engine(load_for_bench(args.model, args.device, args.dtype))
    if args.text:
        prompts = text_prompts(args.images)
    else:
        from vlkv.runtime.models.photos import real_photos

        prompts = [Prompt(QUESTION, [photo]) for photo in real_photos()[: args.images]]
    rows: dict[str, dict] = {}
    for i, prompt in enumerate(prompts):
        batch = engine.encode([prompt])
        want = engine.generate([prompt], make_policy("full"), args.new, stop_at_eos=False)
        tokens = want.samples[0].token_ids
        ref, full_img, _, full_kv = replay(engine, batch, make_policy("full"), tokens)
        for label, name, kw in configs(args.ranks, args.budgets, args.paths, args.text):
            _, _, t_full, _ = replay(engine, batch, make_policy("full"), tokens)  # interleaved timing
            lp, held, t, kv = replay(engine, batch, make_policy(name, **kw), tokens)
            free = engine.generate([prompt], make_policy(name, **kw), args.new, stop_at_eos=False)
            got = free.samples[0].token_ids
            n = min(len(got), len(tokens))
            row = rows.setdefault(label, {k: [] for k in ("top1", "kl", "greedy", "img", "kv", "time")})
            row["top1"].append(float((lp.argmax(-1) == ref.argmax(-1)).float().mean()))
            row["kl"].append(float((ref.exp() * (ref - lp)).sum(-1).mean()))
            row["greedy"].append(sum(a == b for a, b in zip(got[:n], tokens[:n])) / max(len(tokens), 1))
            row["img"].append(held / full_img if full_img else float("nan"))
            row["kv"].append(kv / full_kv)
            row["time"].append(t / t_full)
            print(i, label, {k: round(v[-1], 4) for k, v in row.items()}, flush=True)
            write(_summary(args, i + 1, rows), args.out)  # a run cut short keeps what it measured
    return _summary(args, len(prompts), rows)


def _summary(args, photos: int, rows: dict) -> dict:
    mean = {label: {k: sum(v) / len(v) for k, v in r.items()} for label, r in rows.items()}
    return {
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads, no GPU",
        "model": args.model,
        "photos": photos,
        "prompts": "text passages (bundled corpus), compress_text=true" if args.text else "real photos",
        "new_tokens": args.new,
        "rows": mean,
    }


def plot(result: dict, path: Path) -> Path:
    """KL(full ‖ config) against the image-KV bytes held, one line per family (log-log)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    families: dict[str, list[tuple[float, float, str]]] = {}
    text = result.get("prompts", "").startswith("text")
    for label, r in result["rows"].items():
        fam = "attnpack aware" if "aware" in label else label.split(" ")[0]
        tag = label.split(" ")[1]
        x = r["kv"] if text else r["img"]
        families.setdefault(fam, []).append((max(x, 1e-3), max(r["kl"], 1e-6), tag))
    fig = Figure(figsize=(6.5, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for fam, pts in families.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        for x, y, tag in pts:
            ax.annotate(tag, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("all KV bytes held / dense" if text else "image-KV bytes held / dense")
    ax.set_ylabel("KL(full ‖ config), mean over tokens")
    ax.set_title(f"{result['model']}: bytes vs fidelity ({result['new_tokens']} tokens)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return path


def write(result: dict, out: Path) -> None:
    lines = [
        f"# AttentionPack on {result['model']} ({result.get('prompts', 'real photos')})",
        "",
        f"Machine: {result['machine']}. {result['photos']} prompts, {result['new_tokens']} generated tokens each,"
        " generated by `scripts/bench_attnpack.py`. Ratios are against the full cache in the same run"
        " (decode time: a full-cache replay run right before each configuration).",
        "",
        "| config | image-KV bytes / full | all KV bytes / full | top-1 agreement | KL(full‖cfg) | greedy agreement | decode time / full |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in result["rows"].items():
        lines.append(
            f"| {label} | {r['img']:.3f} | {r['kv']:.3f} | {r['top1']:.3f} | {r['kl']:.4f} | {r['greedy']:.3f} | {r['time']:.2f} |"
        )
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    if result["rows"]:
        plot(result, out.with_suffix(".png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--images", type=int, default=2, help="photos (or text passages with --text)")
    ap.add_argument("--text", action="store_true", help="text passages, every entry factored")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument(
        "--budgets", type=float, nargs="*", default=[0.5, 0.25], help="eviction rows (none: no eviction rows)"
    )
    ap.add_argument(
        "--paths",
        nargs="+",
        choices=["a", "b"],
        default=["a", "b"],
        help="a: pre-RoPE factors reconstructed each step; b: post-RoPE factors, rank-space decode",
    )
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/attnpack-smollm2-llava-cpu.md"))
    add_device_args(ap)
    add_threads_arg(ap)
    args = ap.parse_args()
    check_device_args(ap, args)
    if args.images < 1 or args.new < 2:
        ap.error("--images must be >= 1 and --new >= 2")
    write(run(args), args.out)


if __name__ == "__main__":
    main()
