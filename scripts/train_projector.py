"""Train ``smollm2-llava``'s projector on procedural scenes: ridge initialisation, then LM-loss steps.

    python scripts/train_projector.py --out runs/projector --steps 400            # start (or --resume)
    python scripts/train_projector.py --out runs/projector --resume               # carry on after a stop
    python scripts/train_projector.py --out runs/projector --export vlkv/runtime/models/weights/smollm2_llava_projector_<sha8>.safetensors

Only the 2-layer MLP projector trains; the vision tower and the language model stay frozen. The
recipe (``shared/spec/projector-training.md``):

1. **Ridge initialisation** (:mod:`vlkv.eval.projector_init`). Frozen vision features of training
   scenes; every patch is regressed onto the mean input embedding of the object's colour word and
   shape word (``--init-target global``), of the object the patch shows (``local``), or of that
   object's colour, shape and position word (``local-pos``: "red star left"). The map is
   written *exactly* into the MLP: ``linear_1`` holds ± copies of the top principal directions, so
   ``gelu(z) - gelu(-z) = z`` passes them through, and ``linear_2`` holds the ridge coefficients.
   ``--position-bias thirds`` adds a learned per-patch term to the projector's output
   (:mod:`vlkv.runtime.models.projector_position`), started at ``--position-alpha`` x the input
   embedding of the patch column's third ("left" / "middle" / "right"), so an object's token can say
   where it is without sharing its colour and shape words' part of the target; it then trains.
   ``--pool 2`` averages 2x2 blocks of patches before the MLP (:mod:`vlkv.runtime.models.projector_pool`:
   64 image tokens instead of 256, a shorter LM prompt per step); the fit is then per pooled token.
2. **LM loss** on the answer tokens of the training mix (:mod:`vlkv.eval.scene_tasks`: captions and
   questions; 1–3 objects, positions, counts, "left of", several pictures per prompt), AdamW with a
   cosine learning rate, gradients clipped at 1.
3. **Stage 2** (optional, with ``--lm-lora-rank``): ``--text-mix F`` asks a fraction of the samples about
   a sentence describing their scenes instead (:mod:`vlkv.eval.text_scenes`), ``--distill`` /
   ``--distill-hidden`` teach image samples from the same model given that sentence; ``--keep-text W``
   holds the adapters to the base LM on plain text (:mod:`vlkv.eval.keep_text`); ``--answer-noise P``
   corrupts answer words in the teacher-forced input (:mod:`vlkv.eval.answer_noise`); ``--question-order``
   places the question before the images too (:func:`vlkv.eval.scene_tasks.order_question`).
   ``--route-loss W`` puts the answer position's attention on the asked object's image tokens
   (:mod:`vlkv.eval.route_loss`, layers ``--route-layers``). ``--vision-blocks N`` trains the vision tower's last ``N`` blocks before the read layer as well, at
   ``lr x --vision-lr-scale`` (:mod:`vlkv.eval.vision_tune`; checkpointed and exported with the projector).

Scenes use only training colour–shape pairs; the progress bar's ``heldout`` is greedy exact-answer
accuracy on scenes of held-out pairs ("What is in the image?" → "red star", and two-object captions);
``best.pt`` keeps the checkpoint with the best such score (export it with ``--best``).
Every step's batch is drawn from ``(seed, step)``, and checkpoints hold the projector, the optimiser
and the step, so a resumed run gives the same weights as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from vlkv.eval import answer_noise, keep_text, projector_export, route_loss, text_scenes, vision_tune
from vlkv.eval.projector_config import TrainConfig
from vlkv.eval.projector_export import load_init
from vlkv.eval.projector_init import AffineProjector, order_start, pool_start, position_start, ridge_init
from vlkv.eval.scene_tasks import WHAT, Sample, prompt_text, training_sample
from vlkv.eval.scenes import random_scene
from vlkv.runtime.models import lm_lora
from vlkv.runtime.models.projector_order import ORDER_KEY
from vlkv.runtime.models.projector_position import POSITION_KEY

CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"  # the checkpoint with the best held-out score so far (early stopping)
LOG = "log.jsonl"


def load(name: str):
    from vlkv.runtime.models.registry import load_model

    loaded = load_model(name)
    for param in loaded.model.parameters():
        param.requires_grad_(False)
    return loaded


def projector(loaded) -> torch.nn.Module:
    return loaded.model.model.multi_modal_projector


def encode(
    loaded,
    sample: Sample,
    with_answer: bool = True,
    labels: str = "none",
    text_form: str | None = None,
    swaps=(),
    order: str = "after",
) -> tuple[dict, int]:
    """Model inputs for ``sample``'s prompt (+ answer + end of turn, + its follow-up turns), and the
    prompt's length in tokens. ``inputs["answer_mask"]`` (with answers) marks the answer tokens.
    ``labels`` / ``order``: picture labels, the question's place (:func:`vlkv.eval.scene_tasks.prompt_text`).
    ``text_form``: ask about a description of the scenes in that form instead of the images
    (:mod:`vlkv.eval.text_scenes`); the answers and follow-up turns are the same tokens.
    ``swaps``: answer words replaced in the input (:mod:`vlkv.eval.answer_noise`); ``inputs["targets"]``
    ``(T,)`` holds the clean tokens each slot must be predicted as.

    Answers are tokenised on their own and appended, as generation would produce them.
    """
    if text_form is None:
        prompt = prompt_text(loaded, sample.question, len(sample.scenes), labels, order)
        inputs = loaded.processor(text=prompt, images=[s.image() for s in sample.scenes], return_tensors="pt")
    else:
        prompt = text_scenes.text_prompt(loaded, sample.scenes, sample.question, text_form)
        inputs = loaded.processor(text=prompt, return_tensors="pt")
    n_prompt = inputs["input_ids"].shape[1]
    if with_answer:
        ids, mask, targets = answer_noise.answer_tokens(loaded, sample, swaps)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], ids], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["answer_mask"] = torch.cat([torch.zeros(n_prompt, dtype=torch.bool), mask])
        inputs["targets"] = torch.cat([inputs["input_ids"][0, :n_prompt], targets])
    return dict(inputs), n_prompt


def answer_logits(
    loaded, sample: Sample, labels="none", text_form=None, hidden=False, swaps=(), order="after"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """Logits ``(n, vocab)`` at the ``n`` positions after the prompt that predict the answers' turns,
    their targets ``(n,)`` (-100 where a position predicts a prompt token of a follow-up turn), the
    token ids ``(T,)`` and, with ``hidden``, every layer's hidden states (each ``(1, T, d)``)."""
    inputs, n_prompt = encode(loaded, sample, labels=labels, text_form=text_form, swaps=swaps, order=order)
    answer_mask, clean = inputs.pop("answer_mask"), inputs.pop("targets")
    ids = inputs["input_ids"]
    n_after = ids.shape[1] - n_prompt
    # logits only where answer tokens are predicted: the full-vocabulary head on every image token
    # would cost more than the rest of the step
    out = loaded.model(**inputs, logits_to_keep=n_after + 1, use_cache=False, output_hidden_states=hidden)
    targets = clean[n_prompt:].masked_fill(~answer_mask[n_prompt:], -100)
    return out.logits[0, :-1].float(), targets, ids[0], out.hidden_states if hidden else None


