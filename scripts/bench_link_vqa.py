"""Linking stored images on VQA questions: accuracy, fidelity to full recompute and TTFT per method.

    python scripts/bench_link_vqa.py --model smollm2-llava --images 1 2 5 10 --n 4 --out-dir DIR

Per image count N, ``--n`` held-out questions of the synthetic VQA set (:mod:`vlkv.eval.vqa`; N = 1:
"What is in the image?" about one object, N > 1: "What is in the third picture?" / "Which picture
has two stars?"). For each question a first request ("Describe these pictures.", the pictures in
reverse order) computes the records; the measured request asks the question with the pictures in
the question's order, so stored images sit at other positions than they were computed at. Per
method (``none``, ``prefix``, ``full-reuse``, ``cacheblend``, ``mpic`` k), interleaved per question:

- **accuracy**: the method's own greedy answer (≤ 10 tokens), exact, as the VQA set scores it;
- **top-1 agreement / mean KL** against full recompute over ``--tokens`` teacher-forced steps of full
  recompute's greedy continuation (the measure of ``scripts/bench_link.py`` and ``vlkv link-check``);
- **TTFT**: the linked prefill up to the first token, median over the questions.

``none`` (it links nothing) is full recompute: it runs first, and its greedy path (its tokens and
their log-probabilities) is the reference, so a question costs one full prefill less.
``--sink-records`` (an experiment, not the product's linker): records are computed after the
prompt's opening tokens (the chat template's ``<|im_start|>user\n``, which hold the attention sink)
instead of alone from position 0; only the image's rows are kept.
Every method links the same records (one store per question, dense records are method-independent);
prefixes a measured request adds are dropped before the next method, so each is a first visit.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from vlkv.eval.vqa import build_set, is_correct, normalise
from vlkv.runtime.engine import Engine
from vlkv.runtime.link.gate import _forced
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

ANSWER_TOKENS = 10


def sink_segment(engine, batch, emb, span, pool, replay: bool = False):
    """A record of the image at ``span`` computed after the prompt's tokens before its first image
    (the attention sink), at positions 0.. with the image right after them; the image's rows only.

    Drop-in for :func:`vlkv.runtime.link.linker.standalone_segment` (1-D RoPE models only).
    """
    from vlkv.runtime.backend import StepInputs
    from vlkv.runtime.kv.segments import SharedSegment

    if replay:
        raise ValueError("--sink-records makes dense records only (no kvzip replay scores)")
    if batch.positions.shape[-1] != 1:
        raise ValueError("--sink-records needs a 1-D RoPE model (M-RoPE grids are not shifted here)")
    a, b = span
    opening = batch.spans[0].image_spans[0][0]
    idx = torch.cat([torch.arange(opening), torch.arange(a, b)]).to(batch.input_ids.device)
    n = len(idx)
    pos = torch.arange(n, dtype=batch.positions.dtype, device=batch.positions.device).view(1, n, 1)
    cache = engine.new_cache(batch, pool=pool)
    try:
        inputs = StepInputs(
            batch.input_ids[:, idx], pos, batch.modality[:, idx], batch.lengths.new_tensor([n]), emb[:, idx]
        )
        engine.backend.step(inputs, cache)
        return SharedSegment.from_cache(cache, opening, n)
    finally:
        cache.release()


def items_for(n_images: int, n: int, seed: int) -> list:
    """``n`` held-out questions over ``n_images`` pictures (one-object captions for one picture)."""
    if n_images == 1:
        return build_set(n_single=n, n_two=0, n_multi=0, counts=(), seed=seed)
    return build_set(n_single=0, n_two=0, n_multi=n, counts=(n_images,), seed=seed)


def method_name(spec: LinkSpec) -> str:
    if spec.method == "mpic":
        return f"mpic-{spec.k}" if spec.pick == "first" else f"mpic-{spec.pick}-{spec.k}"
    return f"cacheblend-{spec.r:g}" if spec.method == "cacheblend" else spec.method


def greedy(engine, batch, cache, out, max_tokens: int) -> list[int]:
    """Greedy tokens from a prefilled ``cache`` (``out``: the prefill's output), up to the end of turn."""
    policy, ids = make_policy("full"), []
    tok = int(out.logits.argmax(-1))
    for step in range(1, max_tokens + 1):
        if tok in engine.eos_ids:
            break
        ids.append(tok)
        if step == max_tokens:
            break
        tok = int(engine.decode(torch.tensor([tok]), batch, policy, cache, step).logits.argmax(-1))
    return ids


def greedy_path(engine, batch, cache, out, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """``steps`` greedy tokens past the end of turn, with every step's log-probabilities ``(vocab,)``."""
    policy = make_policy("full")
    logps = [out.logits.float().log_softmax(-1)[0]]
    ids = [int(logps[0].argmax())]
    for step in range(1, steps):
        out = engine.decode(torch.tensor([ids[-1]]), batch, policy, cache, step)
        logps.append(out.logits.float().log_softmax(-1)[0])
        ids.append(int(logps[-1].argmax()))
    return ids, logps


def _text(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def store_reversed(engine, images, source, pool) -> None:
    """Compute and store the pictures' records by a first request that holds them in reverse order, so
    the measured request links every picture at another position than it was computed at."""
    first = Prompt("Describe these pictures.", images[::-1])
    b1 = engine.encode([first])
    c1 = engine.new_cache(b1, pool=pool)
    link_prefill(engine, b1, first.images, c1, LinkSpec("full-reuse"), source)
    c1.release()


def measure_item(engine, pool, item, specs: list[LinkSpec], tokens: int) -> dict[str, dict]:
    """One question under every method: accuracy, agreement, KL, TTFT; ``{method: row}``."""
    images = item.images
    prompt = Prompt(item.sample.question, images)
    batch = engine.encode([prompt])
    source = RecordSource.for_engine(engine, SegmentStore(pool))
    store_reversed(engine, images, source, pool)
    # full recompute ("none", which links nothing) first: its greedy path is the reference
    cache = engine.new_cache(batch, pool=pool)
    t0 = time.perf_counter()
    out, st = link_prefill(engine, batch, images, cache, LinkSpec("none"), source)
    int(out.logits.argmax(-1))
    none_ttft = time.perf_counter() - t0
    ids, logps = greedy_path(engine, batch, cache, out, max(tokens, ANSWER_TOKENS))
    cache.release()
    want, ref = ids[:tokens], logps[:tokens]
    eos = next((i for i, t in enumerate(ids) if t in engine.eos_ids), len(ids))
    answer_span = min(eos + 1, ANSWER_TOKENS)  # the answer's tokens and its end of turn
    full_answer = _text(engine, ids[: min(eos, ANSWER_TOKENS)])
    rows = {
        "none": {
            "ttft_s": none_ttft,
            "agreement": 1.0,
            "kl": 0.0,
            "answer": normalise(full_answer),
            "correct": is_correct(full_answer, item.sample.answer),
            "recomputed": st.recomputed_tokens,
            "reused": st.reused_tokens,
            "prompt_tokens": int(batch.lengths[0]),
        }
    }
    for spec in specs:  # interleaved: every method on this question before the next question
        if spec.method == "none":
            continue
        known = set(source.segments.prefixes)
        cache = engine.new_cache(batch, pool=pool)
        t0 = time.perf_counter()
        out, st = link_prefill(engine, batch, images, cache, spec, source)
        int(out.logits.argmax(-1))  # the first token ends the TTFT
        ttft = time.perf_counter() - t0
        got = _forced(engine, batch, cache, out, want)
        cache.release()
        top1 = [float(r.argmax() == g.argmax()) for r, g in zip(ref, got, strict=True)]
        kl = sum(float((r.exp() * (r - g)).sum()) for r, g in zip(ref, got, strict=True)) / len(ref)
        if answer_span <= len(top1) and all(top1[:answer_span]):
            text = full_answer  # greedy follows full recompute through the end of the answer
        else:  # it leaves full recompute's path inside the answer: decode its own
            cache = engine.new_cache(batch, pool=pool)
            out, _ = link_prefill(engine, batch, images, cache, spec, source)
            text = _text(engine, greedy(engine, batch, cache, out, ANSWER_TOKENS))
            cache.release()
        for key in set(source.segments.prefixes) - known:
            source.segments.prefixes.pop(key).release()
        rows[method_name(spec)] = {
            "ttft_s": ttft,
            "agreement": sum(top1) / len(top1),
            "kl": kl,
            "answer": normalise(text),
            "correct": is_correct(text, item.sample.answer),
            "recomputed": st.recomputed_tokens,
            "reused": st.reused_tokens,
            "prompt_tokens": int(batch.lengths[0]),
        }
    return rows


def summarise(per_item: list[dict[str, dict]]) -> dict[str, dict]:
    out = {}
    for name in per_item[0]:
        rows = [r[name] for r in per_item]
        out[name] = {
            "n": len(rows),
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            # the 64-token agreement is mostly text after the answer's end of turn when answers are
            # short: whether the answer itself is full recompute's is the sharper check
            "answer_match": sum(item[name]["answer"] == item["none"]["answer"] for item in per_item)
            / len(rows),
            "agreement": statistics.mean(r["agreement"] for r in rows),
            "kl": statistics.mean(r["kl"] for r in rows),
            "ttft_s": statistics.median(r["ttft_s"] for r in rows),
            "recomputed": statistics.mean(r["recomputed"] for r in rows),
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rows),
        }
    return out


def table(results: dict[int, dict[str, dict]]) -> list[str]:
    lines = [
        "| images | method | n | VQA accuracy | answer = none's | top-1 agreement | mean KL | TTFT (s) | vs none | vs prefix "
        "| recomputed / prompt |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n_images, rows in results.items():
        none, prefix = rows["none"]["ttft_s"], rows["prefix"]["ttft_s"]
        for name, r in rows.items():
            lines.append(
                f"| {n_images} | {name} | {r['n']} | {r['accuracy']:.2f} | {r['answer_match']:.2f} | {r['agreement']:.3f} | "
                f"{r['kl']:.4f} | "
                f"{r['ttft_s']:.2f} | {r['ttft_s'] / none:.2f} | {r['ttft_s'] / prefix:.2f} | "
                f"{r['recomputed']:.0f} / {r['prompt_tokens']:.0f} |"
            )
    return lines


def write(results: dict, raw: dict, args) -> str:
    """The markdown table (and, with ``--out-dir``, it and the JSON of every row) so far."""
    head = (
        f"Machine: {platform.machine()} CPU, {args.threads} thread(s); model {args.model}; "
        f"{args.n} questions per image count, {args.tokens} teacher-forced tokens; methods interleaved per question."
    )
    md = "\n".join([head, "", *table(results)]) + "\n"
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "link-vqa.md").write_text(md)
        payload = {"model": args.model, "args": {k: str(v) for k, v in vars(args).items() if k != "out_dir"}}
        payload |= {"summary": results, "items": raw}
        (args.out_dir / "link-vqa.json").write_text(json.dumps(payload, indent=1) + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 2, 5, 10])
    ap.add_argument("--n", type=int, default=4, help="questions per image count")
    ap.add_argument("--k", type=int, nargs="+", default=[0, 8, 16, 32, 64])
    ap.add_argument("--r", type=float, nargs="*", default=[0.15], help="CacheBlend fractions")
    ap.add_argument(
        "--picks",
        nargs="*",
        default=[],
        metavar="PICK:K",
        help="MPIC variants measured after the --k ones, e.g. ramp:32 (LinkSpec.pick)",
    )
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="instead of the table: where linked caches leave full recompute (per-layer K/V deviation, "
        "first divergent token) for full-reuse, cacheblend, mpic-k (scripts/link_diagnosis.py)",
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--sink-records",
        action="store_true",
        help="experiment: records computed after the prompt's opening tokens (see the module's doc)",
    )
    ap.add_argument("--out-dir", type=Path, default=None, help="write link-vqa.json and link-vqa.md here")
    args = ap.parse_args(argv)
    if args.n < 1 or args.tokens < 1 or any(not 1 <= c <= 10 for c in args.images):
        print("bench_link_vqa: --n and --tokens must be >= 1, --images in 1..10", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.diagnose:
        from link_diagnosis import diagnose

        return diagnose(args, items_for, link_specs(args))
    from vlkv.runtime.link import linker

    original = linker.standalone_segment
    if args.sink_records:
        linker.standalone_segment = sink_segment
    try:
        results, raw = run(args)
    finally:
        linker.standalone_segment = original
    print(write(results, raw, args))
    return 0


def link_specs(args) -> list[LinkSpec]:
    """The linking methods measured: full-reuse, CacheBlend per ``--r``, MPIC per ``--k`` and ``--picks``."""
    specs = [LinkSpec("full-reuse")]
    specs += [LinkSpec("cacheblend", r=r) for r in args.r] + [LinkSpec("mpic", k) for k in args.k]
    for text in args.picks:
        pick, _, k = text.partition(":")
        specs.append(LinkSpec("mpic", int(k or 32), pick=pick))
    return specs


def run(args) -> tuple[dict, dict]:
    """Every image count's questions under every method; (summaries, per-question rows)."""
    engine = Engine(load_model(args.model))
    specs = [LinkSpec("none"), LinkSpec("prefix"), *link_specs(args)]
    pool = engine.new_cache(engine.encode([Prompt("x")])).pool
    results, raw = {}, {}
    for n_images in args.images:
        per_item, logged = [], []
        for item in items_for(n_images, args.n, args.seed):
            per_item.append(measure_item(engine, pool, item, specs, args.tokens))
            logged.append(
                {"question": item.sample.question, "expected": item.sample.answer, "methods": per_item[-1]}
            )
            print(
                f"{n_images} images: {item.sample.question!r} -> "
                + ", ".join(f"{k} {v['answer']!r}" for k, v in list(per_item[-1].items())[:3]),
                file=sys.stderr,
                flush=True,
            )
        results[n_images], raw[n_images] = summarise(per_item), logged
        print("\n".join(table({n_images: results[n_images]})[2:]), flush=True)
        write(results, raw, args)  # after every image count: a stopped run keeps what it measured
    return results, raw


if __name__ == "__main__":
    sys.exit(main())
