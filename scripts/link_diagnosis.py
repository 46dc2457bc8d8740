"""Where a linked cache leaves full recompute: ``scripts/bench_link_vqa.py --diagnose``.

    python scripts/bench_link_vqa.py --diagnose --images 10 --n 8 --k 32 --seed 0 --out-dir DIR

Per question (the benchmark's items, records made the same way), full recompute's greedy path of
``--tokens`` tokens is the reference; per linking method:

- the first step where the linked cache's top-1 leaves that path, whether it falls inside the answer
  (its tokens and end of turn), the two tokens there and full recompute's own top-1 lead there
  (log-probability of its top-1 minus its top-2; the item's median lead beside it);
- every layer's K/V deviation of the linked cache from the full prefill's
  (:func:`vlkv.runtime.link.deviation.kv_deviation`), averaged per picture over its linked rows and
  over its recomputed rows, and over the text after the last picture (the question);
- for full reuse: per picture, how many of the 32 rows deviating most in the upper half of the layers
  are among the 32 that deviate most at CacheBlend's check layer, and among the first 32 (MPIC's).
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from vlkv.runtime.engine import Engine
from vlkv.runtime.link.cacheblend import CHECK_LAYER
from vlkv.runtime.link.deviation import kv_deviation
from vlkv.runtime.link.gate import _forced
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.prompt import Prompt

TOP = 32


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def diagnose_item(engine, pool, item, specs: list[LinkSpec], tokens: int) -> dict:
    """One question: per method its divergence from full recompute and its per-layer K/V deviation."""
    from bench_link_vqa import greedy_path, method_name, store_reversed

    images = item.images
    batch = engine.encode([Prompt(item.sample.question, images)])
    n = int(batch.lengths[0])
    spans = batch.spans[0].image_spans
    source = RecordSource.for_engine(engine, SegmentStore(pool))
    store_reversed(engine, images, source, pool)
    full = engine.new_cache(batch, pool=pool)
    out, _ = link_prefill(engine, batch, images, full, LinkSpec("none"), source)
    ids, ref = greedy_path(engine, batch, full, out, tokens)
    eos = next((i for i, t in enumerate(ids) if t in engine.eos_ids), len(ids))
    row = {"question": item.sample.question, "expected": item.sample.answer, "prompt_tokens": n}
    margins = [_r(float(t[0] - t[1])) for t in (r.topk(2).values for r in ref)]
    row["margin_median"] = _r(statistics.median(margins))
    row |= {"answer_tokens": eos + 1, "reference": engine.tokenizer.decode(ids[:eos]), "methods": {}}
    text = torch.ones(n, dtype=torch.bool)
    for a, b in spans:
        text[a:b] = False
    question = torch.arange(n) >= spans[-1][1]
    for spec in specs:
        cache = engine.new_cache(batch, pool=pool)
        out, st = link_prefill(engine, batch, images, cache, spec, source)
        dk, dv = kv_deviation(cache, full, n)  # (L, n)
        linked = _linked_rows(cache, n)
        got = _forced(engine, batch, cache, out, ids)
        cache.release()
        top1 = [int(r.argmax() == g.argmax()) for r, g in zip(ref, got)]
        div = next((i for i, t in enumerate(top1) if not t), None)
        m = {"agreement": sum(top1) / len(top1), "first_divergence": div, "recomputed": st.recomputed_tokens}
        if div is not None:
            m |= {"in_answer": div <= eos, "want": engine.tokenizer.decode([ids[div]])}
            m["got"] = engine.tokenizer.decode([int(got[div].argmax())])
            m["margin"] = margins[div]  # full recompute's own top-1 lead there (nats)
        for name, d in (("k", dk), ("v", dv)):
            m[f"d{name}_linked"] = [[_r(d[layer, a:b][linked[a:b]].mean()) if linked[a:b].any() else None
                                     for a, b in spans] for layer in range(d.shape[0])]  # fmt: skip
            m[f"d{name}_fresh"] = [[_r(d[layer, a:b][~linked[a:b]].mean()) if (~linked[a:b]).any() else None
                                    for a, b in spans] for layer in range(d.shape[0])]  # fmt: skip
            m[f"d{name}_question"] = [_r(d[layer, question & text].mean()) for layer in range(d.shape[0])]
        if spec.method == "full-reuse":
            m |= _overlaps(dk, spans)
        row["methods"][method_name(spec)] = m
    full.release()
    return row


def _linked_rows(cache, n: int) -> torch.Tensor:
    """``(n,)`` bool: which rows of a sorted linked cache hold linked (shared, pre-RoPE) entries."""
    layer = cache.layers[0]
    ids = layer.slots[:, :, :n]
    return layer.pool.is_prerope(layer.layer, ids.clamp(min=0))[0, 0].cpu()


def _overlaps(dk: torch.Tensor, spans) -> dict:
    """Per picture: of the ``TOP`` rows whose K deviates most over the upper half of the layers, how
    many are also top at the check layer, and how many are among the first ``TOP``."""
    deep = dk[dk.shape[0] // 2 :].mean(0)
    check, first = [], []
    for a, b in spans:
        t = min(TOP, b - a)
        want = set(deep[a:b].topk(t).indices.tolist())
        check.append(len(want & set(dk[CHECK_LAYER, a:b].topk(t).indices.tolist())) / t)
        first.append(len(want & set(range(t))) / t)
    return {"deep_top_in_check_top": check, "deep_top_in_first": first}


def diagnose(args, items_for, specs: list[LinkSpec]) -> int:
    engine = Engine(load_model(args.model))
    pool = engine.new_cache(engine.encode([Prompt("x")])).pool
    rows = []
    for n_images in args.images:
        for item in items_for(n_images, args.n, args.seed):
            rows.append(diagnose_item(engine, pool, item, specs, args.tokens))
            ms = rows[-1]["methods"]
            print(
                f"{item.sample.question!r}: "
                + ", ".join(
                    f"{k} div {v['first_divergence']} agr {v['agreement']:.3f}" for k, v in ms.items()
                ),
                file=sys.stderr,
                flush=True,
            )
    summary = summarise(rows)
    print(json.dumps(summary, indent=1))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "items": rows}
        (args.out_dir / "diagnosis.json").write_text(json.dumps(payload) + "\n")
    return 0


def summarise(rows: list[dict]) -> dict:
    """Per method: mean per-picture deviation per layer (linked / recomputed rows), question rows,
    divergence counts and (full reuse) the top-row overlaps."""
    out = {}
    for name in rows[0]["methods"]:
        ms = [r["methods"][name] for r in rows]
        s = {"agreement": statistics.mean(m["agreement"] for m in ms)}
        s["diverged"] = sum(m["first_divergence"] is not None for m in ms)
        s["diverged_in_answer"] = sum(bool(m.get("in_answer")) for m in ms)
        s["first_divergence"] = [m["first_divergence"] for m in ms]
        for key in ("dk_linked", "dv_linked", "dk_fresh", "dv_fresh"):
            s[key] = [[_mean([m[key][layer][j] for m in ms]) for j in range(len(ms[0][key][0]))]
                      for layer in range(len(ms[0][key]))]  # fmt: skip
        for key in ("dk_question", "dv_question"):
            s[key] = [_mean([m[key][layer] for m in ms]) for layer in range(len(ms[0][key]))]
        for key in ("deep_top_in_check_top", "deep_top_in_first"):
            if key in ms[0]:
                s[key] = [_mean([m[key][j] for m in ms]) for j in range(len(ms[0][key]))]
        out[name] = s
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return _r(statistics.mean(xs)) if xs else None