def sample_loss(
    loaded,
    sample: Sample,
    labels: str = "none",
    text_form: str | None = None,
    distill: float = 0.0,
    distill_hidden: float = 0.0,
    swaps=(),
    order: str = "after",
) -> torch.Tensor:
    """Mean next-token cross-entropy over the answers' tokens (and ends of turn). An image sample with
    ``distill`` / ``distill_hidden`` > 0 learns from the same model given the ``text_form`` description
    (no gradient) as well: ``distill`` x KL over the answer positions, ``distill_hidden`` x every
    layer's relative hidden-state error over the tokens both prompts end with (question and answers).
    ``swaps`` corrupt the answers' input words alike for the sample and its teacher (``order``: encode's)."""
    teach = distill > 0 or distill_hidden > 0
    if teach and text_form is None:
        raise ValueError("distill needs the teacher's text_form")
    hidden = distill_hidden > 0
    logits, targets, ids, states = answer_logits(
        loaded, sample, labels, None if teach else text_form, hidden, swaps, order
    )
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
    if teach:
        with torch.no_grad():
            teacher, _, t_ids, t_states = answer_logits(
                loaded, sample, labels, text_form, hidden, swaps, order
            )
    if distill > 0:
        loss = loss + distill * text_scenes.distill_kl(logits, teacher, targets != -100)
    if hidden:
        n = text_scenes.common_suffix(ids, t_ids)
        loss = loss + distill_hidden * text_scenes.hidden_match(states, t_states, n)
    return loss


