"""Query-agnostic image records: compress an image's cache once, then ask it many different questions.

    python scripts/bench_image_qa.py --out docs/benchmarks/<dir>/image-qa

For each photo, the record is the prompt up to the end of the image (chat prefix + image tokens),
prefilled and compressed once by a policy. Every question is then teacher-forced over the
compressed record (the question's own tokens, the assistant header and the full cache's greedy
answer), and the answer tokens' next-token distributions are compared with the uncompressed
record's: KL(full ‖ policy), top-1 agreement and the answer's NLL. Intervals: percentile bootstrap
over (photo, question) pairs. Compression cost: the record's prefill (+ replay) time over a plain
prefill's, measured interleaved per photo (``--clock cpu``: the process's CPU time, steadier on a
shared machine).

Every comparison covers an answer up to and including its first end-of-turn token (all
``--answer`` tokens when there is none). *Exact answer*: every answer token's top-1 over the compressed
record equals the uncompressed record's greedy token, i.e. greedy decoding over the compressed record
gives the same answer word for word.

``--scene "red circle" "blue square"``: one procedural scene (``vlkv.eval.scenes``, the trained
``smollm2-llava`` projector's domain) instead of photos, asked 8 questions whose answers are known
(:func:`scene_questions`); the uncompressed record's own accuracy is reported beside. ``--scenes K``:
``K`` such scenes of held-out colour–shape pairs (:func:`heldout_scenes`), 8 questions each.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_device_args, check_device_args, load_for_bench  # noqa: E402

QUESTIONS = (
    "What is in this picture?",
    "Describe the colors in the image.",
    "What is in the background?",
    "Is there a person in the image?",
    "What is the main object made of?",
    "Describe the image in one sentence.",
    "What is on the left side of the image?",
    "Is this photo taken indoors or outdoors?",
    "How many objects are visible?",
    "What mood does this image convey?",
)
DESCRIBE = "\n\nDescribe the image in detail:"
# name → (policy, settings). "-replay" is the policy's default (since 0.3.0 the fast replay: a bf16
# replay on bf16 hardware, kvgrad's attn_grad="values"); "-fp32" the earlier default (fp32, exact
# gradient; the same kept sets as exact=True, tested)
CONFIGS = {
    "kvzip-replay": ("kvzip", {}),
    "kvzip-replay-fp32": ("kvzip", {"replay_dtype": "model"}),
    "kvzip-replay-layer": ("kvzip", {"scope": "layer"}),
    "kvzip-describe": ("kvzip", {"mode": "prompt", "template": DESCRIBE}),
    "kvgrad-replay": ("kvgrad", {}),
    "kvgrad-replay-fp32": ("kvgrad", {"attn_grad": "full", "replay_dtype": "model"}),
    "snapkv": ("snapkv", {}),
    "h2o": ("h2o", {}),
}


def scene_questions(names: list[str]) -> list[tuple[str, str]]:
    """8 (question, answer) pairs about a two-object scene, in the trained projector's question forms."""
    from vlkv.eval import scene_tasks as t

    if len(names) != 2:
        raise SystemExit("error: --scene takes two objects, e.g. --scene 'red circle' 'blue square'")
    (lc, ls), (rc, rs) = (n.split() for n in names)
    if ls == rs:
        raise SystemExit("error: --scene needs two different shapes (the questions name them)")
    return [
        (t.WHAT, f"{names[0]} and {names[1]}"),
        (t.ON_THE.format(position="left"), names[0]),
        (t.ON_THE.format(position="right"), names[1]),
        (t.LEFT_OF.format(name=names[1]), names[0]),
        (t.COLOUR_OF.format(shape=ls), lc),
        (t.COLOUR_OF.format(shape=rs), rc),
        (t.WHERE.format(name=names[0]), "left"),
        (t.WHERE.format(name=names[1]), "right"),
    ]