@torch.no_grad()
def answer(loaded, sample: Sample, max_new_tokens: int = 8) -> str:
    """The greedy answer, lower-cased, without the end of turn."""
    inputs, n_prompt = encode(loaded, sample, with_answer=False)
    out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    text = loaded.processor.tokenizer.decode(out[0, n_prompt:], skip_special_tokens=True)
    return normalise(text)


def normalise(text: str) -> str:
    return " ".join(text.lower().replace(".", " ").replace(",", " ").split())


def heldout_samples(n: int, seed: int) -> list[Sample]:
    """``n`` single-object scenes ("red star") then ``n // 2`` two-object ones, held-out pairs only."""
    rng = np.random.default_rng([seed, 7])
    out = []
    for _ in range(n):
        scene = random_scene(rng, "heldout", 1)
        out.append(Sample((scene,), WHAT, scene.objects[0].name, "single"))
    for _ in range(n // 2):
        scene = random_scene(rng, "heldout", 2)
        out.append(Sample((scene,), WHAT, scene.caption, "two"))
    return out


def heldout_accuracy(loaded, samples: list[Sample]) -> dict[str, float]:
    """Exact-answer accuracy per kind (``single``, ``two``) and their mean (``score``)."""
    hits: dict[str, list[bool]] = {}
    for s in samples:
        hits.setdefault(s.kind, []).append(answer(loaded, s) == s.answer)
    acc = {kind: sum(h) / len(h) for kind, h in hits.items()}
    return acc | {"score": sum(acc.values()) / len(acc)}


def batch_for(step: int, cfg: TrainConfig) -> list[Sample]:
    rng = np.random.default_rng([cfg.seed, step])
    return [training_sample(rng, mix=cfg.mix) for _ in range(cfg.batch)]


def lr_at(step: int, cfg: TrainConfig) -> float:
    progress = step / max(1, cfg.steps - 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + np.cos(np.pi * progress)))


def anchor_penalty(params: list[torch.Tensor], start: list[torch.Tensor]) -> torch.Tensor:
    """Sum over tensors of ``|p - p0|^2 / |p0|^2`` (``|p0|`` floored so a zero bias cannot divide)."""
    terms = [(p - p0).pow(2).sum() / p0.pow(2).sum().clamp_min(1e-12) for p, p0 in zip(params, start)]
    return torch.stack(terms).sum()


# ----------------------------------------------------------------------------- training loop


def save_checkpoint(
    out: Path, step: int, state: dict, cfg: TrainConfig, extra: dict, name=CHECKPOINT
) -> None:
    """``state``: ``projector`` (the MLP's tensors), ``optimizer`` and, for the linear form, ``affine``."""
    tmp = out / (name + ".tmp")
    torch.save({"step": step, "config": asdict(cfg)} | state | extra, tmp)
    os.replace(tmp, out / name)