def heldout_scenes(k: int, seed: int = 0) -> list[list[str]]:
    """``k`` two-object scenes of held-out colour–shape pairs (never drawn in training), two different
    shapes each, drawn from ``seed``: ``[["red star", "green circle"], ...]``."""
    import numpy as np

    from vlkv.eval.scenes import pairs

    if k < 1:
        raise SystemExit(f"error: --scenes must be >= 1, got {k}")
    held = pairs("heldout")
    rng = np.random.default_rng(seed)
    out: list[list[str]] = []
    while len(out) < k:
        i, j = rng.choice(len(held), 2, replace=False)
        (lc, ls), (rc, rs) = held[i], held[j]
        if ls != rs:
            out.append([f"{lc} {ls}", f"{rc} {rs}"])
    return out


def _answer_mask(answers: torch.Tensor, eos: set[int]) -> torch.Tensor:
    """``(Q, A)`` bool: each answer's tokens up to and including its first end-of-turn token."""
    is_end = torch.isin(answers, torch.tensor(sorted(eos), dtype=answers.dtype))
    after = is_end.long().cumsum(1) - is_end.long()  # end tokens strictly before this one
    return after == 0


def _over_answer(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(Q, A)`` values → ``(Q,)``: the mean over each answer's own tokens (``mask``, float)."""
    return (x.double() * mask).sum(1) / mask.sum(1)


def _weights_id(engine) -> dict:
    """Which weights answered: a digest of the projector's tensors and the vision feature layer."""
    import hashlib

    model = engine.loaded.model
    proj = getattr(getattr(model, "model", model), "multi_modal_projector", None)
    digest = hashlib.sha256()
    for name, t in sorted((proj.state_dict() if proj is not None else {}).items()):
        digest.update(name.encode() + t.detach().float().cpu().numpy().tobytes())
    return {
        "projector_sha256": digest.hexdigest()[:16],
        "vision_feature_layer": getattr(model.config, "vision_feature_layer", None),
    }


def _record(engine, image, questions):
    """The record's batch (chat prefix + image) and each question's suffix ids (after the image)."""
    from vlkv.runtime.prompt import EncodedPrompt, Prompt, Spans, collate

    enc = engine.encode([Prompt(q, [image]) for q in questions]).prompts
    end = enc[0].spans.image_spans[-1][1]
    for e in enc:
        if not torch.equal(e.input_ids[:end], enc[0].input_ids[:end]):
            raise RuntimeError("the questions' prompts differ before the image ends")
    p = enc[0]
    ctx = EncodedPrompt(
        p.input_ids[:end], p.positions[:end], p.modality[:end], p.vision, Spans(end, p.spans.image_spans)
    )
    return ctx, [e.input_ids[end:] for e in enc], collate


def _compress(engine, ctx, collate, policy, now=time.perf_counter):
    """Prefill the record once with ``policy`` (its edits included); returns the cache and the seconds
    on the ``now`` clock."""
    batch = collate([ctx], engine.pad_id)
    cache = engine.new_cache(batch)
    t0 = now()
    engine.prefill(batch, policy, cache)
    return cache, now() - t0


def _answer_logits(engine, cache, policy, rows: list[torch.Tensor], starts: list[int], width: int):
    """Teacher-force every ``rows[i]`` over the same compressed ``cache``, rolled back after each one;
    return ``(Q, width, V)`` log-probabilities of the rows from ``starts[i]`` on."""
    from vlkv.runtime.backend import StepInputs
    from vlkv.runtime.cache import Modality

    processed = cache.processed.clone()
    saved = [(layer.lengths.clone(), layer.next_order.clone()) for layer in cache.layers]
    out = []
    for r, s in zip(rows, starts):
        t = r.shape[0]
        pos = engine.decode_positions(policy, cache) + torch.arange(t)[None, :, None]
        step = engine.backend.step(
            StepInputs(
                r[None],
                pos,
                torch.full((1, t), int(Modality.TEXT), dtype=torch.int8),
                torch.tensor([t]),
                all_logits=True,
            ),
            cache,
            None,
        )
        out.append(torch.log_softmax(step.logits[0, s : s + width].float(), -1))
        # drop the question's appended entries: the compressed record is left-aligned in [0, n)
        for layer, (n, order) in zip(cache.layers, saved):
            keep = torch.arange(int(n.max()), device=layer.device)[None, None].expand(1, layer.kv_heads, -1)
            layer.select(keep.contiguous(), n)
            layer.next_order = order.clone()
        cache.processed = processed.clone()
    return torch.stack(out)


def _boot(x: torch.Tensor, n: int = 2000) -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, x.shape[0], (n, x.shape[0]), generator=g)
    m = x.double()[idx].mean(1)
    lo, hi = torch.quantile(m, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(x.double().mean()), float(lo), float(hi)


def _write(args, questions, per, cost, done) -> str:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        key: {m: _boot(torch.tensor(v)) for m, v in d.items()}
        | {"cost_ratio": statistics.median(cost[key]), "cost_range": [min(cost[key]), max(cost[key])]}
        for key, d in per.items()
    }
    machine = f"{platform.machine()} CPU VM, {args.threads} threads, no GPU"
    meta = {
        "model": args.model,
        "photos": done,
        "questions": list(questions),
        "answer_tokens": args.answer,
        "clock": args.clock,
        **args.extra_meta,
    }
    args.out.with_suffix(".json").write_text(
        json.dumps({"machine": machine, **meta, "results": summary}, indent=1)
    )
    lines = [
        f"# Image records compressed once, asked {len(questions)} questions ({args.model})",
        "",
        f"Machine: {machine}. Photos: {', '.join(done)}; {args.answer} answer tokens per question "
        "(the full cache's greedy answer, teacher-forced, one question at a time over the same compressed record). Mean over (photo, question) pairs, 95% bootstrap "
        "interval. Cost: record prefill (+ scoring) time / plain prefill time, median over photos, "
        "measured back to back.",
        "",
        *(
            [
                f"Uncompressed record's own accuracy on the scene's known answers: {args.extra_meta['full_accuracy']:.3f}.",
                "",
            ]
            if "full_accuracy" in args.extra_meta
            else []
        ),
        f"Weights: {json.dumps({k: args.extra_meta.get(k) for k in ('projector_sha256', 'vision_feature_layer')})}; "
        f"{args.clock} clock.",
        "",
        "| config | budget | KL(full‖policy) | top-1 agreement | exact answer | ΔNLL of the answer | cost × prefill |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, s in summary.items():
        cfg, budget = key.split("@")

        def fmt(m, f="{:.4f}", s=s):
            v, lo, hi = s[m]
            return f"{f.format(v)} [{f.format(lo)}, {f.format(hi)}]"

        lines.append(
            f"| {cfg} | {budget} | {fmt('kl')} | {fmt('top1', '{:.3f}')} | {fmt('exact', '{:.3f}')} | {fmt('dnll')} "
            f"| {s['cost_ratio']:.2f} [{s['cost_range'][0]:.2f}, {s['cost_range'][1]:.2f}] |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/image-qa-smollm2-llava-cpu.json"))
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--photos", nargs="+", default=["chelsea", "astronaut", "coffee", "rocket"])
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    ap.add_argument("--answer", type=int, default=12, help="answer tokens compared per question")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--scene", nargs="+", default=None, help="one procedural scene of two objects instead of photos"
    )
    ap.add_argument(
        "--scenes", type=int, default=None, help="K procedural two-object scenes of held-out pairs (seed 0)"
    )
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cost clock (cpu: CPU time)")
    add_device_args(ap)
    args = ap.parse_args(argv)
    check_device_args(ap, args)
    torch.set_num_threads(args.threads)
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.photos import real_photos
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt

    engine = Engine(load_for_bench(args.model, args.device, args.dtype))
    args.extra_meta = _weights_id(engine)
    if args.scene and args.scenes:
        raise SystemExit("error: give --scene or --scenes, not both")
    # records: (name, image, questions, known answers or None)
    if args.scene or args.scenes:
        from vlkv.eval.scenes import make_scene

        scenes = [args.scene] if args.scene else heldout_scenes(args.scenes)
        records = []
        for i, names in enumerate(scenes):
            qa = scene_questions(names)[: args.questions]
            image = make_scene(names, seed=i).image()
            records.append((f"scene: {' + '.join(names)}", image, [q for q, _ in qa], [a for _, a in qa]))
    else:
        questions = QUESTIONS[: args.questions]
        records = [(n, im, questions, None) for n, im in zip(args.photos, real_photos(args.photos))]
    questions = records[0][2]
    right, asked = 0, 0
    per: dict[str, dict[str, list]] = {}
    cost: dict[str, list[float]] = {}
    done: list[str] = []
    for name, image, questions, truth in records:
        ctx, suffixes, collate = _record(engine, image, questions)
        answers = [
            torch.tensor(s.token_ids)
            for s in engine.generate(
                [Prompt(q, [image]) for q in questions], make_policy("full"), args.answer, stop_at_eos=False
            ).samples
        ]
        if truth is not None:
            from vlkv.eval.vqa import is_correct

            said = [engine.tokenizer.decode(a.tolist()) for a in answers]
            right, asked = right + sum(map(is_correct, said, truth)), asked + len(truth)
            args.extra_meta.setdefault("full_answers", {})[name] = said
            args.extra_meta["full_accuracy"] = right / asked
        mask = _answer_mask(torch.stack(answers), engine.eos_ids).double()  # (Q, A)
        rows = [torch.cat([s, a]) for s, a in zip(suffixes, answers)]
        starts = [s.shape[0] - 1 for s in suffixes]  # the row predicting the first answer token
        base, _ = _compress(engine, ctx, collate, make_policy("full"))
        full = _answer_logits(engine, base, make_policy("full"), rows, starts, args.answer)
        # the roll-back is exact: the last question, asked after all the others, equals a fresh record
        fresh, _ = _compress(engine, ctx, collate, make_policy("full"))
        alone = _answer_logits(engine, fresh, make_policy("full"), rows[-1:], starts[-1:], args.answer)
        torch.testing.assert_close(alone[0], full[-1], rtol=1e-4, atol=1e-4)
        target = torch.stack(answers)
        for cfg in args.configs:
            pol, kw = CONFIGS[cfg]
            for budget in args.budgets:
                key = f"{cfg}@{budget:g}"
                policy = make_policy(pol, budget=budget, **kw)
                # compression cost: this record's prefill + scoring against a plain prefill just before it
                _, t_plain = _compress(engine, ctx, collate, make_policy("full"), now)
                cache, t_pol = _compress(engine, ctx, collate, policy, now)
                cost.setdefault(key, []).append(t_pol / t_plain)
                got = _answer_logits(engine, cache, policy, rows, starts, args.answer)
                cache.release()
                kl = _over_answer(mask, (full.exp() * (full - got)).sum(-1))
                same = got.argmax(-1) == target  # the uncompressed record's greedy tokens
                top1 = _over_answer(mask, got.argmax(-1) == full.argmax(-1))
                exact = (same | ~mask.bool()).all(1).double()
                nll = _over_answer(mask, -got.gather(-1, target[..., None])[..., 0])
                nll_full = _over_answer(mask, -full.gather(-1, target[..., None])[..., 0])
                d = per.setdefault(key, {"kl": [], "top1": [], "exact": [], "dnll": []})
                d["kl"] += kl.tolist()
                d["top1"] += top1.tolist()
                d["exact"] += exact.tolist()
                d["dnll"] += (nll - nll_full).tolist()
                _write(args, questions, per, cost, [*done, name])  # a bounded run keeps what it measured
                print(f"{name} {key}: KL {float(kl.mean()):.4f} top1 {float(top1.mean()):.3f}", flush=True)
        done.append(name)
    print(_write(args, questions, per, cost, done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