def train(cfg: TrainConfig, out: Path, resume: bool = False, stop_at: int | None = None, quiet: bool = False):
    """Run (or resume) training into ``out``; returns the projector's state dict after the last step.

    ``stop_at``: stop after that many steps in total (for a resumable interruption; the schedule
    still follows ``cfg.steps``). The best held-out score's checkpoint is kept as ``best.pt``.
    """
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    loaded = load(cfg.model)
    pool_start(loaded, cfg.pool, None, cfg.model)  # before the ridge fit: it fits per pooled token
    ckpt_path = out / CHECKPOINT
    step, extra, affine = 0, {}, None
    ckpt = torch.load(ckpt_path, weights_only=False) if resume and ckpt_path.is_file() else None
    if ckpt is not None:
        # settings added since the checkpoint was written take their defaults
        if asdict(TrainConfig()) | ckpt["config"] != asdict(cfg):
            raise ValueError(f"--resume: {ckpt_path} was made with other settings: {ckpt['config']}")
        step, extra = ckpt["step"], {k: ckpt[k] for k in ("init", "best", "anchor_to") if k in ckpt}
        source = ckpt
    elif cfg.init_from:
        source = load_init(cfg.init_from)
        if cfg.form == "linear" and "affine" not in source:
            raise ValueError(f"init_from {cfg.init_from} holds no affine map (not a linear-form run)")
        extra["init"] = {"from": cfg.init_from}
    else:
        info, ridge = ridge_init(
            loaded, cfg.seed, cfg.init_images, cfg.ridge, cfg.init_target, cfg.init_hidden
        )
        extra["init"], source = info, None
        affine = ridge if cfg.form == "linear" else None
    state = None if source is None else dict(source["projector"])
    order = None if state is None else state.pop(ORDER_KEY, None)
    origin = cfg.init_from if ckpt is None else str(ckpt_path)
    state = pool_start(loaded, cfg.pool, state, origin)
    position_start(loaded, cfg.position_bias, cfg.position_alpha, state, origin)
    order_start(loaded, cfg.token_order, order, origin)
    mlp = projector(loaded)  # the position-biased one, when cfg asks for it
    if source is not None and cfg.form == "linear":
        a = source["affine"]
        affine = AffineProjector(a["basis"], a["mu"], a["coef"], a["bias"], a.get("scale", 1.0))
    if cfg.form == "linear":
        loaded.model.model.multi_modal_projector = affine  # the MLP gets the map written at each save
        params = list(affine.parameters())
    else:
        params = list(mlp.parameters())
    for param in params:
        param.requires_grad_(True)
    # the position bias in a group of its own learning rate (only when it differs, so checkpoints
    # of one group, written before the setting existed, still resume)
    scaled = cfg.position_lr_scale != 1.0
    bias = [p for p in params if scaled and p is getattr(mlp, POSITION_KEY, None)]
    rest = [p for p in params if not any(p is b for b in bias)]
    groups = [{"params": rest, "scale": cfg.projector_lr_scale}]
    groups += [{"params": bias, "scale": cfg.position_lr_scale}] if bias else []
    if cfg.lm_lora_rank:
        targets = lm_lora.parse_targets(cfg.lm_lora_targets)
        adapters = lm_lora.attach(loaded.model, cfg.lm_lora_rank, targets, cfg.lm_lora_alpha, cfg.seed)
        if source is not None and "lm_lora" in source:  # a resume, or a phase after an adapter phase
            lm_lora.load_raw_state(loaded.model, source["lm_lora"])
        groups.append({"params": adapters, "scale": cfg.lm_lora_lr_scale})
        params = params + adapters
    if cfg.vision_blocks:  # its own group, last: checkpoints of runs without it still resume
        if source is not None and "vision" in source:
            vision_tune.load(loaded.model, source["vision"])
        tower = list(vision_tune.named_params(loaded.model, cfg.vision_blocks).values())
        for param in tower:
            param.requires_grad_(True)
        groups.append({"params": tower, "scale": cfg.vision_lr_scale})
        params = params + tower
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
    if cfg.anchor > 0 and "anchor_to" not in extra:  # the starting weights, kept for a resume
        extra["anchor_to"] = [p.detach().clone() for p in params]
    if ckpt is not None:
        opt.load_state_dict(ckpt["optimizer"])

    def state() -> dict:
        if affine is not None:
            affine.write_into(mlp)
        snapshot = {"projector": mlp.state_dict(), "optimizer": opt.state_dict()}
        if cfg.lm_lora_rank:
            snapshot["lm_lora"] = lm_lora.raw_state(loaded.model)
        if cfg.vision_blocks:
            snapshot["vision"] = vision_tune.state(loaded.model, cfg.vision_blocks)
        return snapshot | ({"affine": affine.state_dict()} if affine is not None else {})

    if ckpt is None:
        _log(out, {"event": "init", **extra["init"]})
        save_checkpoint(out, 0, state(), cfg, extra)
    evals = heldout_samples(cfg.eval_scenes, cfg.seed)
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    bar = tqdm(total=cfg.steps, initial=step, desc="projector", unit="step", disable=quiet)
    last_save, acc = time.monotonic(), {"score": float("nan")}
    while step < end:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg) * group.get("scale", 1.0)
        opt.zero_grad(set_to_none=True)
        total, ratios = 0.0, []
        forms = text_scenes.draw_forms(cfg.seed, step, cfg.batch, cfg.text_mix)
        batch = batch_for(step, cfg)
        noise = answer_noise.draws(cfg.seed, step, [answer_noise.answers(s) for s in batch], cfg.answer_noise)
        for sample, (as_text, form), swaps in zip(batch, forms, noise):
            # a text sample trains the adapters on the description; an image sample, with
            # --distill, learns from the description's answer distribution as well
            form = form if as_text or cfg.distill > 0 or cfg.distill_hidden > 0 else None
            teach = (0.0, 0.0) if as_text else (cfg.distill, cfg.distill_hidden)
            route_w = cfg.route_loss * (not as_text)
            route = route_loss.maybe(loaded, sample, cfg.route_layers, route_w, swaps, cfg.route_over)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast == "bf16"), route as router:
                loss = sample_loss(loaded, sample, cfg.labels, form, *teach, swaps, cfg.question_order)
                if router is not None:  # --route-loss: the answer rows' attention on the asked object
                    term = router.loss()
                    loss, ratios = loss + cfg.route_loss * term, ratios + [(router.ratio, term.item())]
                loss = loss / cfg.batch
            loss.backward()
            total += loss.item()
        if cfg.keep_text > 0:  # plain text as the base LM had it (adapters only: no image tokens)
            kept = 0.0
            for text in keep_text.items(loaded, cfg.seed, step, cfg.keep_text_items):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast == "bf16"):
                    loss = keep_text.kl_to_base(loaded, text) * (cfg.keep_text / cfg.keep_text_items)
                loss.backward()
                kept += loss.item()
            total += kept
        if cfg.anchor > 0:
            penalty = anchor_penalty(params, extra["anchor_to"]) * cfg.anchor
            penalty.backward()
            record_penalty = penalty.item()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        step += 1
        record = {"step": step, "loss": round(total, 4), "lr": lr_at(step - 1, cfg)}
        if cfg.anchor > 0:
            record["anchor"] = round(record_penalty, 5)
        if cfg.keep_text > 0:
            record["keep_text"] = round(kept, 5)
        if cfg.route_loss > 0:
            record["route"] = route_loss.summary(ratios, cfg.route_loss, cfg.batch)
        record["seconds"] = round(time.perf_counter() - t0, 2)
        save_now = time.monotonic() - last_save > 120 or step == end
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            loaded.model.eval()
            acc = heldout_accuracy(loaded, evals)
            record["heldout"] = acc
            if acc["score"] > extra.get("best", {}).get("score", -1.0):
                extra["best"] = {"step": step, **acc}
                save_checkpoint(out, step, state(), cfg, extra, name=BEST)
                save_now = True  # the main checkpoint must know the best it has seen, for a resume
        _log(out, record)
        bar.set_postfix(loss=f"{total:.3f}", heldout=f"{acc['score']:.2f}")
        bar.update()
        if save_now:
            save_checkpoint(out, step, state(), cfg, extra)
            last_save = time.monotonic()
    bar.close()
    if affine is not None:
        affine.write_into(mlp)
    return {k: v.detach().clone() for k, v in mlp.state_dict().items()}


def _log(out: Path, record: dict) -> None:
    with (out / LOG).open("a") as f:
        f.write(json.dumps(record) + "\n")


def export(out: Path, dest: Path, dtype: torch.dtype = torch.float32, name: str = CHECKPOINT) -> str:
    """Write the projector of checkpoint ``name`` in ``out`` as safetensors at ``dest``; returns its sha256."""
    return projector_export.export(out / name, dest, dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="run directory (checkpoint.pt, log.jsonl)")
    ap.add_argument("--resume", action="store_true", help="carry on from --out's checkpoint")
    ap.add_argument("--stop-at", type=int, default=None, help="stop after this many steps in total")
    ap.add_argument(
        "--export", type=Path, default=None, help="write the checkpoint's projector here and exit"
    )
    ap.add_argument("--fp16", action="store_true", help="export in float16")
    ap.add_argument("--best", action="store_true", help="export best.pt (best held-out score), not the last")
    ap.add_argument("--threads", type=int, default=1)
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        if args.export is not None:
            dtype = torch.float16 if args.fp16 else torch.float32
            digest = export(args.out, args.export, dtype, BEST if args.best else CHECKPOINT)
            print(f"{args.export} sha256 {digest}")
            return 0
        cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})
        torch.manual_seed(cfg.seed)
        train(cfg, args.out, resume=args.resume, stop_at=args.stop_at)
    except (ValueError, FileNotFoundError) as exc:
        print(f"train_projector: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
